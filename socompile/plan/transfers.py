"""What crosses the host-device link, per bucket: the one list the simulator bills and the runtime executes.

For each bucket of a plan (``bucket_transfers``):

    gradients       d2h  CPU-stepped buckets: the gradients in the plan's ``link_dtype`` (each micro-batch's
                         backward hands them over; the segments' elements, no padding)
    weight upload   h2d  CPU-stepped stationary buckets, once per step: the weights as the bucket lays them out
                         (padded, plan/memory.py ``padded_numel``): bf16 cast on the host (``cast_site == "cpu"``),
                         or the fp32 master cast on the device after it crossed (``cast_site == "device"``, bf16
                         weights; plan/memory.py ``device_cast_buckets``), or fp32 weights
    flow fetch      h2d  flow buckets, at every phase that reads them (plan/flow_schedule.py), in
                         ``param_link_dtype``, padded
    device-stepped buckets move nothing.

ZeRO over ``world`` ranks (per rank): a CPU-stepped bucket takes the device path (runtime/sharded_bucket.py):
its gradients are reduced on the device and one shard of ceil(laid out / world) elements crosses, once per step
(micro-batches accumulate on the device), in the weights' dtype. A stationary bucket's updated shard goes up once
per step in the weights' dtype (bf16 cast on the host from the shard's stage); a flow bucket's shard goes up at
every use, in ``param_link_dtype``, and the device all-gathers the whole window from the ranks' shards.

Activation offload adds, per offloaded layer and micro-batch, its saved tensors d2h in forward and h2d in backward
(``activation_transfers``: bytes from the graph analysis, perf/analysis.py ``LayerCosts``).

perf/simulate.py takes its transfer tasks' bytes from this list; ``per_step_traffic`` sums it into the keys of
the runtime's traffic ledger (runtime/traffic.py, ``socompile.AdamW.traffic()``), and tests hold them equal.
"""
from __future__ import annotations

import dataclasses

from ..dtypes import dtype_name, gradient_link_name
from ..ledger_names import ACTIVATION_FETCH, ACTIVATION_OFFLOAD, FLOW_FETCH, GRADIENTS, WEIGHT_UPLOAD
from ..options import OFFLOADED_CHOICES
from .bucketize import ALIGN, chunk_elements
from .memory import device_cast_buckets, padded_numel, plan_world, weight_dtype



@dataclasses.dataclass(frozen=True)
class Transfer:
    bucket: int | None      # BucketPlan.index; None for an activation transfer
    direction: str          # "d2h" or "h2d"
    dtype: str              # of what crosses
    purpose: str            # GRADIENTS, WEIGHT_UPLOAD, FLOW_FETCH, ACTIVATION_OFFLOAD, ACTIVATION_FETCH
    nbytes: int             # one copy
    per: str                # how often: "micro-batch", "step", or "use" (each phase that reads the flow bucket)
    layer: str = ""         # activation transfers: the layer


def bucket_transfers(plan, param_numels: dict[str, int] | None = None, align: int = ALIGN,
                     weight_bytes: int | None = None, world: int | None = None) -> list[Transfer]:
    """The link transfers of each bucket of ``plan`` (one rank's). ``param_numels``: elements per parameter
    (the IR's), to pad as the runtime lays buckets out; without them a bucket's padding is not known and is taken
    as none. ``weight_bytes``: of the parameters (default: the plan's ``param_dtype_bytes``, else 4). ``world``:
    ZeRO ranks (default: the plan's dp x sp degrees)."""
    weight_bytes = weight_bytes or plan.prediction("param_dtype_bytes", 4)
    weights = weight_dtype(plan) if _bytes(weight_dtype(plan)) == weight_bytes else dtype_name(weight_bytes)
    world = world or plan_world(plan)
    device_cast = {b.index for b in device_cast_buckets(plan, weight_bytes)}
    out: list[Transfer] = []
    for b in plan.buckets:
        if b.optimizer_site != "cpu":
            continue
        laid_out = padded_numel([param_numels[p] for p in b.params], align) if param_numels else b.numel
        if world > 1:
            out += _zero_transfers(b, laid_out, weights, world)
            continue
        grad = dtype_name(4) if b.link_dtype not in ("bfloat16", "float16") else b.link_dtype
        out.append(Transfer(b.index, "d2h", grad, GRADIENTS, b.numel * _bytes(grad), "micro-batch"))
        if b.weight_mode == "flow":
            out.append(Transfer(b.index, "h2d", b.param_link_dtype, FLOW_FETCH,
                                laid_out * _bytes(b.param_link_dtype), "use"))
            continue
        upload = "float32" if weight_bytes == 4 or b.index in device_cast else weights   # bf16/fp16: host cast
        out.append(Transfer(b.index, "h2d", upload, WEIGHT_UPLOAD, laid_out * _bytes(upload), "step"))
    return out


