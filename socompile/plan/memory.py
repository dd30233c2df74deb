"""Memory accounting of a candidate plan: peak device memory, pinned host memory and total host memory.

Device (per step, at the activation peak):
    activations                         (graph liveness, or the checkpointing estimate; perf/analysis.py)
  + weights of stationary buckets       (numel * weight bytes; plus parameters without a socompile optimizer)
  + GPU-resident optimizer state        (fp32 master + m + v = 12 B/param, + the gradient kept to validation)
  + weight-flow buffers                 (their peak over the exact schedule, plan/flow_schedule.py; at least
                                         (max prefetch distance + 1) * largest flow bucket, in its link dtype)
  + gradient staging                    (what the backward's gradient tensors add to the flow buffers at the
                                         peak of the two together, plan/step_timeline.py: each bucket's from the
                                         node that makes it until the graph lets the bucket go, one bucket after
                                         its own is ready)
  + upload staging for device casts     (2 * largest stationary CPU bucket, fp32)
  + ZeRO device buffers (world > 1)     (zero_device_bytes: per stationary CPU bucket its shard buffer and its
                                         weights' padding to W chunks, kept (a flow bucket keeps none); flat
                                         gradient buffers of two CPU buckets adjacent in gradient order, while one
                                         fills and one is reduced)
Gradient staging is no buffer of the runtime's: it is the backward graph's own gradient tensors, held by a
bucket's step node until the bucket is complete and by its device-to-host copy until it lands in the pinned
landing buffer (runtime/host_master.py), so perf/analysis.py does not count them as activations. Flow buffers and
gradients are walked together: a flow bucket's buffer and the gradients of the buckets around it are what is
live at once, where twice the largest bucket would count a dominant parameter's gradient twice and its forward
flow buffer beside its backward gradient. The floor of a plan (planner._min_device) scales with the buckets.
Host (host_buffers: the host entries of plan/bucket_buffers.py's bucket_buffers, the one list of a bucket's
buffers that the runtime allocates from and its HostLedger books, runtime/memory.py), per CPU bucket of n
padded elements: fp32 master (4n), Adam moments (8n), ping-pong spares for exact rollback (12n), the gradient
landing buffer (n x link dtype), a staging copy (2n) that uploads and fetches of bf16 or fp16 weights read, and on
CUDA with gradient accumulation a stage in the landing dtype (n x link dtype); plus offloaded activations. Pinned:
what copies to or from the device read or write (landing, staging, accumulation stage, activations, and the master
of fp32 weights or of a device cast, which their uploads and fetches read); moments and spares never cross the link
and are pageable. Over W ZeRO ranks the host path keeps master and landing buffer whole (the parameters alias the
master) and the moments and spares for the rank's window; device-side ZeRO keeps all of them for its chunk.
"""
from __future__ import annotations

import dataclasses

import sympy

from ..dtypes import dtype_bytes, dtype_name
from ..ledger_names import ACTIVATIONS, HOST_PURPOSES
from .bucket_buffers import WEIGHTS_BUFFER, BucketStorage, bucket_buffers, host_entries
from ..moment_format import format_of, moment_bytes, moment_bytes_per_element
from .bucketize import ALIGN, chunk_elements, padded_numel
from .plan import BucketPlan
from .step_timeline import StepPeak, flow_bytes_of


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    device_peak: float
    device_expr: object          # int or sympy: a formula of the symbolic shapes
    device_parts: tuple[tuple[str, float], ...]
    host_total: int
    host_pinned: int
    host_parts: tuple[tuple[str, int], ...]
    step: StepPeak | None = None  # where flow buffers + gradients peak, and what is live there (PlanError)


