"""The buffers one optimizer bucket is made of: the single derivation the planner sums and the runtime allocates.

``bucket_buffers(storage, numel, rank, world)`` names every flat buffer a bucket of ``numel`` padded elements
holds (its purpose in the host ledger, dtype, elements, pinned or pageable, host or device, and which part of
the bucket it covers), from ``BucketStorage``: the facts that decide how a bucket stores itself (where its
optimizer steps, shared or separate host master, weight flow, dtypes, cast site, whether a CUDA runtime's copy
streams read its host buffers). The planner's host memory (plan/memory.py) is the sum of the host entries; the
runtime (runtime/flat_bucket.py, host_master.py, sharded_bucket.py) makes each buffer from its entry and from
nothing else, and its host ledger books what it made. So plan and execution cannot disagree on a buffer.

How a bucket is cut over ``world`` ZeRO ranks (``shard_layout``):
    "whole"   one rank, or a bucket not sharded (yet)
    "window"  the host path: master and gradients stay whole (the model's weights alias the master, backward
              writes whole gradients, the reduce-scatter reads them); moments and spares cover this rank's
              window of ceil(numel / world) elements
    "chunk"   device-side ZeRO (a separate fp32 master stepped on the CPU, on a CUDA runtime): master, moments,
              spares, the gradient landing buffer and the bf16 stage cover this rank's chunk; the device
              weights are padded to world chunks for the all-gather
"""
from __future__ import annotations

import dataclasses

from ..ledger_names import ACCUMULATION, LANDING, MASTER, MOMENTS, SPARES, STAGING
from .bucketize import chunk_elements
from ..moment_format import moment_buffer, quantised, shard_block

# The names of a bucket's buffers (what the runtime asks for), each booked under a ledger purpose.
MASTER_BUFFER = "master"
GRAD_BUFFER = "grad"
EXP_AVG_BUFFER = "exp_avg"
EXP_AVG_SQ_BUFFER = "exp_avg_sq"
SPARE_MASTER_BUFFER = "spare master"
SPARE_EXP_AVG_BUFFER = "spare exp_avg"
SPARE_EXP_AVG_SQ_BUFFER = "spare exp_avg_sq"
LOW_STAGE_BUFFER = "low-precision stage"       # the master cast to the 2-byte weights, what uploads and fetches read
ACCUMULATION_BUFFER = "accumulation stage"     # later micro-batches land here, then are added on the host
WEIGHTS_BUFFER = "weights"                     # the parameters' own flat buffer, on their device

HALF = ("bfloat16", "float16")
_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


