"""The offload runtime of one compiled graph pair: fetches flow buckets' weights to the device, books every
device byte it holds, and records what it did when (for tests and the timeline in docs/runtime.md).

The weight-flow ops (ops/offload_ops.py) call into it by handle:

    prefetch(phase, b)   wait for b's CPU step if one is still running (``before_host_read``), allocate b's
                         device buffer (booked), queue the host->device copy on the "h2d" stream
    wait(phase, b)       the compute stream waits for that copy's event; the buffer is handed to the graph
    release(phase, b)    un-book it; the graph drops its last reference right after its last use

On the CPU build the device buffer is a separate host tensor and the copy a real copy on the h2d stream's own
thread, so the bytes booked here are bytes really allocated, and a flow bucket really costs no device memory
between its release and its next fetch.
"""
from __future__ import annotations

import weakref

import torch

from ..dtypes import TORCH_DTYPES
from . import handles, ranges
from .device import DeviceRuntime
from .events import EventLog
from ..plan.memory import device_cast_buckets
from .host_master import UploadStaging
from .memory import DeviceLedger
from .traffic import FLOW_FETCH, TrafficLedger

FLOW = "weight-flow buffers"
STAGING = "upload staging"
PHASE_NAMES = {"fw": "forward", "bw": "backward"}


