"""Memory accounting of a candidate plan: peak device memory, pinned host memory and total host memory.

Device (per step, at the activation peak):
    activations                         (graph liveness, or the checkpointing estimate; perf/analysis.py)
  + weights of stationary buckets       (numel * weight bytes; plus parameters without a socompile optimizer)
  + GPU-resident optimizer state        (fp32 master + m + v = 12 B/param, + the gradient kept to validation)
  + gradient staging for CPU buckets    (2 buckets: one being filled, one on the link)
  + weight-flow buffers                 ((max prefetch distance + 1) * largest flow bucket, in its link dtype)
  + upload staging for device casts     (2 * largest stationary CPU bucket, fp32)
  + ZeRO device buffers (world > 1)     (zero_device_bytes: per stationary CPU bucket its shard buffer and its
                                         weights' padding to W chunks, kept; flat gradient buffers of two buckets
                                         adjacent in gradient order, while one fills and one is reduced)
Gradient staging is no buffer of the runtime's: it is the backward graph's own gradient tensors, held by a
bucket's step node until the bucket is complete and by its device-to-host copy until it lands in the pinned
landing buffer (runtime/host_master.py), so perf/analysis.py does not count them as activations. The floor of a plan
(planner._min_device) therefore scales with the largest bucket, and bucket_size with it.
Host:
  per CPU bucket: master + m + v (12 B/param), ping-pong copies for exact rollback (+12), the gradient landing
  buffer (link dtype), and a bf16 weight copy when the CPU casts or the weights flow. Pinned: whatever crosses
  the link (gradient buffers, bf16 copies, and the fp32 master when the device casts).
"""
from __future__ import annotations

import dataclasses

import sympy

from ..dtypes import dtype_bytes
from .bucketize import ALIGN
from .plan import BucketPlan


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    device_peak: float
    device_expr: object          # int or sympy: a formula of the symbolic shapes
    device_parts: tuple[tuple[str, float], ...]
    host_total: int
    host_pinned: int
    host_parts: tuple[tuple[str, int], ...]


