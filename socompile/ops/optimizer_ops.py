"""Custom ops the optimizer-step pass inserts into the backward graph.

``socompile::bucket_grads_ready(grads, after, claim, bucket, segments)`` hands a bucket's gradients to its
optimizer the moment they all exist. ``after`` carries no data the op uses: those are outputs of the last
backward nodes that read the bucket's weights, so any scheduler (FX order, Inductor) runs the op after them,
and the weights may then be updated in place while backward continues.

It returns an empty *ticket* tensor, which ``socompile::grads_copied(grads, tickets, claim, bucket)`` takes: inserted
when the gradients go to the host asynchronously (CUDA), one bucket later, it keeps the gradients alive until the
compute stream has waited for their copy; the ticket is the data edge that orders it after the hand-over (an
ORDERED effect does not order ops inserted after tracing). Both register an ORDERED effect, so dead-code
elimination keeps them.
"""
from __future__ import annotations

import torch

from ..runtime import handles


@torch.library.custom_op("socompile::bucket_grads_ready", mutates_args=())
def bucket_grads_ready(grads: list[torch.Tensor], after: list[torch.Tensor], claim: int, bucket: int,
                       segments: list[int]) -> torch.Tensor:
    handles.lookup(claim).on_grads(bucket, list(segments), list(grads))
    return torch.empty(0)


@bucket_grads_ready.register_fake
def _(grads, after, claim, bucket, segments) -> torch.Tensor:
    return torch.empty(0)


@torch.library.custom_op("socompile::grads_copied", mutates_args=())
def grads_copied(grads: list[torch.Tensor], tickets: list[torch.Tensor], claim: int, bucket: int) -> None:
    """The compute stream waits for the copy of ``grads`` to the host (CUDA, no host block). Taking them as
    arguments keeps their memory out of the compiler's reach until here (Inductor reuses a dead buffer for a
    later kernel, and the asynchronous copy of ``bucket_grads_ready`` may still be reading it); ``tickets`` are
    the outputs of this bucket's ``bucket_grads_ready`` and of the next one: the data edges that run this op
    after both (the copy has the next bucket's backward to land)."""
    handles.lookup(claim).grads_copied(bucket)


@grads_copied.register_fake
def _(grads, tickets, claim, bucket) -> None:
    return None


def _register_ordered_effect(op) -> None:
    # Private API (also used by DeepSpeed's DeepCompile); present in torch 2.4 through 2.13.
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effect(torch.ops.socompile.bucket_grads_ready.default)
_register_ordered_effect(torch.ops.socompile.grads_copied.default)