def _zero_transfers(b, laid_out: int, weights: str, world: int) -> list[Transfer]:
    """One rank's transfers of a CPU-stepped bucket under ZeRO (see the module doc): ``weights``, their dtype."""
    shard = chunk_elements(laid_out, world)
    grads = gradient_link_name(weights)   # fp16: cast to fp32 on the device after the reduction
    gradients = Transfer(b.index, "d2h", grads, GRADIENTS, shard * _bytes(grads), "step")
    if b.weight_mode == "flow":
        return [gradients, Transfer(b.index, "h2d", b.param_link_dtype, FLOW_FETCH,
                                    shard * _bytes(b.param_link_dtype), "use")]
    return [gradients, Transfer(b.index, "h2d", weights, WEIGHT_UPLOAD, shard * _bytes(weights), "step")]


def activation_transfers(plan, layers) -> list[Transfer]:
    """Per offloaded layer (``Plan.activations``) and dtype, its saved tensors out in forward and back in backward,
    each micro-batch: all of them ("offload"), or the checkpoints a selective layer keeps ("selective_offload": its
    input and its attention outputs). ``layers``: perf/analysis.py LayerCosts; dtype: each saved tensor's own (a
    bf16 model saves some fp32 tensors), as the runtime books each copy."""
    choices = dict(plan.activations)
    out: list[Transfer] = []
    for lc in layers:
        choice = choices.get(lc.name, "keep")
        if choice not in OFFLOADED_CHOICES:
            continue
        for dtype, nbytes in offloaded_by_dtype(lc, choice, plan):
            out.append(Transfer(None, "d2h", dtype, ACTIVATION_OFFLOAD, int(nbytes), "micro-batch", lc.name))
            out.append(Transfer(None, "h2d", dtype, ACTIVATION_FETCH, int(nbytes), "micro-batch", lc.name))
    return out


def offloaded_by_dtype(lc, choice: str, plan) -> tuple[tuple[str, float], ...]:
    """(dtype, bytes) an offloaded layer moves each way; a LayerCosts without the split (made by hand) is taken
    as all in the parameters' dtype."""
    split = lc.saved_by_dtype if choice == "offload" else lc.selective_by_dtype
    return split or ((weight_dtype(plan), offloaded_bytes(lc, choice)),)


def offloaded_bytes(lc, choice: str) -> float:
    """Bytes an offloaded layer moves each way: its saved tensors, or a selective one's checkpoints."""
    return lc.moved if choice == "offload" else lc.boundary + lc.attention_saved


def _layers(plan, ir):
    from ..hardware.targets import get_profile
    from ..perf.analysis import analyze
    from ..perf.cost import CostModel
    return analyze(ir, CostModel(get_profile(plan.target), dict(ir.symbol_values))).layers


def _bytes(dtype: str) -> int:
    from ..dtypes import dtype_bytes
    return dtype_bytes(dtype)


def fetch_uses(plan, ir) -> dict[int, int]:
    """Bucket -> how many phases fetch it per micro-batch (the prefetches of plan/flow_schedule.py)."""
    from .flow_schedule import flow_schedule
    uses: dict[int, int] = {}
    for actions in flow_schedule(plan, ir).values():
        for a in actions:
            if a.kind == "prefetch":
                uses[a.bucket] = uses.get(a.bucket, 0) + 1
    return uses


def per_step_traffic(plan, ir, micro_batches: int = 1, layers=None) -> dict[tuple[str, str, str], int]:
    """Bytes per (direction, dtype, purpose) one optimizer step of ``micro_batches`` forward/backward passes
    moves, as the runtime's traffic ledger counts them (``socompile.AdamW.traffic()``). ``layers``: the graph
    analysis' LayerCosts (analysed here at the trace shapes when the plan offloads activations and none are
    given)."""
    if layers is None:
        layers = _layers(plan, ir) if any(c in OFFLOADED_CHOICES for _, c in plan.activations) else ()
    uses = fetch_uses(plan, ir)
    numels = {name: int(p.numel) for name, p in ir.params.items()}
    total: dict[tuple[str, str, str], int] = {}
    for t in bucket_transfers(plan, numels) + activation_transfers(plan, layers):
        times = {"step": 1, "micro-batch": micro_batches, "use": micro_batches * uses.get(t.bucket, 0)}[t.per]
        if times and t.nbytes:
            key = (t.direction, t.dtype, t.purpose)
            total[key] = total.get(key, 0) + t.nbytes * times
    return total
