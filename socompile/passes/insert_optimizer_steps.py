"""Pass: hand each bucket's gradients to its optimizer inside the backward graph.

Pattern inserted, per planned bucket b, right after the plan's ``ready_after`` node::

    ... backward nodes ...
    g_1, ..., g_k = <nodes producing the gradients of b's parameters>
    r_1, ..., r_m = <last backward nodes reading b's weights (or saved views of them)>
    socompile.bucket_grads_ready([g_1..g_k], [r_1..r_m], claim, b, [segments])   # CPU step may start now
    ... backward continues ...
    return (None, ..., None)      # gradients of optimized parameters no longer leave the graph

Gradients of parameters without a socompile optimizer stay graph outputs, so autograd fills their ``.grad``.
"""
from __future__ import annotations

import torch
from torch import fx

from ..ops import optimizer_ops  # noqa: F401  (registers socompile::bucket_grads_ready)

PASS_NAME = "insert_optimizer_steps"


def _node(gm: fx.GraphModule, key: str) -> fx.Node:
    name = key.split(":", 1)[1]
    for node in gm.graph.nodes:
        if node.name == name:
            return node
    raise KeyError(f"plan names backward node {key!r}, which is not in the graph")


def insert_optimizer_steps(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    ir = ctx.ir
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    consumed: set[int] = set()
    position = {key: i for i, key in enumerate(ir.bw_order)}
    for bucket in plan.buckets:
        grads = [_node(gm, ir.grad_node[p]) for p in bucket.params]
        grad_names = {g.name for g in grads}
        readers = sorted({r for p in bucket.params for r in ir.bw_readers.get(p, ())},
                         key=position.__getitem__)
        after = [n for n in (_node(gm, r) for r in readers)
                 if n.name not in grad_names and isinstance(n.meta.get("val"), torch.Tensor)]
        anchor = _node(gm, bucket.ready_after)
        with gm.graph.inserting_after(anchor):
            call = gm.graph.call_function(
                torch.ops.socompile.bucket_grads_ready.default,
                (grads, after, ctx.claim_handle, bucket.index, list(range(len(bucket.params)))))
        call.meta["val"] = None
        call.meta["stack_trace"] = grads[-1].meta.get("stack_trace")
        call.meta["socompile"] = {"pass": PASS_NAME,
                                  "why": f"bucket {bucket.index}: {len(bucket.params)} params, "
                                         f"{bucket.grad_bytes} B of gradients complete; step on {bucket.optimizer_site}"}
        consumed.update(ir.grad_output_index[p] for p in bucket.params)
    output.args = (tuple(None if i in consumed else v for i, v in enumerate(outputs)),)
    return gm
