"""What one compile made: options, IR, plan, the runtime binding, and the graph dumps. Passed explicitly;
nothing of it is global. Every attribute the pipeline or a pass sets is a field below (socompile/pipeline.py
says which step sets which); the class has slots, so setting one that is not declared is an AttributeError."""
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


@dataclasses.dataclass(slots=True)
class CompileContext:
    options: Options
    # --- what was compiled (backend.py; offline.py for a traced model)
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)   # graph input index -> name
    param_objects: dict[int, Any] = dataclasses.field(default_factory=dict)  # graph input index -> nn.Parameter
    optimizer: Any = None       # the socompile.AdamW owning the parameters; None: no passes run
    origin: Any = None          # optim.graph_claim.GraphOrigin: the graph's Dynamo frame, piece of a split or not
    # --- capture and plan (pipeline: capture, plan, activation layout)
    ir: Any = None              # capture.ir.IR of the graphs that run (rebuilt after a recompute re-partition)
    plan: Any = None            # plan.Plan, made once per compile (re-anchored on the new IR after a re-partition)
    plan_details: Any = None    # plan.planner.PlanDetails of that one planning (its simulations, for reports)
    activation_recomputed: dict[str, int] = dataclasses.field(default_factory=dict)   # layer -> fw nodes tagged
    forward_graph: Any = None   # fx.GraphModule: the forward as it stands (after the passes: as it runs)
    backward_graph: Any = None
    # --- runtime binding (pipeline: bucket layout)
    claim_handle: int = -1      # runtime/handles.py number of the optimizer's claim on the plan's buckets
    offload: Any = None         # runtime.offload.OffloadRuntime: device buffers, flow fetches, memory ledger
    activation_offload: Any = None   # runtime.activation_offload.ActivationOffloadRuntime, when layers offload
    flow_schedule: dict[str, list] = dataclasses.field(default_factory=dict)   # phase -> plan.flow_schedule actions
    # --- what a forward pass hands to its backward pass (passes/table.py): pass name -> its frozen record
    pass_records: dict[str, Any] = dataclasses.field(default_factory=dict)
    dumps: list[GraphDump] = dataclasses.field(default_factory=list)   # before/after of each pass (dump_dir)

    def record_dump(self, phase: str, pass_name: str, before: str, after: str, gm=None) -> None:
        self.dumps.append(GraphDump(phase, pass_name, before, after, gm))
