"""The analytic minimum of bytes each rank sends per training step: one definition, used by every arm of
bench/dist.py (socompile's ZeRO run, the torch DDP anchor, the simulated paper row) and by its tests.

A bandwidth-optimal (ring) collective over W ranks makes each rank send (W-1)/W of a buffer for a
reduce-scatter or an all-gather, and twice that for an all-reduce (a reduce-scatter, then an all-gather).
The bytes depend on the dtype the link actually carries: fp32 gradients and weights over gloo on a CPU, bf16
on GPUs. Pass that dtype; never assume one.
"""
from __future__ import annotations

import torch


def ring_share(world: int) -> float:
    """The share of a buffer each rank sends in a ring reduce-scatter or all-gather over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return (world - 1) / world


def zero_min_bytes(numel: int, world: int, grad_dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> float:
    """Per rank and step, data parallelism with the optimizer sharded (ZeRO-1/2): reduce-scatter ``numel``
    gradients of ``grad_dtype`` and all-gather ``numel`` updated weights of ``weight_dtype`` (default: the
    same). Plain data parallelism (an all-reduce of the gradients, every rank stepping everything) moves the
    same 2 (W-1)/W x numel elements, so this is the anchor's minimum too."""
    weight_dtype = grad_dtype if weight_dtype is None else weight_dtype
    return ring_share(world) * numel * (grad_dtype.itemsize + weight_dtype.itemsize)


def ulysses_bytes_per_layer(dim: int, kv_dim: int, seq: int, world: int, dtype: torch.dtype) -> float:
    """Per rank, one layer, one direction (forward, or backward), Ulysses sequence parallelism over ``world``
    ranks: all-to-alls of q (``dim``), k and v (``kv_dim`` each, as sent: after any kv repetition) and of the
    attention output (``dim``), for this rank's seq / world tokens; (W-1)/W of each leaves the rank."""
    return (2 * dim + 2 * kv_dim) * (seq // world) * dtype.itemsize * ring_share(world)
