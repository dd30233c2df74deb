"""An emulated CUDA device: the CUDA runtime's own code (runtime/device.py ``CUDARuntime``) run on the CPU with
real asynchrony, by swapping only the torch.cuda seam (``_TorchCuda``) for ``EmulatedCuda``.

    rt = CUDARuntime("cuda", api=EmulatedCuda(seed=0))      # what runtime="emulated" builds (device_runtime)

What it models, and how:

* **Streams.** The compute stream is the thread that runs the graph: its work runs at once, on the calling
  thread, so "the compute stream waits for an event" blocks that thread (as on the CPU runtime). Every other
  stream is a worker thread with a queue: each queued operation (a copy, a device-side cast, an event record)
  first waits a random delay of 0 to ``max_delay`` seconds drawn from a generator seeded by ``seed``
  (``SOCOMPILE_EMULATION_SEED``; ``SOCOMPILE_EMULATION_MAX_DELAY_MS`` sets ``max_delay``), so copies land
  late and in varying interleavings; a host thread that waited for a side stream's event resumes after such a
  delay too (``host_wakeup``). ``wait_event``,
  ``wait_stream``, ``synchronize`` and ``Event.query`` follow CUDA: a side stream's wait is queued (the caller
  does not block), waiting on an event never recorded is a no-op, an event is done once everything queued before
  its record is.
* **Order after compute.** The compute stream's kernels are not seen (they run at once), but the order of
  a side stream after them is: each side stream keeps its *horizon*, how far into the compute work each host
  thread issued it is ordered (a count of that thread's submissions to side streams, the points at which the
  graph's work in between is handed on); ``wait_stream(compute)`` and waiting for an event recorded on
  compute raise it to now, waiting for a side stream's event raises it to that stream's horizon at the
  record. A copy touching device memory, queued by a thread that runs the graph, must be ordered after all
  the compute work that thread issued before it: on CUDA it could otherwise run before the kernels that
  write its source (a gradient, a saved activation) or still read its destination. Such a copy is a hazard.
  Threads of socompile's runtime (names starting ``socompile``: the CPU optimizer worker) issue no compute
  work; their copies are ordered by the events they wait for, which the emulator does not check.
* **Current stream.** As on CUDA (legacy default stream), every thread's current stream is the device's default
  stream, the compute stream, unless the thread entered ``use_stream``.
* **Device memory.** A model on the CPU is the device: every tensor is device memory except the host buffers
  allocated through ``pinned`` (a registry of their storages), so ``record_stream`` and the device-side dtype
  conversion of ``copy_many_async`` run.
* **Work queued on a side stream.** Inside ``use_stream(side)``, ``Tensor.copy_`` and ``Tensor.to`` are not run
  but queued on that stream (a ``TorchFunctionMode``); ``to`` returns its (device) result at once, filled when
  the queued cast runs.
* **Hazards.** Each queued copy snapshots its source when it is queued (where the stream itself does not write
  the source first) and checks, when it runs, that the source still holds those bytes: a buffer that the compute
  stream (or a host thread) rewrote or released meanwhile is a hazard. The destination is poisoned (NaN, for
  floating dtypes) when the copy is queued, so a read before the copy landed sees NaN; a destination rewritten
  before it landed is a hazard too. A hazard poisons the destination, is kept in ``hazards`` and is raised
  (RuntimeError naming the stream, the tensor and the op) by the synchronize of any later event of that stream,
  and by ``check()``.

Not modelled: the caching allocator (on the CPU, Python references keep queued tensors alive, so
``record_stream`` is only counted), kernels other than copies and casts on side streams (they run at once),
several devices.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import random
import threading
import time
import weakref
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

SEED_ENV = "SOCOMPILE_EMULATION_SEED"
MAX_DELAY_ENV = "SOCOMPILE_EMULATION_MAX_DELAY_MS"
DEFAULT_MAX_DELAY = 0.003      # seconds: "a few ms", long against a tiny model's kernels, short for a test


def seed_from_environ(environ=None) -> int:
    raw = (os.environ if environ is None else environ).get(SEED_ENV, "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer seed for the emulated device's delays, got {raw!r}") \
            from None


def max_delay_from_environ(environ=None) -> float:
    """The longest delay of a queued operation, in seconds (``SOCOMPILE_EMULATION_MAX_DELAY_MS``, default 3 ms).
    Longer than a step (tens of ms on a tiny model), copies land after the host has moved on to the next step,
    which exposes waits that order work across steps (a host write after an upload, a job the next forward
    waits for)."""
    raw = (os.environ if environ is None else environ).get(MAX_DELAY_ENV)
    if raw is None:
        return DEFAULT_MAX_DELAY
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:   # negative, or not a number
        raise ValueError(f"{MAX_DELAY_ENV} must be a non-negative number of milliseconds, got {raw!r}")
    return value / 1e3


def _describe(t: torch.Tensor) -> str:
    return f"tensor{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} at 0x{t.untyped_storage().data_ptr():x}"


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _region(t: torch.Tensor) -> tuple:
    """The memory a tensor covers, as a key (storage, first element, size, strides)."""
    return (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() and t.untyped_storage().nbytes():
        t.fill_(float("nan"))


RUNTIME_THREAD_PREFIX = "socompile"   # socompile's own threads (CPU optimizer worker): they run no graph


def _issues_compute_work() -> bool:
    """Whether the calling thread runs the graph (issues compute-stream work), as opposed to a runtime thread."""
    return not threading.current_thread().name.startswith(RUNTIME_THREAD_PREFIX)


class EmulatedHazard(RuntimeError):
    """A race the emulated device saw: memory rewritten, released or read out of the order CUDA guarantees."""


# ------------------------------------------------------------------------------------------------- events
class EmulatedEvent:
    def __init__(self):
        self._done = threading.Event()
        self._done.set()              # an event never recorded is complete (CUDA: query() is True)
        self._stream = None
        self._error_mark = 0
        self._horizon: dict = {}   # the compute work the recording stream was ordered after

    def record(self, stream) -> None:
        self._done = threading.Event()
        self._stream = stream
        stream._enqueue_record(self)

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._stream is not None:
            # A host thread woken by a side stream's event resumes late (descheduled, or a busy core): the CPU
            # work after the wait (an optimizer job) then runs on into what the training thread does next.
            self._stream.device.host_wakeup()
            self._stream._raise_errors(self._error_mark)


# ------------------------------------------------------------------------------------------------ streams
class _ComputeStream:
    """The device's default stream: the thread that runs the graph. Its work has finished when the host call
    that issued it returns, so waits on it are no-ops and its waits block the calling thread."""

    name = "compute"

    def __init__(self, device: "EmulatedCuda"):
        self.device = device

    def _enqueue_record(self, event: EmulatedEvent) -> None:
        event._horizon = self.device.compute_issued()
        event._done.set()

    def _raise_errors(self, mark: int) -> None:
        pass

    def wait_event(self, event: EmulatedEvent) -> None:
        event.synchronize()

    def wait_stream(self, other) -> None:
        other.synchronize()

    def synchronize(self) -> None:
        pass


def _stop_stream(ref: "weakref.ref[_SideStream]") -> None:
    stream = ref()
    if stream is not None:
        stream.stop()


class _SideStream:
    """A worker thread that runs queued operations in order, each after a seeded random delay."""

    def __init__(self, device: "EmulatedCuda", name: str):
        self.device = device
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[EmulatedHazard] = []
        # How far into each thread's compute work the waits queued so far order this stream (module docstring,
        # "Order after compute"); read and raised under the device's lock, at queue time.
        self.horizon: dict = {}
        self._thread = threading.Thread(target=self._run, name=f"socompile-emulated-{name}", daemon=True)
        self._thread.start()
        # A daemon thread still inside a torch op when the interpreter finalizes aborts the process ("terminate
        # called without an active exception", status 134): at exit the stream runs what is queued and ends,
        # while the interpreter is still whole (atexit runs after non-daemon threads, the CPU worker, joined).
        atexit.register(_stop_stream, weakref.ref(self))

    def stop(self, timeout: float = 30.0) -> None:
        """Run what is queued, then end the stream's thread."""
        if self._thread.is_alive():
            self._queue.put((0.0, None))
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            delay, op = self._queue.get()
            if op is None:   # stop(): everything queued before it has run
                return
            if delay:
                time.sleep(delay)
            try:
                op()
            except EmulatedHazard as e:
                self._errors.append(e)
                self.device._hazard(e)
            except Exception as e:  # noqa: BLE001 - kept and raised where CUDA would report it: at a synchronize
                self._errors.append(EmulatedHazard(f"emulated CUDA stream {self.name!r}: queued work failed: "
                                                   f"{type(e).__name__}: {e}"))

    def _put(self, op: Callable[[], None]) -> None:
        self._queue.put((self.device._delay(), op))

    def _enqueue_record(self, event: EmulatedEvent) -> None:
        event._error_mark = len(self._errors)    # errors up to here: filled when the record runs
        event._horizon = self.device.horizon_of(self)
        marker = event._done

        def record():
            event._error_mark = len(self._errors)
            marker.set()
        self._put(record)

    def _raise_errors(self, mark: int) -> None:
        if self._errors[:mark]:
            raise self._errors[0]

    def wait_event(self, event: EmulatedEvent) -> None:
        if event.query() and event._stream is None:
            return                    # never recorded: nothing to wait for
        self.device.order_after(self, event._horizon)
        done = event._done
        self._put(done.wait)          # this stream's thread blocks, not the caller

    def wait_stream(self, other) -> None:
        if isinstance(other, _ComputeStream):
            # its work so far is done (it ran on the caller's thread); what this stream is now ordered after
            self.device.order_after(self, self.device.compute_issued())
            return
        marker = EmulatedEvent()
        marker.record(other)
        self.wait_event(marker)

    def synchronize(self) -> None:
        marker = EmulatedEvent()
        marker.record(self)
        marker.synchronize()


