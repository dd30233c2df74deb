"""Building nodes the passes insert: each new node gets the meta the compilers and the dumps need."""
from __future__ import annotations

import torch
from torch import fx


def fake_mode(gm: fx.GraphModule):
    """The FakeTensorMode of the graph's values (None for a graph traced without fake tensors)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and getattr(val, "fake_mode", None) is not None:
            return val.fake_mode
    return None


class GraphBuilder:
    """Creates nodes with the meta the compilers need: a fake ``val``, the source stack trace, and why."""

    def __init__(self, gm: fx.GraphModule, pass_name: str):
        self.graph = gm.graph
        self.fake = fake_mode(gm)
        self.pass_name = pass_name

    def call(self, target, args, why: str, source: fx.Node) -> fx.Node:
        node = self.graph.call_function(target, tuple(args))
        val = None
        if self.fake is not None and target is torch.ops.socompile.wait_weights.default:
            # Our ops are never run for their value here: they would act on the runtime (an op without tensor
            # inputs is not intercepted by the fake mode). wait_weights and prefetch (its ticket) have values.
            with self.fake:
                val = torch.empty(args[3], dtype=args[4], device=args[5])
        elif self.fake is not None and target is torch.ops.socompile.prefetch.default:
            with self.fake:
                val = torch.empty(0)    # the ticket its wait takes
        elif self.fake is not None and getattr(target, "namespace", None) != "socompile":
            with self.fake:
                out = target(*fx.node.map_arg(node.args, lambda n: n.meta.get("val")))
                val = out if isinstance(out, torch.Tensor) else None
        node.meta["val"] = val
        node.meta["stack_trace"] = source.meta.get("stack_trace")
        node.meta["socompile"] = {"pass": self.pass_name, "why": why}
        return node
