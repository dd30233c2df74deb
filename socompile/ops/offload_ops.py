"""Custom ops of the weight-flow passes: fetch a bucket's weights to the device, wait for them, release them.

    socompile::prefetch(handle, phase, bucket) -> ()            start the host->device copy (async)
    socompile::wait_weights(handle, phase, bucket, numel, dtype, device) -> Tensor[numel]
                                                                the flat weights, once the copy is done
    socompile::release(handle, phase, bucket, after) -> ()      the bucket's device bytes are given back

All three register an ORDERED effect: dead-code elimination keeps ``prefetch`` and ``release`` (they return
nothing), and every scheduler keeps their relative order, which is what the memory accounting relies on.
``after`` carries the outputs of the bucket's last readers: no data is read, it only makes every scheduler run
the release after them. ``wait_weights`` returns a fresh tensor that the graph owns (it aliases no input).
"""
from __future__ import annotations

import torch

from ..runtime import handles


@torch.library.custom_op("socompile::prefetch", mutates_args=())
def prefetch(handle: int, phase: str, bucket: int) -> None:
    handles.lookup(handle).prefetch(phase, bucket)


@prefetch.register_fake
def _(handle, phase, bucket) -> None:
    return None


@torch.library.custom_op("socompile::wait_weights", mutates_args=())
def wait_weights(handle: int, phase: str, bucket: int, numel: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    return handles.lookup(handle).wait(phase, bucket)


@wait_weights.register_fake
def _(handle, phase, bucket, numel, dtype, device):
    return torch.empty(numel, dtype=dtype, device=device)


@torch.library.custom_op("socompile::release", mutates_args=())
def release(handle: int, phase: str, bucket: int, after: list[torch.Tensor]) -> None:
    handles.lookup(handle).release(phase, bucket)


@release.register_fake
def _(handle, phase, bucket, after) -> None:
    return None


def _register_ordered_effects() -> None:
    # Private API, as in optimizer_ops.py (present in torch 2.4 through 2.13).
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    for op in (torch.ops.socompile.prefetch.default, torch.ops.socompile.wait_weights.default,
               torch.ops.socompile.release.default):
        _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effects()
