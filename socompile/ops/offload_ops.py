"""Custom ops of the weight-flow passes: fetch a bucket's weights to the device, wait for them, release them.

    socompile::prefetch(handle, phase, bucket) -> ticket        start the host->device copy (async)
    socompile::wait_weights(handle, phase, bucket, numel, dtype, device, ticket) -> Tensor[numel]
                                                                the flat weights, once the copy is done
    socompile::release(handle, phase, bucket, after) -> ()      the bucket's device bytes are given back

All three register an ORDERED effect, so dead-code elimination keeps them. Their order does not rest on that
effect, though: Inductor orders only the effectful ops that tracing itself wrapped, and these are inserted after
partitioning (we saw it run a wait before its prefetch). So every ordering that matters is a data edge:
``prefetch`` returns an empty *ticket* tensor that its ``wait_weights`` takes (the copy starts before the wait),
and ``release``'s ``after`` carries the outputs of the bucket's last readers (no data is read; it only makes
every scheduler run the release after them). ``wait_weights`` returns a fresh tensor that the graph owns (it aliases no input).

    socompile::wait_upload(handle, bucket, weights) -> ()     the compute stream waits for the upload of a
                                                              stationary bucket's updated weights (CUDA event)

``wait_upload`` (passes/wait_uploads.py) sits right before the forward's first read of a stationary bucket with a
separate host master. Its order rests on a data edge too, the other way round: it declares that it *mutates*
``weights`` (the bucket's parameter placeholders; it writes nothing), so every scheduler runs each later reader
of those parameters after it (Inductor turns the declared mutation into a dependency of every later read), and
dead-code elimination keeps it (a mutable schema is impure). It is defined with a hand-written schema rather than
``custom_op``: ``custom_op`` would bump the parameters' version counters on each call, and a second forward
before the first backward (saved parameters) would then fail autograd's in-place check.
"""
from __future__ import annotations

import torch

from ..runtime import handles


@torch.library.custom_op("socompile::prefetch", mutates_args=())
def prefetch(handle: int, phase: str, bucket: int) -> torch.Tensor:
    handles.lookup(handle).prefetch(phase, bucket)
    return torch.empty(0)


@prefetch.register_fake
def _(handle, phase, bucket):
    return torch.empty(0)


@torch.library.custom_op("socompile::wait_weights", mutates_args=())
def wait_weights(handle: int, phase: str, bucket: int, numel: int, dtype: torch.dtype,
                 device: torch.device, ticket: torch.Tensor | None = None) -> torch.Tensor:
    return handles.lookup(handle).wait(phase, bucket)


@wait_weights.register_fake
def _(handle, phase, bucket, numel, dtype, device, ticket=None):
    return torch.empty(numel, dtype=dtype, device=device)


@torch.library.custom_op("socompile::release", mutates_args=())
def release(handle: int, phase: str, bucket: int, after: list[torch.Tensor]) -> None:
    handles.lookup(handle).release(phase, bucket)


@release.register_fake
def _(handle, phase, bucket, after) -> None:
    return None


_LIB = torch.library.Library("socompile", "FRAGMENT")   # keeps the wait_upload definition registered
_LIB.define("wait_upload(int handle, int bucket, Tensor(a!)[] weights) -> ()")


def _wait_upload(handle: int, bucket: int, weights: list[torch.Tensor]) -> None:
    handles.lookup(handle).wait_upload(bucket)


_LIB.impl("wait_upload", _wait_upload, "CompositeExplicitAutograd")


@torch.library.register_fake("socompile::wait_upload")
def _(handle, bucket, weights) -> None:
    return None


def _register_ordered_effects() -> None:
    # Private API, as in optimizer_ops.py (present in torch 2.4 through 2.13).
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    for op in (torch.ops.socompile.prefetch.default, torch.ops.socompile.wait_weights.default,
               torch.ops.socompile.release.default):
        _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effects()