class OffloadRuntime:
    def __init__(self, plan, buckets, device: DeviceRuntime, events: EventLog | None = None,
                 traffic: TrafficLedger | None = None, before_host_read=None):
        """``before_host_read(flat)``: called before a fetch reads the host copy of ``flat`` (the optimizer's
        wait for that bucket's CPU job, which ``opt.step()`` may have returned before)."""
        self.plan = plan
        self.before_host_read = before_host_read
        self.buckets = buckets                  # FlatBuckets of the optimizer's claim, by plan index
        self.device = device
        self.h2d = device.stream("h2d")
        self.ledger = DeviceLedger()
        self.events = events if events is not None else EventLog()
        self.traffic = traffic if traffic is not None else TrafficLedger()
        self._inflight: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
        self.fetched: list[weakref.ref] = []    # weak references to every buffer handed out (tests: none leak)
        self.fetch_counts: dict[tuple[str, int], int] = {}
        self.link_dtype = {b.index: TORCH_DTYPES[b.param_link_dtype] for b in plan.buckets if b.weight_mode == "flow"}
        weight_bytes = plan.prediction("param_dtype_bytes", 4)
        for b, flat in zip(plan.buckets, buckets):
            # A separate host master (FlatBucket.mirror) gives the parameters their own flat device buffer:
            # book its real bytes (the parameters' dtype). Shared: the parameters are the fp32 master itself.
            weights = getattr(flat, "weights", None)
            if b.optimizer_site == "device":
                # fp32 master, gradient and Adam moments on the device (on the CPU build: the bucket's buffers)
                self.ledger.alloc("GPU optimizer state", b.index, sum(
                    t.numel() * t.element_size() for t in (flat.master, flat.grad, flat.exp_avg, flat.exp_avg_sq)))
                if weights is not None:   # non-fp32 parameters: a device copy cast from the master
                    self.ledger.alloc("stationary weights", b.index, weights.numel() * weights.element_size())
            elif b.weight_mode == "stationary":
                nbytes = flat.master.numel() * weight_bytes if weights is None else \
                    flat.numel * weights.element_size()   # device-side ZeRO's padding: its own ledger
                self.ledger.alloc("stationary weights", b.index, nbytes)
        self.upload_staging = self._upload_staging()
        self.attach_buckets()
        self.handle = handles.register(self)

    def _upload_staging(self) -> UploadStaging | None:
        """The fp32 staging of the plan's device-cast buckets (plan/memory.py ``device_cast_buckets``), booked
        here for as long as the graph lives: two buffers of the largest such bucket."""
        cast = {b.index for b in device_cast_buckets(self.plan)}
        sizes = [flat.numel for b, flat in zip(self.plan.buckets, self.buckets)
                 if b.index in cast and getattr(flat, "weights", None) is not None]
        if not sizes:
            return None
        staging = UploadStaging(self.device, max(sizes))
        self.ledger.alloc(STAGING, "uploads", staging.nbytes)
        return staging

    def attach_buckets(self) -> None:
        """Hand the staging to the device-cast buckets, and tell each CPU-stepped flow bucket that this
        runtime's fetches wait for its CPU job (so ``opt.step()`` need not); again after the optimizer laid the
        claim out anew."""
        cast = {b.index for b in device_cast_buckets(self.plan)}
        for b, flat in zip(self.plan.buckets, self.buckets):
            if b.index in cast and self.upload_staging is not None:
                flat.use_upload_staging(self.upload_staging)
            if self.before_host_read is not None and b.weight_mode == "flow" and b.optimizer_site == "cpu":
                flat.read_first_by_fetch()

    def numel(self, bucket: int) -> int:
        return self.buckets[bucket].numel   # a device-sharded bucket's master holds its shard only

    @ranges.ranged(ranges.PREFETCH, lambda self, phase, bucket: bucket)
    def prefetch(self, phase: str, bucket: int) -> None:
        key = (phase, bucket)
        if key in self._inflight:
            raise RuntimeError(f"socompile: bucket {bucket} prefetched twice in {PHASE_NAMES[phase]} without a wait")
        self.ledger.set_phase(PHASE_NAMES[phase])
        flat = self.buckets[bucket]
        if self.before_host_read is not None:
            self.before_host_read(flat)   # the host copy is final once the bucket's CPU job ended
        dtype = self.link_dtype[bucket]
        shard = getattr(flat, "device_shard", None)
        if shard is not None:   # device-side ZeRO: this rank's shard up, the window all-gathered on the device
            self._fetch_window(key, flat, shard, dtype)
            return
        dst = self.device.empty(flat.master.numel(), dtype)
        self.ledger.alloc(FLOW, key, dst.numel() * dst.element_size())
        # read now: a ping-pong commit re-points master, never during a graph. A separate host master of bf16
        # weights keeps a bf16 copy for the link (FlatBucket.link_source): half the bytes, cast on the host.
        src = flat.link_source(dtype) if hasattr(flat, "link_source") else flat.master
        self.events.record(f"{phase}_prefetch", bucket)
        self.traffic.add_copy("h2d", FLOW_FETCH, dst)

        def copy():
            self.events.record("h2d_start", bucket)
            with ranges.named(ranges.PREFETCH_COPY, bucket):
                dst.copy_(src)    # converts to the link dtype when the CPU casts (cast_site="cpu")
            self.events.record("h2d_end", bucket)
        done = self.h2d.submit(copy) if self.device.kind == "cpu" else self.device.copy_async(dst, src, self.h2d)
        self._inflight[key] = (dst, lambda: self.device.wait_on_compute(done))
        self.fetch_counts[key] = self.fetch_counts.get(key, 0) + 1

    def _fetch_window(self, key, flat, shard, dtype: torch.dtype) -> None:
        """A device-sharded flow bucket (runtime/sharded_bucket.py): the window holds ``padded`` elements (W equal
        chunks: the all-gather's output), booked whole; the graph gets its first ``numel``."""
        window = self.device.empty(shard.padded, dtype)
        self.ledger.alloc(FLOW, key, window.numel() * window.element_size())
        self.events.record(f"{key[0]}_prefetch", key[1])
        ready = shard.pool.collectives.fetch_window(flat, window)   # books its upload in the traffic ledger
        self._inflight[key] = (window[:flat.numel], ready)
        self.fetch_counts[key] = self.fetch_counts.get(key, 0) + 1

    def wait(self, phase: str, bucket: int) -> torch.Tensor:
        entry = self._inflight.pop((phase, bucket), None)
        if entry is None:
            raise RuntimeError(f"socompile: {PHASE_NAMES[phase]} waits for bucket {bucket}, which was not "
                               f"prefetched (a missing socompile.prefetch node; run passes.table.graph_problems)")
        dst, ready = entry
        ready()   # the compute stream waits for the copy (and, device-sharded, the all-gather)
        self.events.record(f"{phase}_wait", bucket)
        self.fetched.append(weakref.ref(dst))
        return dst            # the graph owns it from here; the runtime keeps no reference

    def release(self, phase: str, bucket: int) -> None:
        self.ledger.free(FLOW, (phase, bucket))
        self.events.record(f"{phase}_release", bucket)

    def live_fetched(self) -> int:
        """Fetched buffers still alive (held by anything: a saved view, a graph output)."""
        return sum(1 for r in self.fetched if r() is not None)