def device_memory(buckets: list[BucketPlan], weight_bytes: int, activations: float, activations_expr,
                  unoptimized_numel: int, adaptive_flow: set[int] | None = None, world: int = 1,
                  step: StepPeak | None = None, moment_dtype: str = "float32") -> MemoryEstimate:
    """Per rank. With ``world`` ZeRO ranks, a device-site bucket keeps 1/world of its fp32 master and moments
    (12 B/param / world with fp32 moments; ``moment_dtype`` lays them out, socompile/moment_format.py) beside its
    whole gradient and compute weights; uploads carry one shard.
    ``step``: the joint peak of flow buffers and gradient tensors over the step (step_timeline.step_peak); the
    flow buffers are its flow peak when more than (distance + 1) of the largest (small buckets read by one node
    are live together), the gradient staging what the gradients add on top at the joint peak. Without it
    (callers with no IR), two of the largest buckets' gradients."""
    stationary = sum(b.numel for b in buckets if b.weight_mode == "stationary") + unoptimized_numel
    gpu_state = sum(b.numel for b in buckets if b.optimizer_site == "device")
    master_and_moments = sum(4 * b.numel + 2 * moment_bytes(moment_dtype, b.numel)
                             for b in buckets if b.optimizer_site == "device")
    cpu = [b for b in buckets if b.optimizer_site == "cpu"]
    flow = [b for b in buckets if b.weight_mode == "flow"]
    flow_buffers = (max((b.prefetch_distance for b in flow), default=0) + 1) * max(
        (b.numel * dtype_bytes(b.param_link_dtype) for b in flow), default=0) if flow else 0
    if step is None:
        staging = 2 * max((b.numel * max(weight_bytes, dtype_bytes(b.link_dtype)) for b in cpu), default=0)
    else:
        flow_buffers = max(flow_buffers, step.flow_peak)
        staging = step.total - step.flow_peak
    upload = 2 * max((b.numel * 4 for b in cpu if b.weight_mode == "stationary" and b.cast_site == "device"
                      and weight_bytes == 2), default=0) // max(1, world)
    parts = (("activations", activations), ("stationary weights", stationary * weight_bytes),
             ("GPU optimizer state", master_and_moments // max(1, world) + gpu_state * weight_bytes),
             ("gradient staging", staging),
             ("weight-flow buffers", flow_buffers), ("upload staging", upload))
    if world > 1:   # device-side ZeRO of the CPU buckets, stationary and flow (runtime/sharded_bucket.py)
        zero = zero_device_bytes([b.numel for b in cpu], world, weight_bytes,
                                 [b.weight_mode == "flow" for b in cpu])
        parts += (("ZeRO device buffers", zero["kept"] + zero["gradients"]),)
    fixed = int(sum(v for k, v in parts if k != "activations"))
    expr = sympy.Add(activations_expr, fixed) if not isinstance(activations_expr, (int, float)) \
        else activations_expr + fixed
    return MemoryEstimate(device_peak=sum(v for _, v in parts), device_expr=expr, device_parts=parts,
                          host_total=0, host_pinned=0, host_parts=(), step=step)


def zero_device_bytes(numels: list[int], world: int, weight_bytes: int, flow: list[bool] | None = None) -> dict:
    """Device bytes of device-side ZeRO (runtime/sharded_bucket.py) for buckets of ``numels`` elements in gradient
    order, per rank: "kept" (each stationary bucket's shard buffer of ceil(numel / W) elements and its weights'
    padding to W equal chunks; a flow bucket, ``flow[i]``, keeps none: its fetched windows are the weight-flow
    buffers) and "gradients" (the peak of the flat gradient buffers of W * ceil(numel / W) elements, made at a
    bucket's first gradient and freed once its reduce-scatter is done: two buckets adjacent in gradient order are
    live at once, one filling and one being reduced), in the weights' dtype (the link dtype of the collectives)."""
    chunks = [chunk_elements(n, world) for n in numels]
    padded = [c * world for c in chunks]
    flow = flow or [False] * len(numels)
    kept = weight_bytes * sum(c + p - n for c, p, n, f in zip(chunks, padded, numels, flow) if not f)
    pairs = [a + b for a, b in zip(padded, padded[1:])] or padded
    return {"kept": kept, "gradients": weight_bytes * max(pairs, default=0)}


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """How the runtime lays host buffers out, beyond the plan's buckets (docs/runtime.md, "Host memory").
    ``pins``: a CUDA runtime (or the emulated one): buffers that copies to or from the device read or write are
    pinned. ``shared_master``: the CPU runtime with fp32 CPU parameters (host_master 'shared'): the parameters
    alias the master and their fp32 gradients are the landing buffer; nothing crosses a link. ``accumulation``:
    grad_accumulation_steps > 1 (an optimizer argument, not a plan option): a CUDA bucket lands the later
    micro-batches in a stage of the landing buffer's dtype and adds them on the host."""
    pins: bool = True
    shared_master: bool = False
    accumulation: bool = False
    moment_dtype: str = "float32"   # socompile.AdamW(moment_dtype=...), an optimizer argument (moment_format.py)
    spares: bool = True     # speculation on: a bucket with exact rollback makes its ping-pong spare (off: never)

    @property
    def moment_bytes(self) -> float:
        """Bytes of one moment of one parameter: 4 (fp32), 2 (bf16), 1.25 (int8 blocks with their scales)."""
        return moment_bytes_per_element(self.moment_dtype)


def bucket_storage(b: BucketPlan, weight_dtype: str, layout: HostLayout = HostLayout()) -> BucketStorage:
    """How the runtime will store CPU bucket ``b`` of the plan: its plan's choices and the runtime's layout."""
    return BucketStorage(site=b.optimizer_site, separate=not layout.shared_master, flow=b.weight_mode == "flow",
                         weight_dtype=weight_dtype, link_dtype=b.link_dtype, cast_site=b.cast_site,
                         pins=layout.pins, accumulation=layout.accumulation,
                         moment_dtype=layout.moment_dtype,
                         spares=b.rollback == "exact" and layout.spares)


def bucket_host_buffers(b: BucketPlan, numel: int, weight_bytes: int, world: int = 1,
                        layout: HostLayout = HostLayout(), weight_dtype: str = "") -> list[tuple[str, int, bool]]:
    """(purpose, bytes, pinned) of each host buffer the runtime allocates for bucket ``b`` of ``numel`` padded
    elements on rank 0 (the largest shard) of ``world`` ZeRO ranks: the host entries of plan/bucket_buffers.py's
    ``bucket_buffers``, the one derivation the runtime allocates from (none for a device-stepped bucket: its state
    is device memory). ``weight_dtype``: default named by ``weight_bytes``."""
    storage = bucket_storage(b, weight_dtype or dtype_name(weight_bytes), layout)
    return host_entries(bucket_buffers(storage, numel, 0, max(1, world)))


def host_buffers(buckets: list[BucketPlan], weight_bytes: int, world: int = 1, offloaded_activations: int = 0,
                 numels: dict[int, int] | None = None, layout: HostLayout = HostLayout(), weight_dtype: str = ""
                 ) -> dict[str, dict[str, int]]:
    """Host bytes of one rank by purpose, {purpose: {"pinned": bytes, "pageable": bytes}}, as the runtime's
    HostLedger books them (runtime/memory.py; purposes with no bytes left out). ``numels``: padded elements by
    bucket index (default: the bucket's numel). ``offloaded_activations``: saved tensors of offloaded layers
    (host copies of device tensors: pinned when the runtime pins)."""
    out: dict[str, dict[str, int]] = {}

    def add(purpose: str, nbytes: int, pinned: bool) -> None:
        if nbytes:
            out.setdefault(purpose, {"pinned": 0, "pageable": 0})["pinned" if pinned else "pageable"] += nbytes
    for b in buckets:
        numel = b.numel if numels is None else numels[b.index]
        for purpose, nbytes, pinned in bucket_host_buffers(b, numel, weight_bytes, world, layout, weight_dtype):
            add(purpose, nbytes, pinned)
    add(ACTIVATIONS, int(offloaded_activations), layout.pins)
    return {k: out[k] for k in HOST_PURPOSES if k in out}


def host_memory(buckets: list[BucketPlan], weight_bytes: int, world: int = 1, offloaded_activations: int = 0,
                numels: dict[int, int] | None = None, layout: HostLayout = HostLayout(), weight_dtype: str = ""
                ) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(total, pinned, parts) bytes of host memory of one rank: ``host_buffers`` summed; parts by purpose."""
    books = host_buffers(buckets, weight_bytes, world, offloaded_activations, numels, layout, weight_dtype)
    parts = tuple((k, v["pinned"] + v["pageable"]) for k, v in books.items())
    return sum(v for _, v in parts), sum(v["pinned"] for v in books.values()), parts


def padded_numels(buckets, ir, align: int | None = None) -> dict[int, int]:
    """Elements of each bucket as the runtime lays it out (padded segments), by bucket index."""
    align = ALIGN if align is None else align
    return {b.index: padded_numel([ir.params[p].numel for p in b.params], align) for b in buckets}


def runtime_host_bytes(plan, ir, layout: HostLayout = HostLayout(), world: int = 1) -> dict[str, dict[str, int]]:
    """The host bytes the runtime itself allocates for ``plan`` (its HostLedger books the same buffers,
    opt.host_memory()["by_purpose"]), padded as it lays buckets out."""
    return host_buffers(list(plan.buckets), plan.prediction("param_dtype_bytes", 4), world,
                        int(plan.prediction("activations_offloaded_bytes", 0)), padded_numels(plan.buckets, ir),
                        layout, weight_dtype(plan))


def weight_dtype(plan) -> str:
    """The name of ``plan``'s weights' dtype: recorded as "param_dtype" where their size does not say it (fp16),
    else named by ``param_dtype_bytes`` (2: bfloat16, 4: float32)."""
    return plan.prediction("param_dtype") or dtype_name(plan.prediction("param_dtype_bytes", 4))


def plan_world(plan) -> int:
    """The ZeRO ranks of ``plan``: its dp x sp degrees (every rank of the world group holds a shard)."""
    predicted = dict(plan.predicted)
    return max(1, int(predicted.get("dp_degree", 1))) * max(1, int(predicted.get("sp_degree", 1)))


def runtime_device_bytes(plan, ir, align: int | None = None) -> dict:
    """The device bytes the runtime itself holds (runtime/memory.py books the same tensors): weights of
    stationary buckets, fp32 master + gradient + Adam moments of device-site buckets, the fp32 upload staging of
    device-cast buckets (``upload_staging_bytes``), and the flow buffers of flow buckets, live from prefetch to
    release (the exact schedule of plan/flow_schedule.py). Activations
    and graph temporaries are not the runtime's. Returns {"peak", "fixed", "flow_peak", "flow_phase_peak",
    "parts"}."""
    from .flow_schedule import flow_peak, flow_schedule
    align = ALIGN if align is None else align
    weight_bytes = plan.prediction("param_dtype_bytes", 4)
    world = plan_world(plan)
    stationary = state = 0
    layout = HostLayout(moment_dtype=format_of(plan.prediction("moment_bytes", 4)))   # the device moments' format
    flow_bytes = flow_bytes_of(plan.buckets, ir, align, world)   # the flow buffers the floor walks, as allocated
    for b in plan.buckets:
        n = padded_numel([ir.params[p].numel for p in b.params], align)
        if b.optimizer_site == "device":   # its buffers as the runtime makes them (plan/bucket_buffers.py): fp32
            # master, gradient, exp_avg, exp_avg_sq; bf16/fp16 weights: a device copy cast from that master
            for spec in bucket_buffers(bucket_storage(b, weight_dtype(plan), layout), n):
                if spec.name == WEIGHTS_BUFFER:
                    stationary += spec.nbytes
                else:
                    state += spec.nbytes
        if b.weight_mode != "flow" and b.optimizer_site != "device":
            stationary += n * weight_bytes   # a device-site bucket's weights are its fp32 master, counted above
    peak, per_phase = flow_peak(flow_schedule(plan, ir), flow_bytes)
    staging = upload_staging_bytes(plan, ir, align)
    fixed = stationary + state + staging
    return {"peak": fixed + peak, "fixed": fixed, "flow_peak": peak, "flow_phase_peak": per_phase,
            "parts": (("stationary weights", stationary), ("GPU optimizer state", state),
                      ("weight-flow buffers", peak), ("upload staging", staging))}


def device_cast_buckets(plan, weight_bytes: int | None = None) -> list:
    """The buckets whose uploads the device casts: CPU-stepped, stationary, low-precision weights, and the plan
    put the cast on the device (``cast_site == "device"``, NVLink-C2C plans): the fp32 master crosses into an
    fp32 device staging buffer and the device casts it into the weights (runtime/host_master.py ``upload``)."""
    return [b for b in plan.buckets if b.optimizer_site == "cpu" and b.weight_mode == "stationary"
            and b.cast_site == "device"] if (weight_bytes or plan.prediction("param_dtype_bytes", 4)) == 2 else []


def upload_staging_bytes(plan, ir, align: int | None = None) -> int:
    """The device's fp32 upload staging (device_memory's "upload staging"): two buffers of the largest
    device-cast bucket, padded as the runtime lays it out, so one bucket's cast overlaps the next one's copy."""
    align = ALIGN if align is None else align
    return 2 * 4 * max((padded_numel([ir.params[p].numel for p in b.params], align)
                        for b in device_cast_buckets(plan)), default=0)
