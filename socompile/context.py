"""What one compile made: options, IR, plan, the runtime binding, and the graph dumps. Passed explicitly;
nothing of it is global."""
from __future__ import annotations

import dataclasses
from typing import Any

from .options import Options


@dataclasses.dataclass
class GraphDump:
    phase: str
    pass_name: str
    before: str
    after: str
    graph_module: Any = None   # the rewritten GraphModule (for DOT drawings)


@dataclasses.dataclass
class CompileContext:
    options: Options
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)   # graph input index -> name
    ir: Any = None
    plan: Any = None
    optimizer: Any = None
    claim_handle: int = -1
    origin: Any = None          # optim.graph_claim.GraphOrigin: the graph's Dynamo frame, piece of a split or not
    forward_graph: Any = None
    backward_graph: Any = None
    dumps: list[GraphDump] = dataclasses.field(default_factory=list)
    # what a forward pass hands to its backward pass (passes/table.py): pass name -> its frozen record
    pass_records: dict[str, Any] = dataclasses.field(default_factory=dict)

    def record_dump(self, phase: str, pass_name: str, before: str, after: str, gm=None) -> None:
        self.dumps.append(GraphDump(phase, pass_name, before, after, gm))
