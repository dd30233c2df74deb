"""Pass: hand each bucket's gradients to its optimizer inside the backward graph.

Pattern inserted, per planned bucket b, right after the plan's ``ready_after`` node::

    ... backward nodes ...
    g_1, ..., g_k = <nodes producing the gradients of b's parameters>
    r_1, ..., r_m = <last backward nodes reading b's weights (or saved views of them)>
    t_b = socompile.bucket_grads_ready([g_1..g_k], [r_1..r_m], claim, b, [segments])   # CPU step may start now
    ... backward continues, up to the next bucket's bucket_grads_ready (or the output) ...
    socompile.grads_copied([g_1..g_k], [t_b, t_next], claim, b)   # only when the gradients are copied to the host
                                                        # asynchronously (CUDA): g_i live until their copy landed
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
        call.meta["val"] = torch.empty(0)   # the ticket grads_copied takes
        call.meta["stack_trace"] = grads[-1].meta.get("stack_trace")
        call.meta["socompile"] = {"pass": PASS_NAME,
                                  "why": f"bucket {bucket.index}: {len(bucket.params)} params, "
                                         f"{bucket.grad_bytes} B of gradients complete; step on {bucket.optimizer_site}"}
        consumed.update(ir.grad_output_index[p] for p in bucket.params)
    output.args = (tuple(None if i in consumed else v for i, v in enumerate(outputs)),)
    if _grads_copied_async(ctx):
        _keep_grads_until_copied(gm, ctx)
    return gm


def _grads_copied_async(ctx) -> bool:
    """The claim's buckets copy gradients to the host asynchronously (separate host master on CUDA)."""
    from ..runtime import handles
    if ctx.claim_handle < 0:   # graphs for reading (offline plans, tests): no optimizer, nothing is copied
        return False
    claim = handles.lookup(ctx.claim_handle)
    return any(b.async_host_copies() for b in getattr(claim, "buckets", ()))


def _keep_grads_until_copied(gm: fx.GraphModule, ctx) -> None:
    """After each ``bucket_grads_ready``, a ``grads_copied`` of the same gradients one bucket later (before the
    output for the last): the copy has a bucket's compute to land, and no buffer it reads is reused before.
    It takes the tickets of both hand-overs: data edges, the only order every scheduler keeps."""
    ready = [n for n in gm.graph.nodes if n.target is torch.ops.socompile.bucket_grads_ready.default]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for call, later in zip(ready, [*ready[1:], None]):
        grads, _after, claim, bucket, _segments = call.args
        insert = gm.graph.inserting_after(later) if later is not None else gm.graph.inserting_before(output)
        with insert:
            tickets = [call] if later is None else [call, later]
            wait = gm.graph.call_function(torch.ops.socompile.grads_copied.default, (grads, tickets, claim, bucket))
        wait.meta["val"] = None
        wait.meta["socompile"] = {"pass": PASS_NAME, "why": f"bucket {bucket}: gradients kept until their "
                                                            f"copy to the host has landed"}