# ------------------------------------------------------------------------------- work queued on side streams
class _QueueOnStream(TorchFunctionMode):
    """Inside ``use_stream(side)``: ``copy_`` and ``to`` are queued on the side stream instead of run."""

    def __init__(self, device: "EmulatedCuda", stream: _SideStream):
        super().__init__()
        self.device, self.stream = device, stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return self.device._queue_copy(self.stream, args[0], args[1], "copy_")
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), kwargs.get("dtype"))
            if dtype is not None and dtype != args[0].dtype:
                with torch._C.DisableTorchFunction():
                    out = torch.empty_like(args[0], dtype=dtype)
                return self.device._queue_copy(self.stream, out, args[0], f"to({dtype})")
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- the seam
class EmulatedCuda:
    """Stands in for runtime.device._TorchCuda (same methods): see the module docstring."""

    def __init__(self, seed: int | None = None, max_delay: float = DEFAULT_MAX_DELAY):
        self.device = torch.device("cpu")       # where the emulated device's tensors really live
        self.seed = seed_from_environ() if seed is None else seed
        self.max_delay = max_delay
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.compute = _ComputeStream(self)
        self._host: dict[int, weakref.ref] = {}   # storages of pinned host buffers, by data pointer
        self._prune_at = 1024
        self._pending: dict[tuple, int] = {}       # memory region -> queued copies reading or writing it
        self._submissions: dict[int, int] = {}     # graph thread -> its submissions to side streams so far
        self.hazards: list[str] = []
        self.counts = {"copies": 0, "device_casts": 0, "record_stream": 0, "streams": 0}

    # --- the _TorchCuda interface
    def new_stream(self) -> _SideStream:
        with self._lock:
            self.counts["streams"] += 1
            return _SideStream(self, f"s{self.counts['streams']}")

    def new_event(self) -> EmulatedEvent:
        return EmulatedEvent()

    def current_stream(self):
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            if isinstance(stream, _SideStream):
                with _QueueOnStream(self, stream):
                    yield
            else:
                yield
        finally:
            self._local.stream = previous
            if isinstance(stream, _SideStream) and _issues_compute_work():
                # what the graph's thread does after this submission is compute work it is not ordered after
                with self._lock:
                    thread = threading.get_ident()
                    self._submissions[thread] = self._submissions.get(thread, 0) + 1

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if not self.is_device(tensor):
            raise EmulatedHazard(f"emulated CUDA: record_stream on host memory ({_describe(tensor)}); only device "
                                 f"tensors belong to the caching allocator")
        with self._lock:
            self.counts["record_stream"] += 1

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        storage = t.untyped_storage()
        with self._lock:
            self._host[storage.data_ptr()] = weakref.ref(storage)
            if len(self._host) > self._prune_at:      # forget freed buffers (activation offload makes many)
                self._host = {k: r for k, r in self._host.items() if r() is not None}
                self._prune_at = 2 * len(self._host) + 1024
        return t

    # --- what a real tensor would tell
    def is_device(self, t: torch.Tensor) -> bool:
        ref = self._host.get(_storage_key(t))
        return ref is None or ref() is None

    def reseed(self, seed: int) -> None:
        """Draw the delays of the operations queued from now on from ``seed``: another interleaving of the same
        program (a test runs several seeds on one compiled model instead of compiling it once per seed)."""
        with self._lock:
            self.seed, self._rng = seed, random.Random(seed)

    # --- order after compute (module docstring)
    def compute_issued(self) -> dict:
        """The compute work issued so far, per graph thread: what a wait on the compute stream orders after.
        Key ``None``: every thread not named, whose work so far precedes its first submission (count 0)."""
        with self._lock:
            return {None: 0, **self._submissions}

    def horizon_of(self, stream: _SideStream) -> dict:
        with self._lock:
            return dict(stream.horizon)

    def order_after(self, stream: _SideStream, horizon: dict) -> None:
        """Work queued on ``stream`` from now on runs after the compute work ``horizon`` counts."""
        with self._lock:
            for thread, issued in horizon.items():
                stream.horizon[thread] = max(stream.horizon.get(thread, -1), issued)

    def _unordered(self, stream: _SideStream, dst: torch.Tensor, src: torch.Tensor) -> str | None:
        """Why a copy queued now on ``stream`` may run before compute work it depends on (None: it may not).
        Called with the lock held."""
        if not _issues_compute_work() or not (self.is_device(dst) or self.is_device(src)):
            return None
        thread = threading.get_ident()
        if stream.horizon.get(thread, stream.horizon.get(None, -1)) >= self._submissions.get(thread, 0):
            return None
        which = dst if self.is_device(dst) else src
        return (f"the copy was queued without waiting for the compute stream's work issued before it (no "
                f"wait_stream(compute) or wait on an event recorded after that work): on CUDA it may run before "
                f"the kernels that write or read device {_describe(which)}")

    # --- checks
    def check(self) -> None:
        """Raise the first hazard seen so far (tests call it at the end of a run)."""
        if self.hazards:
            raise EmulatedHazard(f"{len(self.hazards)} hazard(s); first: {self.hazards[0]}")

    def _hazard(self, error: EmulatedHazard) -> None:
        with self._lock:
            self.hazards.append(str(error))

    def host_wakeup(self) -> None:
        """The seeded delay of a host thread that waited for a side stream's event."""
        delay = self._delay()
        if delay:
            time.sleep(delay)

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(0.0, self.max_delay)

    def _queue_copy(self, stream: _SideStream, dst: torch.Tensor, src: torch.Tensor, op: str) -> torch.Tensor:
        """Queue ``dst.copy_(src)`` on ``stream``: snapshot the source, poison the destination, check both when
        it runs. Memory that queued work already reads or writes is neither snapshot nor poisoned: the order of
        work on one stream is CUDA's own (a source filled by an earlier cast, a destination rewritten twice)."""
        with torch._C.DisableTorchFunction():
            src_key, dst_key = _region(src), _region(dst)
            with self._lock:
                self.counts["copies"] += 1
                if op.startswith("to("):
                    self.counts["device_casts"] += 1
                src_queued = self._pending.get(src_key, 0) > 0
                dst_queued = self._pending.get(dst_key, 0) > 0
                unordered = self._unordered(stream, dst, src)
                for key in {src_key, dst_key}:
                    self._pending[key] = self._pending.get(key, 0) + 1
            snapshot = None if src_queued else src.clone()
            if not dst_queued:
                _poison(dst)
            where = f"emulated CUDA stream {stream.name!r}, op {op}"

            def copy():
                try:
                    self._run_copy(dst, src, snapshot, not dst_queued, where, unordered)
                finally:
                    with self._lock:
                        for key in {src_key, dst_key}:
                            self._pending[key] -= 1
                            if not self._pending[key]:
                                del self._pending[key]
            stream._put(copy)
        return dst

    @staticmethod
    def _run_copy(dst: torch.Tensor, src: torch.Tensor, snapshot, check_dst: bool, where: str,
                  unordered: str | None = None) -> None:
        with torch._C.DisableTorchFunction():
            if unordered is not None:
                _poison(dst)
                raise EmulatedHazard(f"{where}: {unordered}")
            if not src.untyped_storage().nbytes() or not dst.untyped_storage().nbytes():
                which = src if not src.untyped_storage().nbytes() else dst
                raise EmulatedHazard(f"{where}: {_describe(which)} was released while the copy was still queued")
            if snapshot is not None and not _same_bits(src, snapshot):
                _poison(dst)
                raise EmulatedHazard(f"{where}: source {_describe(src)} was rewritten after the copy was queued "
                                     f"and before it ran (the memory was reused while a stream still read it)")
            if check_dst and dst.is_floating_point() and dst.numel() and not bool(dst.isnan().all()):
                _poison(dst)
                raise EmulatedHazard(f"{where}: destination {_describe(dst)} was written before the copy into it "
                                     f"landed")
            dst.copy_(src)


@functools.lru_cache(maxsize=None)
def emulated_device(seed: int) -> EmulatedCuda:
    """The process's emulated device for ``seed`` (one, like torch.cuda's device: every runtime that copies to
    or from it must agree on which memory is host memory)."""
    return EmulatedCuda(seed=seed, max_delay=max_delay_from_environ())
