"""Bucket placements the planner simulates, and the plan around them: a placement with the last K buckets on
the GPU and just enough CPU buckets streamed to fit (``_with_k``), the prefetch distances that hide each
transfer, the unfinished Plan the simulator replays (``_plan_of``) and the step it replays (``_speculation``).
planner.py searches K over these; activation_policy.py simulates its candidate mixes on them
(``simulated_step``)."""
from __future__ import annotations

import dataclasses

from ..dtypes import dtype_name
from ..moment_format import moment_bytes_per_element
from ..options import Options
from ..perf.simulate import simulate
from .plan import Plan
from .search_state import _compact_buckets, _Context, _device

MAX_PREFETCH = 8          # buffers beyond this cost memory and no longer hide anything on these profiles


def simulated_step(ctx: _Context, base, choices: dict[str, str], activations: float, activations_expr,
                   offloaded: float, order_cache: dict) -> float | None:
    """Simulated step time of ``base``'s buckets under the per-layer activation ``choices`` (using
    ``activations`` device bytes, ``offloaded`` host bytes) on the placement the GPU-bucket search starts
    from: every bucket on the CPU, just enough streamed to fit the budget beside these activations (_with_k,
    K=0). None if no placement fits. ``order_cache`` is _with_k's, shared between calls over one ``base``."""
    trial = dataclasses.replace(ctx, activations=activations, activations_expr=activations_expr,
                                offloaded_bytes=offloaded, choices=tuple(choices.items()))
    made = _with_k(trial, base, 0, order_cache)
    if made is None:
        return None
    return simulate(_plan_of(trial, made[0], "layers", ()), ctx.costs, ctx.cost,
                    speculation=_speculation(ctx.options)).step_time


def _speculation(options: Options) -> str:
    """The step the planner simulates and optimises (perf/simulate.py ``speculation``) is the one that will run:
    with clipping, validation clips every step, so each CPU bucket step speculated during backward is taken
    again after it ("redo", the clipped step's worst case); else the speculated steps are committed ("on").
    Without speculation (``options.speculate`` False) no CPU step starts before validation ("off"), clipped or
    not: nothing is speculated, so nothing is redone."""
    if not options.speculate:
        return "off"
    return "redo" if options.clipping else "on"


def _parallel_predictions(ctx: _Context) -> tuple:
    if ctx.world == 1:
        return ()
    return (("dp_degree", ctx.dp), ("sp_degree", ctx.sp), ("world_size", ctx.world))


def _weight_dtype_prediction(ctx: _Context) -> tuple:
    """("param_dtype", "float16") for fp16 weights, whose size alone (2 bytes) would name bf16 (plan/memory.py
    ``weight_dtype``); nothing for the others, whose name the size gives."""
    return (("param_dtype", ctx.weight_dtype),) if ctx.weight_dtype != dtype_name(ctx.weight_bytes) else ()


def _moment_prediction(ctx: _Context) -> tuple:
    """("moment_bytes", 2) for bf16 moments, 1.25 for int8 blocks (plan/memory.py and the simulator read it);
    nothing for fp32."""
    moments = ctx.options.moment_dtype or "float32"
    return (("moment_bytes", moment_bytes_per_element(moments)),) if moments != "float32" else ()


def _plan_of(ctx: _Context, buckets, recompute, predicted, decisions=(), unoptimized=()) -> Plan:
    predicted = predicted or (("param_dtype_bytes", ctx.weight_bytes), *_weight_dtype_prediction(ctx),
                              *_moment_prediction(ctx), *_parallel_predictions(ctx))
    return Plan(target=ctx.hw.name, bucket_size=ctx.options.bucket_size, buckets=tuple(buckets),
                unoptimized_params=tuple(unoptimized), predicted=tuple(predicted), recompute=recompute,
                decisions=tuple(decisions), activations=tuple(ctx.choices))


