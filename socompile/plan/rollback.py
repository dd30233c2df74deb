"""Decision 5 of the planner (planner.py): the rollback mode of each CPU bucket, from the plan's host memory.

Ping-pong (an exact rollback: a second copy of the optimizer state) while host memory allows; else the algebraic
inverse (one copy), largest CPU buckets first, until the plan fits the host. bf16 moments have no inverse (the
kernel rounds them stochastically): their plans keep ping-pong everywhere or do not fit.
"""
from __future__ import annotations

import dataclasses

from ..options import Options
from ..units import human_bytes
from .memory import HostLayout, host_memory, padded_numels
from .search_state import HOST_HEADROOM, PlanError, _Context


def _host(ctx: _Context, buckets):
    """Host memory of a plan over ``buckets`` (plan/memory.py host_memory): (total, pinned, parts)."""
    return host_memory(buckets, ctx.weight_bytes, ctx.world, int(ctx.offloaded_bytes),
                       padded_numels(buckets, ctx.ir), host_layout(ctx.options, ctx.weight_bytes), ctx.weight_dtype)


def host_layout(options: Options, weight_bytes: int) -> HostLayout:
    """The host layout the runtime of ``options.runtime`` will use: the CPU runtime pins nothing and fp32
    parameters share the master; any other runtime (a GPU target's CUDA, or the emulated one) pins what crosses
    the link. Gradient accumulation is the optimizer's argument, unknown here: its stage is not counted. The
    moments' bytes follow ``options.moment_dtype`` and a shared master ``options.host_master`` (the owning
    optimizer's, pipeline.planning_options; without one, fp32 CPU parameters share it). Without speculation no
    bucket step is taken before validation, so none makes a ping-pong spare."""
    moments = options.moment_dtype or "float32"
    if options.runtime == "cpu":
        shared = options.host_master == "shared" if options.host_master else weight_bytes == 4
        return HostLayout(pins=False, shared_master=shared, moment_dtype=moments, spares=options.speculate)
    return HostLayout(moment_dtype=moments, spares=options.speculate)


def rollback_modes(ctx: _Context, buckets, decisions: list[str]):
    """``buckets`` with their rollback modes (ping-pong, else the algebraic inverse where host memory is short),
    and the plan's host memory: (buckets, total bytes, pinned bytes, bytes by purpose)."""
    limit = ctx.hw.host_memory * HOST_HEADROOM
    total, pinned, parts = _host(ctx, buckets)
    if total <= limit:
        return buckets, total, pinned, parts
    if ctx.options.moment_dtype in ("bfloat16", "int8") and ctx.options.speculate:   # no inverse: ping-pong or nothing
        raise PlanError(f"host memory: the plan needs {human_bytes(total)} of host memory with ping-pong rollback "
                        f"but {ctx.hw.name} has {human_bytes(ctx.hw.host_memory)} (usable {human_bytes(limit)}), and "
                        f"{'int8' if ctx.options.moment_dtype == 'int8' else 'bf16'} moments cannot use the "
                        f"algebraic inverse that would drop the spares (they are "
                        f"rounded stochastically); use fp32 moments (rollback 'inverse' then fits more), keep more "
                        f"buckets on the GPU, speculate=False (no spares: each bucket is stepped once validated), or "
                        f"use a machine with more host memory")
    # Drop ping-pong copies, largest-numel CPU buckets first (ties: index), until host memory fits.
    out = list(buckets)
    for b in sorted((b for b in buckets if b.optimizer_site == "cpu"), key=lambda b: (-b.numel, b.index)):
        out[b.index] = dataclasses.replace(b, rollback="inverse")
        total, pinned, parts = _host(ctx, out)
        if total <= limit:
            break
    inverse = sum(1 for b in out if b.rollback == "inverse")
    decisions.append(f"rollback: {inverse} CPU bucket(s) use the algebraic inverse (host memory "
                     f"{human_bytes(ctx.hw.host_memory)} too small for ping-pong state)")
    if total > limit:
        raise PlanError(f"host memory: the plan needs {human_bytes(total)} of host memory but {ctx.hw.name} has "
                        f"{human_bytes(ctx.hw.host_memory)} (usable {human_bytes(limit)}); keep more buckets on the GPU "
                        f"or use a machine with more host memory")
    return out, total, pinned, parts