@dataclasses.dataclass(frozen=True)
class BucketStorage:
    """What decides a bucket's buffers. ``site``: where its optimizer steps ("cpu": the CPU kernel on a host
    master; "device": state beside the weights). ``separate``: a host master apart from the parameters (else
    they alias it: fp32 CPU parameters). ``flow``: the weights are fetched for each use. ``weight_dtype``: the
    parameters' (real) dtype. ``link_dtype``: what gradients cross the link in ("": nothing crosses into the
    landing buffer, which then holds the state dtype). ``cast_site``: where 2-byte weights are cast from the
    master for a stationary bucket ("device": the fp32 master itself goes up). ``pins``: a CUDA runtime's copy
    streams read and write the host buffers asynchronously, so those that cross are pinned. ``accumulation``:
    micro-batches after the first land in a stage (on a CUDA runtime). ``moment_dtype``: of exp_avg /
    exp_avg_sq where the CPU kernel steps fp32 state ("float32", "bfloat16" or "int8": socompile/moment_format.py lays
    out each). ``spares``: the bucket keeps ping-pong spares for exact
    rollback."""
    site: str = "cpu"
    separate: bool = False
    flow: bool = False
    weight_dtype: str = "float32"
    link_dtype: str = ""
    cast_site: str = "cpu"
    pins: bool = False
    accumulation: bool = False
    moment_dtype: str = "float32"
    spares: bool = True

    @property
    def state_dtype(self) -> str:
        """Of master, gradients and moments: float64 for float64 weights (they train as torch's AdamW trains
        them), else float32 (2-byte weights get an fp32 master)."""
        return "float64" if self.weight_dtype == "float64" else "float32"

    @property
    def host_stepped(self) -> bool:
        """The CPU kernel steps host state (a device-stepped bucket's state is device memory; on the CPU build
        that device is the host, and the host ledger does not book it)."""
        return self.site == "cpu"

    @property
    def device_cast(self) -> bool:
        """A stationary bucket of 2-byte weights whose plan casts on the device: its fp32 master crosses."""
        return (self.separate and self.weight_dtype in HALF and not self.flow and self.host_stepped
                and self.cast_site == "device")

    @property
    def master_crosses(self) -> bool:
        """Uploads and fetches read the master itself: weights that are not 2-byte, or a device cast (2-byte
        weights otherwise go up from the low-precision stage)."""
        return self.separate and (self.weight_dtype not in HALF or self.device_cast)


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One flat buffer of a bucket. ``purpose``: the host ledger's name for it (ledger_names). ``where``:
    "host" or "device". ``part``: "whole" (the bucket's elements), "window" or "chunk" (this rank's)."""
    name: str
    purpose: str
    dtype: str
    elements: int
    pinned: bool
    where: str
    part: str

    @property
    def nbytes(self) -> int:
        return self.elements * _BYTES[self.dtype]


def shard_window(numel: int, rank: int, world: int, block: int = 1) -> tuple[int, int]:
    """Elements [lo, hi) of a bucket of ``numel`` that ``rank`` of ``world`` owns: equal chunks of
    ceil(numel / world) rounded up to ``block`` (``zero_block``; the reduce-scatter pads the bucket to world
    chunks); the last ones may be short or empty."""
    chunk = chunk_elements(numel, world, block)
    lo = min(rank * chunk, numel)
    return lo, min(lo + chunk, numel)


def zero_block(storage: BucketStorage) -> int:
    """What a ZeRO chunk of a bucket of ``storage`` is a multiple of: int8 moment blocks are not cut between
    ranks (socompile/moment_format.py ``shard_block``)."""
    return shard_block(_moment_format(storage))


def _moment_format(storage: BucketStorage) -> str:
    """The moments' format: the optimizer's ``moment_dtype`` for fp32 state; float64 state keeps float64."""
    return storage.moment_dtype if storage.state_dtype == "float32" else storage.state_dtype


def shard_layout(storage: BucketStorage, world: int) -> str:
    """How a bucket of ``storage`` is cut over ``world`` ranks: "whole", "window" or "chunk" (module doc)."""
    if world <= 1:
        return "whole"
    device_side = (storage.pins and storage.separate and storage.host_stepped
                   and storage.state_dtype == "float32")
    return "chunk" if device_side else "window"


def landing_dtype(link_dtype: str, state_dtype: str) -> str:
    """The one rule for a host gradient landing buffer's dtype: gradients that cross in bf16 land as they crossed
    when the state is fp32 (the CPU kernel reads bf16 or fp32 gradients); anything else lands in the state dtype."""
    return "bfloat16" if link_dtype == "bfloat16" and state_dtype == "float32" else state_dtype


def bucket_buffers(storage: BucketStorage, numel: int, rank: int = 0, world: int = 1) -> tuple[BufferSpec, ...]:
    """Every buffer of a bucket of ``storage`` and ``numel`` padded elements on ``rank`` of ``world`` ZeRO ranks
    (module doc). Spares, the accumulation stage and the low-precision stage are made on first use; they are
    listed when the bucket may make them."""
    s = storage
    state = s.state_dtype
    cut = shard_layout(s, world)
    moments = _moment_format(s)
    if cut == "chunk" and quantised(moments):
        raise NotImplementedError(
            "ZeRO sharding on the device (a separate fp32 host master on a CUDA runtime: master, moments and "
            "gradients cut to this rank's chunk) is not implemented for int8 moments. Shard with "
            "socompile.AdamW(moment_dtype=torch.bfloat16) (2 B per moment) or torch.float32; int8 moments shard "
            "on the host path (fp32 parameters on a CPU runtime).")
    block = shard_block(moments)
    chunk = chunk_elements(numel, world, block)
    lo, hi = shard_window(numel, rank, world, block)
    window = chunk if cut == "chunk" else hi - lo if cut == "window" else numel
    if not s.host_stepped:
        return _device_stepped(s, numel, window, cut)
    master_part = "chunk" if cut == "chunk" else "whole"
    master_elements = chunk if cut == "chunk" else numel
    pins = s.pins and s.separate
    # device-side ZeRO casts on the host from a stage of the chunk (no device cast); its master crosses only for
    # weights that are not 2-byte
    master_pinned = pins and (s.weight_dtype not in HALF if cut == "chunk" else s.master_crosses)

    def host(name, purpose, dtype, elements, pinned, part):
        return BufferSpec(name, purpose, dtype, elements, pinned, "host", part)
    state_part = "whole" if cut == "whole" else cut
    moment_dtype, moment_elements = moment_buffer(moments, window)
    out = [host(MASTER_BUFFER, MASTER, state, master_elements, master_pinned, master_part),
           host(EXP_AVG_BUFFER, MOMENTS, moment_dtype, moment_elements, False, state_part),
           host(EXP_AVG_SQ_BUFFER, MOMENTS, moment_dtype, moment_elements, False, state_part)]
    if s.spares:   # the spare master becomes the master at a commit: pinned like it, when whole
        out += [host(SPARE_MASTER_BUFFER, SPARES, state, window, master_pinned and cut == "whole", state_part),
                host(SPARE_EXP_AVG_BUFFER, SPARES, moment_dtype, moment_elements, False, state_part),
                host(SPARE_EXP_AVG_SQ_BUFFER, SPARES, moment_dtype, moment_elements, False, state_part)]
    if not s.separate:    # the parameters' fp32 .grad are views of it
        landing = state
    elif cut == "chunk":  # the device reduces in the weights' dtype; bf16 lands as bf16, fp16 as fp32
        landing = landing_dtype(s.weight_dtype, state)
    elif cut == "window":  # the host reduce-scatter sums the whole gradients in the state dtype
        landing = state
    else:
        landing = landing_dtype(s.link_dtype, state)
    out.append(host(GRAD_BUFFER, LANDING, landing, master_elements, pins, master_part))
    if pins and s.accumulation and cut != "chunk":   # device-side ZeRO accumulates on the device
        out.append(host(ACCUMULATION_BUFFER, ACCUMULATION, landing, numel, True, "whole"))
    if s.separate and s.weight_dtype in HALF:
        if cut == "chunk":
            out.append(host(LOW_STAGE_BUFFER, STAGING, s.weight_dtype, chunk, True, "chunk"))
        elif not s.device_cast and (pins or s.flow):   # host-cast uploads and fetches read it
            out.append(host(LOW_STAGE_BUFFER, STAGING, s.weight_dtype, numel, pins, "whole"))
    if s.separate:   # flow: its storage holds no bytes between uses (the flow buffers of the device ledger)
        padded = chunk * world if cut == "chunk" and not s.flow else numel
        out.append(BufferSpec(WEIGHTS_BUFFER, "weights", s.weight_dtype, padded, False, "device", "whole"))
    return tuple(out)


def _device_stepped(s: BucketStorage, numel: int, window: int, cut: str) -> tuple[BufferSpec, ...]:
    """A device-stepped bucket: master, gradient and moments beside the weights (a shared master's stay where
    the parameters are: on the CPU build the host, where ZeRO's host path windows its moments); a separate
    2-byte (or fp64) weight buffer is cast from the master after each step. No spare: a device-stepped bucket
    is stepped once its step is validated, never speculatively."""
    state = s.state_dtype
    # the optimizer's moment format, as on the CPU: torch ops decode, step and round them alike
    # (runtime/device_adam.py); float64 state keeps float64 moments
    moment_dtype, moment_elements = moment_buffer(_moment_format(s), window)

    def dev(name, purpose, dtype, elements=numel, part="whole"):
        return BufferSpec(name, purpose, dtype, elements, False, "device", part)
    out = [dev(MASTER_BUFFER, MASTER, state), dev(GRAD_BUFFER, LANDING, state),
           dev(EXP_AVG_BUFFER, MOMENTS, moment_dtype, moment_elements, cut),
           dev(EXP_AVG_SQ_BUFFER, MOMENTS, moment_dtype, moment_elements, cut)]
    if s.separate and s.weight_dtype != "float32":
        out.append(dev(WEIGHTS_BUFFER, "weights", s.weight_dtype))
    return tuple(out)


def host_entries(specs) -> list[tuple[str, int, bool]]:
    """(purpose, bytes, pinned) of the host buffers among ``specs``, as the host ledger books them."""
    return [(b.purpose, b.nbytes, b.pinned) for b in specs if b.where == "host"]