def _transfer_order(ctx: _Context, cpu_buckets) -> list[int]:
    """CPU buckets, best candidates for weight flow first: compute that reads them / time to stream them."""
    ratios = []
    fw_times = ctx.costs.fw_times
    ir = ctx.ir
    compact = _compact_buckets(ctx, cpu_buckets)
    for b in cpu_buckets:
        if b.index not in compact:
            continue
        reads = {ir.graph.nodes[k]["order"] for p in b.params for k in ir.fw_readers.get(p, ())}
        compute = sum(fw_times[i] for i in reads)
        ratios.append((-(compute / ctx.cost.transfer_time(b.numel * 2, "h2d")), b.index))
    return [i for _, i in sorted(ratios)]


def _prefetch_distances(ctx: _Context, buckets, flow: set[int]) -> dict[int, int]:
    """Smallest distance d such that the compute of the d previous flow windows covers each transfer."""
    uses = []
    for b in buckets:
        if b.index in flow:
            first = min((ctx.costs.fw_uses[p][0] for p in b.params if p in ctx.costs.fw_uses), default=0)
            uses.append((first, b.index))
    uses.sort()
    prefix = [0.0]
    for t in ctx.costs.fw_times:
        prefix.append(prefix[-1] + t)
    out = {}
    for j, (pos, idx) in enumerate(uses):
        need = ctx.cost.transfer_time(buckets[idx].numel * 2, "h2d")
        d = 1
        while d < MAX_PREFETCH and j - d >= 0 and prefix[pos] - prefix[uses[j - d][0]] < need:
            d += 1
        out[idx] = d
    return out


def _with_k(ctx: _Context, base, k: int, order_cache: dict):
    """Buckets with the last k on the GPU and just enough CPU buckets streamed to fit; None if nothing fits."""
    n = len(base)
    buckets = [dataclasses.replace(b, optimizer_site="device", cast_site="device", link_dtype="none",
                                   param_link_dtype="none", cast_reason="stepped on the GPU: nothing crosses")
               if b.index >= n - k else b for b in base]
    memory = _device(ctx, buckets)
    if memory.device_peak <= ctx.budget:
        return buckets, memory
    if "order" not in order_cache:
        order_cache["order"] = _transfer_order(ctx, base)
    # Stream buckets in order until the weights saved pay for the (distance-1) buffers and the excess.
    excess = memory.device_peak - ctx.budget
    flow: set[int] = set()
    saved = largest = 0
    for idx in order_cache["order"]:
        if idx >= n - k:
            continue
        flow.add(idx)
        saved += base[idx].numel * ctx.weight_bytes
        largest = max(largest, base[idx].numel)
        if saved - 2 * largest * 2 < excess:
            continue
        trial = _apply_flow(ctx, buckets, flow, _prefetch_distances(ctx, base, flow))
        memory = _device(ctx, trial)
        if memory.device_peak > ctx.budget:   # the hiding distances need more buffers than fit: use 1
            trial = _apply_flow(ctx, buckets, flow, {i: 1 for i in flow})
            memory = _device(ctx, trial)
        if memory.device_peak <= ctx.budget:
            return trial, memory
    if flow:   # the running estimate never reached the excess; the full set may still fit (staging shrinks too)
        # distance 0 last: one buffer at a time, transfers not hidden (the floor, _min_device)
        for dist in (_prefetch_distances(ctx, base, flow), {i: 1 for i in flow}, {i: 0 for i in flow}):
            trial = _apply_flow(ctx, buckets, flow, dist)
            memory = _device(ctx, trial)
            if memory.device_peak <= ctx.budget:
                return trial, memory
    return None


def _apply_flow(ctx: _Context, buckets, flow: set[int], dist: dict[int, int], distance: int = 1):
    name = ctx.weight_dtype
    return [dataclasses.replace(b, weight_mode="flow", prefetch_distance=dist.get(b.index, distance), cast_site="cpu",
                                param_link_dtype=name,
                                cast_reason="weights flow from host memory as bf16: the CPU kernel writes the "
                                            "bf16 copy in the same pass" if name == "bfloat16" else
                                            "weights flow from host memory as fp16, cast on the host" if
                                            ctx.weight_bytes == 2 else
                                            "weights flow from host memory in float32: no cast")
            if b.index in flow else b for b in buckets]
