"""Custom ops the optimizer-step pass inserts into the backward graph.

``socompile::bucket_grads_ready(grads, after, claim, bucket, segments)`` hands a bucket's gradients to its
optimizer the moment they all exist. ``after`` carries no data the op uses: those are outputs of the last
backward nodes that read the bucket's weights, so any scheduler (FX order, Inductor) runs the op after them,
and the weights may then be updated in place while backward continues.

The op returns nothing, so it registers an ORDERED effect: dead-code elimination keeps it and effectful ops
keep their program order.
"""
from __future__ import annotations

import torch

from ..runtime import handles


@torch.library.custom_op("socompile::bucket_grads_ready", mutates_args=())
def bucket_grads_ready(grads: list[torch.Tensor], after: list[torch.Tensor], claim: int, bucket: int,
                       segments: list[int]) -> None:
    handles.lookup(claim).on_grads(bucket, list(segments), list(grads))


@bucket_grads_ready.register_fake
def _(grads, after, claim, bucket, segments) -> None:
    return None


def _register_ordered_effect(op) -> None:
    # Private API (also used by DeepSpeed's DeepCompile); present in torch 2.4 through 2.13.
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effect(torch.ops.socompile.bucket_grads_ready.default)
