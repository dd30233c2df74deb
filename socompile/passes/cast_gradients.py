"""Pass: gradients cross the link in the bucket's planned precision (``BucketPlan.link_dtype``).

Pattern, for a bucket whose link precision differs from its gradients' dtype (it rewrites the nodes
insert_optimizer_steps inserts: ``requires`` in table.py)::

    g_i' = convert_element_type(g_i, link_dtype)            # on the device, before the copy to the host
    socompile.bucket_grads_ready([g_1'..g_k'], [...], claim, b, segments)
    # they land as they crossed: a separate master's host gradient buffer has the link dtype and the CPU
    # kernel reads bf16 directly (plan/bucket_buffers.py landing_dtype); a shared master's fp32 buffer upcasts

With bf16 on the link the CPU optimizer steps with bf16-rounded gradients: training is then no longer equal to
fp32 eager AdamW bit for bit (tests state the tolerance).
"""
from __future__ import annotations

import torch
from torch import fx

from ..dtypes import TORCH_DTYPES
from .graph_build import GraphBuilder

PASS_NAME = "cast_gradients"


def _kept_as_is(grad_dtype: torch.dtype, link: torch.dtype) -> bool:
    """A float64 or complex gradient is not cast to the plan's "float32" (the planner's name for any
    full-precision link): float64 parameters keep float64 optimizer state (runtime/flat_bucket.py,
    ``state_dtype``), which a float32 gradient would put 1e-8 relative off torch's float64 AdamW, and a cast
    of a complex gradient to a real dtype drops its imaginary part."""
    return link == torch.float32 and (grad_dtype == torch.float64 or grad_dtype.is_complex)


def cast_gradients(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    build = GraphBuilder(gm, PASS_NAME)
    buckets = {b.index: b for b in plan.buckets}
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.socompile.bucket_grads_ready.default:
            continue
        bucket = buckets[node.args[3]]
        want = TORCH_DTYPES.get(bucket.link_dtype)
        if want is None or bucket.optimizer_site != "cpu":
            continue
        grads = []
        for g in node.args[0]:
            val = g.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype != want and not _kept_as_is(val.dtype, want):
                with gm.graph.inserting_before(node):
                    g = build.call(torch.ops.prims.convert_element_type.default, (g, want),
                                   f"bucket {bucket.index}: gradients cross the link as {bucket.link_dtype}", g)
            grads.append(g)
        node.args = (grads, *node.args[1:])
        for keep in [u for u in node.users if u.target is torch.ops.socompile.grads_copied.default
                     and u.args[3] == bucket.index]:
            keep.args = (grads, *keep.args[1:])   # the copy reads the cast gradients: keep those alive
    return gm