def device_memory(buckets: list[BucketPlan], weight_bytes: int, activations: float, activations_expr,
                  unoptimized_numel: int, adaptive_flow: set[int] | None = None, world: int = 1,
                  flow_at_least: int = 0) -> MemoryEstimate:
    """Per rank. With ``world`` ZeRO ranks, a device-site bucket keeps 1/world of its fp32 master and moments
    (12 B/param / world) beside its whole gradient and compute weights; uploads carry one shard.
    ``flow_at_least``: the flow buffers the runtime's exact schedule holds at once (flow_buffer_peak), when
    more than (distance + 1) of the largest (small buckets read by one node are live together)."""
    stationary = sum(b.numel for b in buckets if b.weight_mode == "stationary") + unoptimized_numel
    gpu_state = sum(b.numel for b in buckets if b.optimizer_site == "device")
    cpu = [b for b in buckets if b.optimizer_site == "cpu"]
    flow = [b for b in buckets if b.weight_mode == "flow"]
    staging = 2 * max((b.numel * max(weight_bytes, dtype_bytes(b.link_dtype)) for b in cpu), default=0)
    flow_buffers = (max((b.prefetch_distance for b in flow), default=0) + 1) * max(
        (b.numel * dtype_bytes(b.param_link_dtype) for b in flow), default=0) if flow else 0
    flow_buffers = max(flow_buffers, flow_at_least)
    upload = 2 * max((b.numel * 4 for b in cpu if b.weight_mode == "stationary" and b.cast_site == "device"
                      and weight_bytes == 2), default=0) // max(1, world)
    parts = (("activations", activations), ("stationary weights", stationary * weight_bytes),
             ("GPU optimizer state", gpu_state * 12 // max(1, world) + gpu_state * weight_bytes),
             ("gradient staging", staging),
             ("weight-flow buffers", flow_buffers), ("upload staging", upload))
    if world > 1:   # device-side ZeRO of the stationary CPU buckets (runtime/sharded_bucket.py)
        zero = zero_device_bytes([b.numel for b in cpu if b.weight_mode == "stationary"], world, weight_bytes)
        parts += (("ZeRO device buffers", zero["kept"] + zero["gradients"]),)
    fixed = int(sum(v for k, v in parts if k != "activations"))
    expr = sympy.Add(activations_expr, fixed) if not isinstance(activations_expr, (int, float)) \
        else activations_expr + fixed
    return MemoryEstimate(device_peak=sum(v for _, v in parts), device_expr=expr, device_parts=parts,
                          host_total=0, host_pinned=0, host_parts=())


def zero_device_bytes(numels: list[int], world: int, weight_bytes: int) -> dict:
    """Device bytes of device-side ZeRO (runtime/sharded_bucket.py) for buckets of ``numels`` elements in gradient
    order, per rank: "kept" (each bucket's shard buffer of ceil(numel / W) elements and its weights' padding to W
    equal chunks) and "gradients" (the peak of the flat gradient buffers of W * ceil(numel / W) elements, made at a
    bucket's first gradient and freed once its reduce-scatter is done: two buckets adjacent in gradient order are
    live at once, one filling and one being reduced), in the weights' dtype (the link dtype of the collectives)."""
    chunks = [-(-n // world) for n in numels]
    padded = [c * world for c in chunks]
    kept = weight_bytes * sum(c + p - n for c, p, n in zip(chunks, padded, numels))
    pairs = [a + b for a, b in zip(padded, padded[1:])] or padded
    return {"kept": kept, "gradients": weight_bytes * max(pairs, default=0)}


def host_memory(buckets: list[BucketPlan], weight_bytes: int, world: int = 1, offloaded_activations: int = 0
                ) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(total, pinned, parts) bytes of host memory of one rank. ZeRO over ``world`` ranks: each rank's CPU holds
    the fp32 master, moments, ping-pong copies and gradient landing buffer of its 1/world shard of every CPU
    bucket; a flowing bucket's bf16 weights are whole on every rank (each rank streams all of them).
    ``offloaded_activations``: saved tensors of offloaded layers (pinned: they cross the link)."""
    w = max(1, world)
    state = pingpong = landing = copies = master_pinned = 0
    for b in buckets:
        if b.optimizer_site != "cpu":
            continue
        shard = -(-b.numel // w)
        state += 12 * shard
        if b.rollback == "exact":
            pingpong += 12 * shard
        landing += shard * dtype_bytes(b.link_dtype)
        if weight_bytes == 2 and b.weight_mode == "flow":
            copies += 2 * b.numel
        elif weight_bytes == 2 and b.cast_site == "cpu":
            copies += 2 * shard
        elif b.weight_mode == "stationary":
            master_pinned += 4 * shard
    parts = (("fp32 master + Adam moments", state), ("ping-pong copies (exact rollback)", pingpong),
             ("gradient landing buffers", landing), ("bf16 weight copies", copies),
             ("offloaded activations", int(offloaded_activations)))
    pinned = landing + copies + master_pinned + int(offloaded_activations)
    return sum(v for _, v in parts), pinned, parts


def flow_buffer_peak(buckets, ir, align: int | None = None, spans_cache: dict | None = None) -> int:
    """Bytes of flow buffers live at once over the exact schedule (plan/flow_schedule.py), as the runtime
    allocates them (padded segments, the link dtype)."""
    from .flow_schedule import bucket_flow_schedule, flow_peak
    flow = [b for b in buckets if b.weight_mode == "flow"]
    if not flow:
        return 0
    align = ALIGN if align is None else align
    nbytes = {b.index: padded_numel([ir.params[p].numel for p in b.params], align) * dtype_bytes(b.param_link_dtype)
              for b in flow}
    return flow_peak(bucket_flow_schedule(buckets, ir, spans_cache), nbytes)[0]


def padded_numel(numels, align: int) -> int:
    """Elements of a flat bucket laid out as runtime/flat_bucket.py does: each segment starts at a multiple
    of ``align`` elements."""
    return sum((n + align - 1) // align * align for n in numels)


def runtime_device_bytes(plan, ir, align: int | None = None) -> dict:
    """The device bytes the runtime itself holds (runtime/memory.py books the same tensors): weights of
    stationary buckets, fp32 master + gradient + Adam moments of device-site buckets, and the flow buffers of
    flow buckets, live from prefetch to release (the exact schedule of plan/flow_schedule.py). Activations
    and graph temporaries are not the runtime's. Returns {"peak", "fixed", "flow_peak", "flow_phase_peak",
    "parts"}."""
    from .flow_schedule import flow_peak, flow_schedule
    align = ALIGN if align is None else align
    weight_bytes = plan.prediction("param_dtype_bytes", 4)
    stationary = state = 0
    flow_bytes = {}
    for b in plan.buckets:
        n = padded_numel([ir.params[p].numel for p in b.params], align)
        if b.optimizer_site == "device":
            state += 16 * n          # fp32 master, gradient, exp_avg, exp_avg_sq
            if weight_bytes != 4:    # bf16/fp16 weights: a device copy cast from that master (runtime/flat_bucket.py)
                stationary += n * weight_bytes
        if b.weight_mode == "flow":
            flow_bytes[b.index] = n * dtype_bytes(b.param_link_dtype)
        elif b.optimizer_site != "device":
            stationary += n * weight_bytes   # a device-site bucket's weights are its fp32 master, counted above
    peak, per_phase = flow_peak(flow_schedule(plan, ir), flow_bytes)
    fixed = stationary + state
    return {"peak": fixed + peak, "fixed": fixed, "flow_peak": peak, "flow_phase_peak": per_phase,
            "parts": (("stationary weights", stationary), ("GPU optimizer state", state),
                      ("weight-flow buffers", peak))}
