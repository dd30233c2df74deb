"""A bucket of parameters laid out flat: one contiguous fp32 buffer each for weights, gradients, exp_avg
and exp_avg_sq, so the CPU kernel steps a whole bucket in one call.

NOTE: parameters alias the bucket. Each fp32 parameter's ``.data`` is re-pointed to its segment of
``master``: the optimizer updates the model's weights in place with no copy-back, and the backward graph's
step node must therefore run after the last backward read of those weights (the planner's ``ready_after``).
Segments start at multiples of ALIGN elements so compiled kernels see aligned inputs; the padding is zero in
every buffer and stays zero under the update (zero gradient, zero moments -> zero step).

NOTE: ping-pong state. For exact, free rollback a bucket keeps a second ("spare") copy of master weights and
moments. A speculative step reads the current copy and writes the spare; commit swaps the two (re-pointing
the parameters to the new weights); rollback does nothing. ``rollback_mode = "inverse"`` keeps one copy and
undoes a speculative step with the kernel's algebraic inverse (not bitwise; for memory-tight plans).

NOTE: ZeRO shards. ``shard(rank, world)`` gives the bucket a window [lo, hi) of elements this rank steps, and
from then on the optimizer state (exp_avg, exp_avg_sq and the spare's master/moments) covers only the window:
element k of the bucket is element ``k - state_lo`` of those buffers (``local(start, end)``). ``master`` and
``grad`` stay full size: the model's weights alias ``master``, and backward writes whole gradients, which the
reduce-scatter reads. With one rank (or never sharded) the state is the whole bucket and nothing changes. With
a separate host master (runtime/host_master.py) the same holds for the host buffers: the copy-in lands whole
gradients in ``grad`` (the reduce-scatter waits for that copy, ``wait_grads``), the rank steps its window of
``master``, and once the all-gather has filled the whole ``master`` it is marked changed (``master_changed``),
so the upload casts all of it into the device ``weights`` (or the bf16 stage a flow bucket's fetch reads). A
device-stepped bucket whose state is on a GPU (``site == "device"`` on CUDA) cannot be sharded yet
(``_no_zero``; on the CPU build its buffers are host memory and it shards like the others). Device-side ZeRO
(runtime/sharded_bucket.py: a separate master on a CUDA runtime, stepped on the CPU, stationary) cuts ``master``
and ``grad`` too: they hold this rank's chunk from ``host_lo`` (``host(start, end)`` indexes them), and the
gradients are gathered and reduced on the device (``device_shard``).

NOTE: host master, "shared" or "separate". With a separate host master the bucket also keeps the parameters'
own device ``weights`` and copies gradients in and the updated master out: that part of the class is
``HostMasterCopies`` (runtime/host_master.py), which FlatBucket inherits.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from ..plan.bucket_buffers import (ACCUMULATION_BUFFER, EXP_AVG_BUFFER, EXP_AVG_SQ_BUFFER, GRAD_BUFFER,
                                   LOW_STAGE_BUFFER, MASTER_BUFFER, SPARE_EXP_AVG_BUFFER, SPARE_EXP_AVG_SQ_BUFFER,
                                   SPARE_MASTER_BUFFER, WEIGHTS_BUFFER, BucketStorage, BufferSpec, bucket_buffers,
                                   shard_layout, shard_window, zero_block)
from ..plan.bucketize import ALIGN   # one layout fact for planner and runtime
from ..moment_format import byte_range, moment_buffer, moment_bytes_per_element
from ..moment_format import moment_bytes as moment_buffer_bytes
from .host_master import HALF_WEIGHTS, HostMasterCopies, flat_real
from ..plan.host_work import SPARE_COPY, copy_bytes
from .traffic import HostBlockLedger, HostWorkLedger, TrafficLedger
from .sharded_bucket import narrow_to_device_shard


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype a parameter's elements are stepped in: a complex parameter is stepped as its real view
    (``torch.view_as_real``, as torch.optim.AdamW does), so complex64 -> float32, complex128 -> float64."""
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master, gradients and moments of parameters of ``dtype``: float64 for float64 (and
    complex128) parameters, so they train as torch.optim.AdamW trains them; float32 for the others (bf16 and
    fp16 parameters get an fp32 master)."""
    return torch.float64 if real_dtype(dtype) == torch.float64 else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _check_params(index: int, params: list[nn.Parameter], mirror: bool) -> None:
    """The parameters one bucket can hold: one real dtype on one device; aliased by a shared master only when
    they are fp32 (or fp64) CPU tensors."""
    if not mirror:
        for p in params:
            if real_dtype(p.dtype) not in (torch.float32, torch.float64) or p.device.type != "cpu":
                raise TypeError(f"host_master='shared' makes the parameters alias the fp32 host master, so it "
                                f"needs fp32 CPU parameters (or fp64 ones, with an fp64 master); got a "
                                f"{p.dtype} parameter on {p.device}. Use host_master='auto' (a separate host "
                                f"master for GPU or bf16/fp16 parameters).")
    if params and len({(real_dtype(p.dtype), p.device) for p in params}) > 1:
        kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
        raise TypeError(f"the parameters of one optimizer bucket must share dtype and device (one flat device "
                        f"buffer holds them); bucket {index} has {', '.join(kinds)}. Cast the model to one dtype "
                        f"(model.to(torch.bfloat16)) or put the odd parameters in their own param group.")


def _segments(params: list[nn.Parameter]) -> tuple[list[int], list[int], int]:
    """(offsets, sizes, total elements) of the parameters' segments in one flat bucket: real elements (a
    complex element is two), each segment starting at a multiple of ``ALIGN``."""
    offsets, sizes, total = [], [], 0
    for p in params:
        offsets.append(total)
        n = p.numel() * (2 if p.is_complex() else 1)
        sizes.append(n)
        total += _round_up(n, ALIGN)
    return offsets, sizes, total


class FlatBucket(HostMasterCopies):
    def __init__(self, index: int, params: list[nn.Parameter], shard: tuple[int, int] | None = None, *,
                 host_master: str = "shared", site: str = "cpu", flow: bool = False, runtime=None,
                 link_dtype: str | None = None, cast_site: str = "cpu", traffic: TrafficLedger | None = None,
                 host_ledger=None, host_work: HostWorkLedger | None = None,
                 moment_dtype: torch.dtype = torch.float32, host_blocks: HostBlockLedger | None = None,
                 groups: list[int] | None = None):
        if host_master not in ("shared", "separate"):
            raise ValueError(f"host_master must be 'shared' or 'separate', got {host_master!r}")
        self.mirror = host_master == "separate"
        _check_params(index, params, self.mirror)
        if shard is not None and shard[1] > 1 and self.mirror and site == "device" and params \
                and params[0].device.type != "cpu":
            self._no_zero()
        self.index = index
        self.params = list(params)
        self.site = site               # "cpu": the CPU kernel steps the host master; "device": state on the device
        self.flow = flow and self.mirror and site == "cpu"
        self.runtime = runtime         # DeviceRuntime of the parameters' device (mirror mode)
        # Decided once, here: the device is memory of its own (CUDA, the emulated device), reached by copies on
        # the runtime's streams; else (the CPU build, or no runtime) the "device" is host memory, copied in place.
        self.separate_device = runtime is not None and runtime.kind == "cuda"
        self.cast_site = cast_site     # the plan's: bf16 weights are cast from the master on the "cpu" or "device"
        self.traffic = traffic if traffic is not None else TrafficLedger()   # bytes its copies move (per step)
        self.host_work = host_work if host_work is not None else HostWorkLedger()   # bytes the host CPU moves
        self.host_ledger = host_ledger  # runtime/memory.py HostLedger: books every host buffer made here
        self.host_blocks = host_blocks if host_blocks is not None else HostBlockLedger()   # where it waits
        self.dtype = real_dtype(params[0].dtype) if params else torch.float32   # of the flat weights
        self.state_dtype = state_dtype(self.dtype)   # of master, grad, moments and spare
        self.device = params[0].device if params else torch.device("cpu")
        self.offsets, self.sizes, total = _segments(params)
        self.numel = total
        sharded_now = shard is not None and shard[1] > 1
        # How this bucket stores itself: every buffer below is made from bucket_buffers(storage, ...), the
        # derivation the planner sums (plan/bucket_buffers.py). Made sharded, the whole gradients land in the state
        # dtype (the host reduce-scatter sums them so; device-side ZeRO re-makes its chunk's landing buffer).
        self.storage = BucketStorage(
            site=site, separate=self.mirror, flow=self.flow, weight_dtype=_dtype_name(self.dtype),
            link_dtype="" if sharded_now else (link_dtype or ""),
            cast_site=cast_site, pins=self.separate_device, accumulation=True,
            moment_dtype=_dtype_name(moment_dtype), spares=True)
        self.rank_world = (0, 1)   # the ZeRO place the buffers are laid out for (shard() moves it)
        self.master = self.make_buffer(MASTER_BUFFER)
        self.grad = self.make_buffer(GRAD_BUFFER)
        self._init_host_copies()   # separate host master: device weights, copy events, stages
        self.window = None         # ZeRO: (lo, hi) elements this rank steps; None: the whole bucket
        self.state_lo = 0          # bucket element at which exp_avg / exp_avg_sq / the spare start
        self.host_lo = 0           # bucket element at which master / grad start (device-side ZeRO: the chunk's)
        self.device_shard = None   # device-side ZeRO (runtime/sharded_bucket.py): this rank's device buffers
        self._shard_after_adopt = None   # device-side ZeRO: cut to the shard once adopt() filled the whole bucket
        if sharded_now and shard_layout(self.storage, shard[1]) == "chunk":
            self._shard_after_adopt = shard
        elif sharded_now:
            self.rank_world = shard
            self.window = shard_window(total, *shard, self.zero_block)
            self.state_lo = self.window[0]
        self.exp_avg = self.make_buffer(EXP_AVG_BUFFER)
        self.exp_avg_sq = self.make_buffer(EXP_AVG_SQ_BUFFER)
        # bf16 or int8 blocks where asked for and the CPU kernel steps fp32 host state (it rounds them
        # stochastically); a device-stepped or float64 bucket keeps its state dtype (bucket_buffers)
        self.moment_format = "int8" if self.exp_avg.dtype == torch.uint8 else _dtype_name(self.exp_avg.dtype)
        self.steps = [0] * len(params)
        self.has_grad = [False] * len(params)
        self.arrivals = 0          # backward passes that delivered this bucket's gradients since the last step
        self.stepped = False       # stepped in this iteration, finally (no validation pending)
        self.speculated = None     # None, or where the speculative step wrote: "spare" or "inplace"
        self.partial = None        # (sum of squared gradients, any non-finite) of this iteration, once known
        self.rollback_mode = "pingpong"
        self.group_of = list(groups) if groups is not None else [0] * len(params)   # each parameter's param group
        self.kernel_threads = None  # OpenMP threads of the CPU kernel for this bucket (option optimizer_threads)
        self.spare = None          # (master, exp_avg, exp_avg_sq) of the ping-pong spare, allocated on first use
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_version = None  # the landing buffer's version once backward delivered (see script_changed)
        self._script_changed = False  # separate master: a script's clip changed the held gradients
        # ZeRO: the CPU worker writes the reduced shard into ``grad`` (take_reduced_shard) while step() may be
        # checking for a script's change on the training thread; the write and its re-read of the version
        # counter are one step for the check, or it sees our own write as the script's.
        self._grad_version_lock = threading.Lock()

    def buffer_spec(self, name: str) -> BufferSpec:
        """The entry of bucket_buffers for buffer ``name`` at this bucket's ZeRO place (``rank_world``)."""
        for spec in bucket_buffers(self.storage, self.numel, *self.rank_world):
            if spec.name == name:
                return spec
        raise RuntimeError(f"socompile: bucket {self.index} has no {name!r} buffer in its layout "
                           f"({self.storage}); this is a bug")

    def has_buffer(self, name: str) -> bool:
        return any(spec.name == name for spec in bucket_buffers(self.storage, self.numel, *self.rank_world))

    def make_buffer(self, name: str, zeroed: bool = True) -> torch.Tensor:
        """Buffer ``name`` as bucket_buffers lays it out: its dtype and elements; pinned host memory (through the
        runtime, for its copy streams) or pageable, or device memory; host buffers booked in ``host_ledger``."""
        spec = self.buffer_spec(name)
        dtype = getattr(torch, spec.dtype)
        if spec.where == "device":
            return torch.zeros(spec.elements, dtype=dtype, device=self.device)
        if spec.pinned:
            buffer = self.runtime.host_buffer(spec.elements, dtype)
            buffer = buffer.zero_() if zeroed else buffer
        else:
            buffer = torch.zeros(spec.elements, dtype=dtype) if zeroed else torch.empty(spec.elements, dtype=dtype)
        return self.book_host(spec.purpose, buffer, spec.pinned)

    def held_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers this bucket holds now, by their bucket_buffers name (those made on first use once made)."""
        held = {MASTER_BUFFER: self.master, GRAD_BUFFER: self.grad, EXP_AVG_BUFFER: self.exp_avg,
                EXP_AVG_SQ_BUFFER: self.exp_avg_sq, WEIGHTS_BUFFER: self.weights,
                LOW_STAGE_BUFFER: self._stage16 if self.device_shard is None else self.device_shard.stage,
                ACCUMULATION_BUFFER: self._stage_acc}
        if self.spare is not None:
            held.update(zip((SPARE_MASTER_BUFFER, SPARE_EXP_AVG_BUFFER, SPARE_EXP_AVG_SQ_BUFFER), self.spare))
        return {name: t for name, t in held.items() if t is not None}

    def book_host(self, purpose: str, buffer: torch.Tensor, pinned: bool) -> torch.Tensor:
        """Book a host buffer of this bucket (a device-stepped bucket's buffers are device memory: the device
        ledger's "GPU optimizer state", runtime/offload.py)."""
        if self.host_ledger is not None and self.site == "cpu":
            self.host_ledger.book(purpose, buffer, pinned)
        return buffer

    @staticmethod
    def _no_zero():
        raise NotImplementedError(
            "ZeRO sharding (socompile.distributed.shard_optimizer) of a device-stepped optimizer bucket (the plan's "
            "optimizer site 'device': master, gradients and moments on the GPU) is not implemented: the "
            "reduce-scatter and all-gather of socompile.distributed.zero work on host buffers. Plan with "
            "gpu_buckets=0 (every bucket stepped on the CPU) when sharding the optimizer.")

    def _whole_master_not_held(self):
        raise NotImplementedError(
            f"socompile: bucket {self.index} is sharded on the device (ZeRO with a separate host master: this rank "
            f"holds its 1/{self.device_shard.world} of the fp32 master and gradients only), so a parameter's whole "
            f"master cannot be read or written here. Read the weights (the parameters, gathered on the device), and "
            f"save / load the sharded state with socompile.distributed.save / load (each rank writes its piece of "
            f"the master), see docs/distributed.md.")

    def segment(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's segment of ``buffer`` in the parameter's shape. Views are cached per buffer: the
        step path asks for the same ones every iteration (grads, moments, weights after a ping-pong swap), and
        making a view costs microseconds per parameter. Only the bucket's own buffers are cached (two ping-pong
        sets at most); a cached view keeps its buffer alive, so the address in the key cannot be reused."""
        # (Not the device ``weights``: a flow bucket frees their storage, and a freed address must never be
        # found in the cache again.)
        own = (self.master, self.grad, self.exp_avg, self.exp_avg_sq, *(self.spare or ()))
        if self.device_shard is not None and (buffer is self.master or buffer is self.grad):
            self._whole_master_not_held()
        if not any(buffer is b for b in own):
            return self._shaped(buffer, i)
        key = (buffer.data_ptr(), i)
        cached = self._views.get(key)
        if cached is None:
            cached = self._views[key] = self._shaped(buffer, i)
        return cached

    def _shaped(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's segment of ``buffer`` as a tensor like the parameter: a complex parameter's segment
        holds its real view, so it is viewed back as complex (segments start at even elements, ``ALIGN``)."""
        p = self.params[i]
        if p.is_complex():
            return torch.view_as_complex(buffer[self.segment(i)].view(*p.shape, 2))
        return buffer[self.segment(i)].view(p.shape)

    @property
    def moments_rounded(self) -> bool:
        """The moments are stored in bf16 or int8 blocks (stochastically rounded at each step): no algebraic
        inverse."""
        return self.moment_format != _dtype_name(self.state_dtype)

    @property
    def moment_bytes(self) -> float:
        """Bytes one moment of one element takes (socompile/moment_format.py): what the kernel reads and writes."""
        return moment_bytes_per_element(self.moment_format)

    def moment_range(self, buffer: torch.Tensor, elements: slice) -> torch.Tensor:
        """The part of a moment buffer (exp_avg, exp_avg_sq or their spares) holding state ``elements`` (a slice
        from ``local``): int8 blocks are packed (socompile/moment_format.py), the others one element each."""
        return buffer[slice(*byte_range(self.moment_format, elements.start, elements.stop))]

    def moment_part(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a moment buffer: ``state_part`` for fp32 and bf16 moments; for int8, the packed
        bytes of its ``held(i)`` elements, flat (a ZeRO window starts at a block: ``zero_block``)."""
        if self.moment_format != "int8":
            return self.state_part(buffer, i)
        if not self.sharded:
            return self.moment_range(buffer, self.segment(i))
        a, b = self.held(i) or (0, 0)
        start = self.offsets[i] + a
        return self.moment_range(buffer, self.local(start, start + b - a))

    def moment_values(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter i's current (exp_avg, exp_avg_sq) in torch's layout: fp32, of its ``held(i)`` elements
        (shaped like the parameter when the bucket is not sharded, else flat); new tensors for bf16 and int8
        moments, views of the buffers otherwise."""
        from .int8_moments import as_fp32
        a, b = self.held(i) or (0, 0)
        m, v = as_fp32(self.moment_format, self.moment_part(self.exp_avg, i), self.moment_part(self.exp_avg_sq, i),
                       b - a)
        if self.moment_format == "int8" and not self.sharded:   # decoded flat: shaped like the others' views
            return m.view(self.params[i].shape), v.view(self.params[i].shape)
        return m, v

    def whole_moment_values(self, i: int, exp_avg: torch.Tensor,
                            exp_avg_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter i's (exp_avg, exp_avg_sq) in torch's layout (new fp32 tensors shaped like it) from whole
        moment buffers of this bucket's format (gathered from every ZeRO rank)."""
        from .int8_moments import as_fp32
        if self.moment_format == "int8":
            seg, shape = self.segment(i), self.params[i].shape
            m, v = as_fp32("int8", self.moment_range(exp_avg, seg), self.moment_range(exp_avg_sq, seg), self.sizes[i])
            return m.view(shape), v.view(shape)
        m, v = as_fp32(self.moment_format, self._shaped(exp_avg, i), self._shaped(exp_avg_sq, i), self.sizes[i])
        return m.clone(), v.clone()

    def moment_buffer_elements(self, elements: int) -> int:
        """Elements of a moment buffer of this bucket's format holding ``elements`` parameters (int8: bytes)."""
        return moment_buffer(self.moment_format, elements)[1]

    @property
    def zero_block(self) -> int:
        """What this bucket's ZeRO chunks are a multiple of (plan/bucket_buffers.py ``zero_block``)."""
        return zero_block(self.storage)

    def set_moments(self, i: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int) -> None:
        """Write parameter i's moments from torch's fp32 layout (state_dict loading): int8 blocks are encoded
        with the kernel's stochastic rounding drawn from ``seed``; the others are copied (cast)."""
        held = self.held(i)   # sharded: this rank's part of the whole moments
        if self.moment_format == "int8":
            if held is not None:
                a, b = held
                self.set_held_moments(i, exp_avg.reshape(-1)[a:b], exp_avg_sq.reshape(-1)[a:b], seed)
            return
        for given, buffer in ((exp_avg, self.exp_avg), (exp_avg_sq, self.exp_avg_sq)):
            if held is not None:   # flat and real (complex parameters: their real view), as the bucket
                flat_real(self.state_part(buffer, i)).copy_(flat_real(given)[held[0]:held[1]])

    def set_held_moments(self, i: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int) -> None:
        """Encode int8 moments of parameter i's ``held(i)`` elements [a, b) from fp32 ``exp_avg`` / ``exp_avg_sq``
        of those elements (a sharded checkpoint's pieces). ``a`` starts a block (``zero_block``) and the bits are
        drawn as for the whole parameter, so a rank encodes its piece as one process encodes the whole."""
        from .int8_moments import encode_moments
        a, _ = self.held(i) or (0, 0)
        m, v = encode_moments(exp_avg.reshape(-1).float(), exp_avg_sq.reshape(-1).float(), seed, a)
        self.moment_part(self.exp_avg, i).copy_(m)
        self.moment_part(self.exp_avg_sq, i).copy_(v)

    @property
    def state_elements(self) -> int:
        """Elements the optimizer state covers: the bucket's, or this rank's window (int8 buffers hold bytes: the
        window's length)."""
        if self.moment_format == "int8":
            return self.numel if self.window is None else self.window[1] - self.window[0]
        return self.exp_avg.numel()

    @property
    def sharded(self) -> bool:
        """True when this rank keeps optimizer state for its window only (ZeRO with more than one rank)."""
        return self.state_elements != self.numel

    def local(self, start: int, end: int) -> slice:
        """Bucket elements [start, end) (inside the state range) as a slice of the state buffers."""
        return slice(start - self.state_lo, end - self.state_lo)

    def host(self, start: int, end: int) -> slice:
        """Bucket elements [start, end) as a slice of ``master`` and ``grad`` (device-side ZeRO holds them for
        this rank's chunk only, from ``host_lo``; else whole)."""
        return slice(start - self.host_lo, end - self.host_lo)

    def held(self, i: int) -> tuple[int, int] | None:
        """Elements [a, b) of parameter i (flattened) whose optimizer state this bucket holds; None if none."""
        lo, hi = self.state_lo, self.state_lo + self.state_elements
        start, end = max(self.offsets[i], lo), min(self.offsets[i] + self.sizes[i], hi)
        return (start - self.offsets[i], end - self.offsets[i]) if end > start else None

    def state_part(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """The part of a state buffer (exp_avg, exp_avg_sq, or a spare) that holds parameter i's ``held(i)``
        elements, flat; the whole parameter, shaped like it, when the bucket is not sharded."""
        if not self.sharded:
            return self.view(buffer, i)
        a, b = self.held(i) or (0, 0)
        start = self.offsets[i] + a
        return buffer[self.local(start, start + b - a)]

    def shard(self, rank: int, world: int) -> None:
        """Give this rank the window ``shard_window`` of the bucket and keep optimizer state for it only (the
        window's part of the current state is kept; the ping-pong spare is dropped, it is re-made on use)."""
        if self.window is not None or world <= 1:
            self.window = self.window or (0, self.numel)
            return
        if self.mirror and self.master.device.type != "cpu":
            self._no_zero()
        layout = shard_layout(self.storage, world)
        bucket_buffers(self.storage, self.numel, rank, world)   # refuses a layout not built, before anything moves
        self.rank_world = (rank, world)
        if layout == "chunk":                               # master, gradients and state for the chunk; collectives
            narrow_to_device_shard(self, rank, world)      # on the device
            return
        lo, hi = self.window = shard_window(self.numel, rank, world, self.zero_block)
        whole = (self.exp_avg, self.exp_avg_sq)
        self.exp_avg, self.exp_avg_sq = self.make_buffer(EXP_AVG_BUFFER), self.make_buffer(EXP_AVG_SQ_BUFFER)
        for mine, t in zip((self.exp_avg, self.exp_avg_sq), whole):
            mine.copy_(self.moment_range(t, slice(lo, hi)))   # int8: the window's whole blocks
        self.state_lo, self.spare = lo, None

    def take_device_shard(self, shard, *, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Device-side ZeRO (runtime/sharded_bucket.py narrow_to_device_shard): from now on this bucket holds its
        chunk's host buffers and ``shard`` (a DeviceShard) its device ones; ``weights``, when not None (stationary),
        the device weights padded to world chunks, which the parameters are re-pointed into. The stages, the spare
        and the cached views of the whole buffers are dropped (re-made for the chunk on use)."""
        self.master, self.grad, self.exp_avg, self.exp_avg_sq = master, grad, exp_avg, exp_avg_sq
        if weights is not None:
            self.weights = weights
            for i, p in enumerate(self.params):
                p.data = self._shaped(weights, i)
        self.spare, self._stage16, self._stage_acc = None, None, None
        self._pending_adds.clear()
        self._views.clear()
        lo = shard.lo
        self.window, self.state_lo, self.host_lo = (lo, shard.hi), lo, lo
        self.low_stale()   # the shard's bf16 stage is new: cast from the master at its first upload
        self.device_shard = shard

    def drop_device_shard(self, *, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor) -> None:
        """Undo ``take_device_shard`` with whole buffers (gathered from every rank); the caller closes the shard."""
        self.master, self.exp_avg, self.exp_avg_sq, self.grad = master, exp_avg, exp_avg_sq, grad
        self.weights = self.weights[:self.numel]
        self.spare, self._stage16 = None, None
        self._views.clear()
        self.window, self.state_lo, self.host_lo, self.rank_world = None, 0, 0, (0, 1)
        self.device_shard = None

    def unshard(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Undo ``shard`` (host path) with the whole moments gathered from every rank (a new bucket layout adopts
        from them: ZeroSharding.unshard_state); the spare is re-made whole on use."""
        self.exp_avg, self.exp_avg_sq = exp_avg, exp_avg_sq
        self.state_lo, self.spare, self.window, self.rank_world = 0, None, None, (0, 1)

    def adopt(self, previous: dict[int, tuple["FlatBucket", int]]) -> None:
        """Fill this bucket from the parameters (or from the bucket that held them before) and re-point
        each parameter's storage into ``master`` (shared) or into the device ``weights`` (separate: filled by
        casting the master, which for a parameter seen for the first time is its own value, upcast)."""
        for i, p in enumerate(self.params):
            old = previous.get(id(p))
            seg = self.segment(i)
            if old is not None:
                bucket, j = old
                src = bucket.segment(j)
                bucket.wait_grads()
                self.master[seg].copy_(bucket.master[src])
                self.grad[seg].copy_(bucket.grad[src])
                self._adopt_state(i, bucket, j)
                self.steps[i], self.has_grad[i] = bucket.steps[j], bucket.has_grad[j]
                self.arrivals = max(self.arrivals, bucket.arrivals)   # mid-accumulation: count on
            else:
                self.master[seg].copy_(flat_real(p.detach()))
            if not self.mirror:
                p.data = self.view(self.master, i)
                if p.grad is not None:  # keep a pending gradient, now as a view of this bucket
                    self.view(self.grad, i).copy_(p.grad)
                    p.grad = self.view(self.grad, i)
            elif p.grad is not None:    # the device keeps its .grad; the host copy is what the step reads
                self.view(self.grad, i).copy_(p.grad)
                self.has_grad[i] = True
        if not self.mirror:
            return
        if self.weights is not None:
            self.weights.copy_(self.master)
            self.low_synced()
        for i, p in enumerate(self.params):
            p.data = self.view(self.master if self.weights is None else self.weights, i)
        self.free_weights()
        if self.flow and self.dtype in HALF_WEIGHTS:
            self._sync_stage16()
        if self._shard_after_adopt is not None:
            shard, self._shard_after_adopt = self._shard_after_adopt, None
            self.shard(*shard)

    def _adopt_state(self, i: int, bucket: "FlatBucket", j: int) -> None:
        if not self.sharded and not bucket.sharded:
            self.moment_part(self.exp_avg, i).copy_(bucket.moment_part(bucket.exp_avg, j))
            self.moment_part(self.exp_avg_sq, i).copy_(bucket.moment_part(bucket.exp_avg_sq, j))
            return
        want, have = self.held(i), bucket.held(j)
        if want is None:
            return
        if have is None or have[0] > want[0] or have[1] < want[1]:
            if bucket.steps[j] == 0:   # no state yet: zeros are right
                return
            raise RuntimeError("socompile: a sharded optimizer's state must be moved between ranks before its "
                               "buckets are laid out again (ZeroSharding.unshard_state); this is a bug")
        for mine, theirs in ((self.exp_avg, bucket.exp_avg), (self.exp_avg_sq, bucket.exp_avg_sq)):
            if self.moment_format == "int8":   # both cuts start at blocks of the parameter (zero_block)
                src = bucket.moment_part(theirs, j)
                src = src[slice(*byte_range("int8", want[0] - have[0], want[1] - have[0]))]
                self.moment_part(mine, i).copy_(src)
                continue
            src = flat_real(bucket.state_part(theirs, j))[want[0] - have[0]:want[1] - have[0]]
            flat_real(self.state_part(mine, i)).copy_(src)

    def gather_eager_grads(self) -> None:
        """Take gradients that autograd left in ``.grad`` (eager use, or parts of a model not compiled)."""
        if self.mirror:   # .grad stays on the device in the parameter's dtype; the host keeps an fp32 copy
            have = [i for i, p in enumerate(self.params) if p.grad is not None]
            if have:
                self.receive_many(have, [self.params[i].grad for i in have], accumulate=False)
            return
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            view = self.view(self.grad, i)
            if g.data_ptr() != view.data_ptr():
                # Copied, and ``.grad`` left as the caller's tensor: torch's optimizers never replace or
                # change a gradient (torch's test_grads_are_never_inplaced_into checks its version counter).
                view.copy_(g)
            self.has_grad[i] = True

    def runs(self, group_of: list[int]) -> list[tuple[int, int, int, int]]:
        """(start, end, group index, step) for maximal runs of consecutive segments that have a gradient
        and share param group and step count: each run is one kernel call."""
        out: list[tuple[int, int, int, int]] = []
        for i in range(len(self.params)):
            if not self.has_grad[i]:
                continue
            key = (group_of[i], self.steps[i] + 1)
            start, end = self.offsets[i], self.offsets[i] + self.sizes[i]
            if out and out[-1][2:] == key and self._contiguous(out[-1][1], i):
                out[-1] = (out[-1][0], end, *key)
            else:
                out.append((start, end, *key))
        if self.window is not None:   # a data-parallel rank steps (and measures) only its shard
            lo, hi = self.window
            out = [(max(s, lo), min(e, hi), *rest) for s, e, *rest in out if min(e, hi) > max(s, lo)]
        return out

    def _contiguous(self, prev_end: int, i: int) -> bool:
        # Padding between segments is zero in all buffers, so a run may cover it.
        return i > 0 and self.has_grad[i - 1] and _round_up(prev_end, ALIGN) == self.offsets[i]

    def spare_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Spare (master, exp_avg, exp_avg_sq), indexed like the state buffers (``local``): when sharded the
        spare master covers the window only."""
        if self.spare is None:
            # The spare master becomes the master at a commit (swap_in_spare): pinned when the master is.
            self.spare = tuple(self.make_buffer(name) for name in
                               (SPARE_MASTER_BUFFER, SPARE_EXP_AVG_BUFFER, SPARE_EXP_AVG_SQ_BUFFER))
        return self.spare

    def swap_in_spare(self) -> None:
        """Commit a ping-pong step: the spare becomes current and the current state the spare (so swapping
        again undoes the step). Segments the step did not write (no gradient) are copied across first, so
        the new current copy is complete. Sharded: the moments swap, the window of the weights is exchanged
        with the spare's (``master`` stays the buffer the model aliases, and the all-gather fills)."""
        if self.sharded:
            spare_master, spare_m, spare_v = self.spare
            window = self.master[self.host(*self.window)]
            # the spare covers the state's range (device-side ZeRO: the whole chunk, which the last ranks' windows
            # do not fill); the window is its first part
            spare_window = spare_master[self.local(*self.window)]
            for i, present in enumerate(self.has_grad):
                if not present and self.held(i) is not None:
                    parts = [(self.state_part(spare_window, i), self.state_part(window, i))]
                    parts += [(self.moment_part(spare, i), self.moment_part(mine, i))
                              for mine, spare in ((self.exp_avg, spare_m), (self.exp_avg_sq, spare_v))]
                    for part, source in parts:
                        part.copy_(source)
                        self.host_work.add_work(SPARE_COPY, copy_bytes(part.numel(), part.element_size(),
                                                                       part.element_size()))
            # kept in the spare: zero_grad() may swap back (StepValidation.discard_iteration)
            previous = window.clone()
            window.copy_(spare_window)
            spare_window.copy_(previous)
            size = window.element_size()
            for _ in range(3):   # the clone and the two copies of the window
                self.host_work.add_work(SPARE_COPY, copy_bytes(window.numel(), size, size))
            self.spare = (spare_master, self.exp_avg, self.exp_avg_sq)
            self.exp_avg, self.exp_avg_sq = spare_m, spare_v
            self.master_changed()   # separate master: the window changed (gather: the rest)
            return
        spare_master, spare_m, spare_v = self.spare
        for i, present in enumerate(self.has_grad):
            if not present:
                seg = self.segment(i)
                spare_master[seg].copy_(self.master[seg])
                self.moment_range(spare_m, seg).copy_(self.moment_range(self.exp_avg, seg))
                self.moment_range(spare_v, seg).copy_(self.moment_range(self.exp_avg_sq, seg))
                # master + both moments (int8: the segment's whole blocks)
                n = self.sizes[i]
                state_bytes = n * self.master.element_size() + 2 * moment_buffer_bytes(self.moment_format, n)
                self.host_work.add_work(SPARE_COPY, copy_bytes(1, state_bytes, state_bytes))
        self.spare = (self.master, self.exp_avg, self.exp_avg_sq)
        self.master, self.exp_avg, self.exp_avg_sq = spare_master, spare_m, spare_v
        self.dirty = True
        self.low_swapped()
        if self.mirror and self.weights is not None:
            return   # the parameters stay views of the device weights; upload() brings the new master there
        for i, p in enumerate(self.params):
            p.data = self.view(self.master, i)

    def note_gradients_delivered(self) -> None:
        """Backward has written this bucket's gradients: remember the landing buffer's version counter. The
        script's ``.grad`` tensors are views of it (shared master), so any in-place change the script makes
        before ``step()`` (its own ``clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler.unscale_``, a
        manual ``mul_``) bumps that counter; our kernel writes through raw pointers and never does."""
        if not self.mirror:
            self._grad_version = self.grad._version

    def take_reduced_shard(self, lo: int, averaged: torch.Tensor) -> None:
        """ZeRO: this rank's shard of the averaged gradients replaces its local ones. Our own write, so the
        version counter that detects a script's change is re-read after it."""
        with self._grad_version_lock:
            before = self.grad._version
            if self._grad_version is not None and before != self._grad_version:
                self._script_changed = True   # the script changed them before our write would hide it
            self.grad[lo:lo + averaged.numel()].copy_(averaged)
            if self._grad_version is not None:
                if self.grad._version != before + 1:   # copy_ bumps it once; more: the script wrote meanwhile
                    self._script_changed = True
                self._grad_version = self.grad._version

    def script_changed_gradients(self) -> bool:
        """Whether the training script changed the gradients backward delivered: in place (the version
        counter moved), by assigning another tensor to ``.grad``, or by setting it to None."""
        with self._grad_version_lock:
            if self._script_changed:
                return True
            if self._grad_version is None:
                return False
            if self.grad._version != self._grad_version:
                return True
        return any(present and (p.grad is None or p.grad.data_ptr() != self.view(self.grad, i).data_ptr())
                   for i, (p, present) in enumerate(zip(self.params, self.has_grad)))

    def held_gradient(self, i: int) -> torch.Tensor | None:
        """Separate master: parameter i's gradient as this bucket holds it on the host (``.grad`` stays None),
        for a script's own clipping (optim/script_clip.py); None where there is none or only a shard of it."""
        if not self.mirror or not self.has_grad[i] or self.sharded or self.device_shard is not None:
            return None
        self.wait_grads()   # the copy from the device (and staged micro-batches) first
        return self.view(self.grad, i)

    def note_script_change(self) -> None:
        """The training script changed the gradients ``held_gradient`` gave it."""
        self._script_changed = True

    def take_script_gradients(self) -> None:
        """Make the landing buffer hold the gradients as the script left them: a ``.grad`` the script
        replaced is copied in (``.grad`` stays the script's tensor), one it set to None is no gradient (torch's
        AdamW skips such a parameter). A separate master's ``.grad`` stays None: its script changed the held
        gradients in place (``held_gradient``)."""
        for i, p in enumerate(self.params):
            if self.mirror or not self.has_grad[i]:
                continue
            view = self.view(self.grad, i)
            if p.grad is None:
                self.has_grad[i] = False
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)   # ``.grad`` stays the script's tensor, as in gather_eager_grads
        self._grad_version = self.grad._version
        self._script_changed = False

    # ---- the iteration's state: which gradients arrived, what was stepped or speculated, the norm partial
    def gradients_arrived(self) -> int:
        """Backward delivered this bucket's gradients once more (a micro-batch); returns how often since the step."""
        self.arrivals += 1
        return self.arrivals

    def stepped_final(self, final: bool = True) -> None:
        """The bucket's step of this iteration is final (``False``: undone, as a script's own clip asks)."""
        self.stepped = final

    def speculated_into(self, where: str | None) -> None:
        """A speculative step wrote "spare" or "inplace"; None: there is none (rolled back, or not taken)."""
        self.speculated = where

    def learn_partial(self, partial: tuple[float, bool] | None) -> None:
        """This iteration's (sum of squared gradients, any non-finite), once known; None: to be taken again."""
        self.partial = partial

    def clear_gradients(self) -> None:
        """No parameter of the bucket holds a gradient (``zero_grad``)."""
        self.has_grad = [False] * len(self.params)

    def use_rollback(self, mode: str) -> None:
        """How a speculative step is undone: "pingpong" (the spare, exact) or "inverse" (the kernel's inverse)."""
        if mode not in ("pingpong", "inverse"):
            raise ValueError(f"rollback must be 'pingpong' or 'inverse', got {mode!r}")
        self.rollback_mode = mode

    def use_kernel_threads(self, threads: int | None) -> None:
        """OpenMP threads of the CPU kernel for this bucket (option optimizer_threads; None: the default)."""
        self.kernel_threads = threads

    def reset_iteration(self) -> None:
        self._grad_version = None
        self._script_changed = False
        self.arrivals = 0
        self.stepped = False
        self.speculated = None
        self.partial = None
