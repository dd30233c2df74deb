"""Streams, events, host buffers and asynchronous copies, on CUDA and on a CPU-only build, behind one interface.

    rt = device_runtime("auto")             # CUDA when torch has it, else the CPU stand-in
    h2d = rt.stream("h2d")
    dst = rt.empty(n, torch.float32)        # "device" memory (on the CPU build: a separate host buffer)
    done = rt.copy_async(dst, src, h2d)     # returns an Event
    rt.wait_on_compute(done)                # the compute stream waits for the copy (no host block on CUDA)
    done.synchronize()                      # a host thread (e.g. the CPU optimizer worker) waits for this event only

CUDA: ``torch.cuda.Stream``/``Event``, pinned host buffers, ``non_blocking`` copies, and ``record_stream`` on every
device tensor a side stream touches, so the caching allocator does not hand its memory to another tensor
before that stream is done with it. A host thread waits on a CUDA *event* (``cudaEventSynchronize``), never on a
whole stream, so it is blocked only by the work it depends on.

CPU: each stream is a single-thread executor (work on one stream runs in submission order, streams run
concurrently); an event is a future. ``wait_on_compute`` blocks the caller, because on the CPU build the caller's
thread is the compute stream.

NOTE: torch.cuda on a CPU build. ``torch.cuda.Stream()``, ``pin_memory()``, ``record_stream`` and
``torch.Event("cpu").record()`` raise on a CPU build; only ``torch.cuda.is_available()`` and ``device_count()``
are safe. Every other torch.cuda call lives in ``_TorchCuda``, built only after ``is_available()`` said yes, so
the CUDA runtime's own logic is tested on the CPU with a stand-in for that class (tests/test_runtime_device.py).
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable

import torch


class Event:
    """Completion of work queued on a stream. ``query()`` never blocks; ``synchronize()`` blocks the calling
    host thread until this event (and only it) has completed."""

    def query(self) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


class Stream:
    name: str

    def submit(self, fn: Callable[[], object]) -> Event:
        """Queue ``fn`` on this stream (after everything queued before it) and return its completion event."""
        raise NotImplementedError

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on starts only after ``event``; the caller does not block."""
        raise NotImplementedError


class DeviceRuntime:
    kind: str                 # "cpu" or "cuda"
    device: torch.device

    def stream(self, name: str) -> Stream:
        raise NotImplementedError

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor in device memory."""
        raise NotImplementedError

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host tensor that asynchronous copies may read or write (pinned on CUDA)."""
        raise NotImplementedError

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """``dst.copy_(src)`` (converting the dtype if they differ) on ``stream``; returns its event."""
        raise NotImplementedError

    def copy_many_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> Event:
        """Every ``dst.copy_(src)`` of ``pairs`` on ``stream``, in order, with one event for all of them."""
        raise NotImplementedError

    def wait_on_compute(self, event: Event) -> None:
        """Make the compute stream (the one running the compiled graph) wait for ``event``."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- CPU
class CPUEvent(Event):
    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()     # re-raises the work's exception in the waiting thread


class CPUStream(Stream):
    """One worker thread: work runs in submission order; different streams overlap."""

    def __init__(self, name: str):
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"socompile-{name}")

    def submit(self, fn: Callable[[], object]) -> CPUEvent:
        return CPUEvent(self._pool.submit(fn))

    def wait_event(self, event: Event) -> None:
        self._pool.submit(event.synchronize)   # the stream's thread blocks, not the caller

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class CPURuntime(DeviceRuntime):
    """The "device" is the CPU: device tensors are separate host buffers, copies are real copies."""

    kind = "cpu"

    def __init__(self):
        self.device = torch.device("cpu")
        self._streams: dict[str, CPUStream] = {}
        self._lock = threading.Lock()

    def stream(self, name: str) -> CPUStream:
        with self._lock:
            if name not in self._streams:
                self._streams[name] = CPUStream(name)
            return self._streams[name]

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        return stream.submit(lambda: dst.copy_(src))

    def copy_many_async(self, pairs, stream: Stream) -> Event:
        pairs = list(pairs)
        return stream.submit(lambda: [dst.copy_(src) for dst, src in pairs])

    def wait_on_compute(self, event: Event) -> None:
        event.synchronize()      # the calling thread *is* the compute stream here

    def shutdown(self) -> None:
        for s in self._streams.values():
            s.shutdown()


# --------------------------------------------------------------------------------------------------- CUDA
class _TorchCuda:
    """The only place that calls torch.cuda beyond is_available(); constructed only when CUDA is available."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def new_event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def is_device(self, tensor: torch.Tensor) -> bool:
        """In device memory (the emulated device, runtime/emulated_cuda.py, tells its own memory apart)."""
        return tensor.device.type == "cuda"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)


class CUDAEvent(Event):
    def __init__(self, event):
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()      # cudaEventSynchronize: this event only, never a whole stream


class CUDAStream(Stream):
    def __init__(self, name: str, api: _TorchCuda):
        self.name = name
        self.api = api
        self.stream = api.new_stream()

    def submit(self, fn: Callable[[], object]) -> CUDAEvent:
        with self.api.use_stream(self.stream):
            fn()
            event = self.api.new_event()
            event.record(self.stream)
        return CUDAEvent(event)

    def wait_event(self, event: Event) -> None:
        self.stream.wait_event(event.event)


class CUDARuntime(DeviceRuntime):
    kind = "cuda"

    def __init__(self, device: torch.device | str = "cuda", api: _TorchCuda | None = None):
        self.device = torch.device(device)
        self.api = api if api is not None else _TorchCuda(self.device)
        self._streams: dict[str, CUDAStream] = {}
        # The training thread and the CPU worker both ask for streams (an upload from the worker, a fetch from
        # the graph): two threads creating "h2d" at once would each get their own, and events recorded on
        # one would order nothing on the other.
        self._lock = threading.Lock()

    def stream(self, name: str) -> CUDAStream:
        with self._lock:
            if name not in self._streams:
                self._streams[name] = CUDAStream(name, self.api)
            return self._streams[name]

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.api.empty(numel, dtype)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.api.pinned(numel, dtype)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: CUDAStream) -> CUDAEvent:
        # The side stream must first see everything the compute stream did to these tensors (e.g. the step
        # that wrote the weights, or the allocation of dst).
        stream.stream.wait_stream(self.api.current_stream())

        def copy():
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if self.api.is_device(t):
                    # Allocated on the compute stream, used on this one: the allocator must not reuse it
                    # before this stream's copy has finished.
                    self.api.record_stream(t, stream.stream)
        return stream.submit(copy)

    def copy_many_async(self, pairs, stream: CUDAStream) -> CUDAEvent:
        """One wait for the compute stream, the copies, one event. A device source of another dtype than its
        host destination is converted on the device first (on the side stream), so what crosses is always the
        destination's dtype. The gradient D2H path needs no conversion: the host landing buffer has the plan's
        link dtype, the dtype the backward graph hands over (passes/cast_gradients.py)."""
        pairs = list(pairs)
        stream.stream.wait_stream(self.api.current_stream())   # once, for all the pairs

        def copies():
            for dst, src in pairs:
                if self.api.is_device(src) and not self.api.is_device(dst) and src.dtype != dst.dtype:
                    src_on_device, src = src, src.to(dst.dtype)
                    self.api.record_stream(src_on_device, stream.stream)
                dst.copy_(src, non_blocking=True)
                for t in (dst, src):
                    if self.api.is_device(t):
                        self.api.record_stream(t, stream.stream)
        return stream.submit(copies)

    def wait_on_compute(self, event: CUDAEvent) -> None:
        self.api.current_stream().wait_event(event.event)


RUNTIMES = ("auto", "cpu", "cuda", "emulated")
RUNTIME_ENV = "SOCOMPILE_RUNTIME"


def check_runtime_choice(choice: str) -> str:
    if choice not in RUNTIMES:
        raise ValueError(f"socompile runtime must be one of {', '.join(map(repr, RUNTIMES))} ('emulated': the "
                         f"CUDA runtime on an emulated asynchronous device, docs/runtime.md), got {choice!r}")
    return choice


def resolve_runtime(choice: str = "auto", environ=None) -> str:
    """The runtime a compile uses: "cpu", "cuda" or "emulated". ``choice`` (option ``runtime``) wins; "auto"
    takes ``SOCOMPILE_RUNTIME``, else CUDA when this torch has a usable GPU, else the CPU."""
    import os
    check_runtime_choice(choice)
    if choice == "auto":
        choice = check_runtime_choice((os.environ if environ is None else environ).get(RUNTIME_ENV) or "auto")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"socompile: runtime 'cuda' asked for, but this torch has no usable CUDA (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda}); use 'emulated' to run the CUDA "
                           f"path on this CPU, or 'auto'")
    return choice


def _emulated_runtime() -> DeviceRuntime:
    """The CUDA runtime over the emulated device of ``SOCOMPILE_EMULATION_SEED``: its logic as on a GPU, its
    seam swapped; the model's CPU tensors are the device's memory."""
    from .emulated_cuda import emulated_device, seed_from_environ
    return CUDARuntime("cpu", api=emulated_device(seed_from_environ()))


class Runtimes:
    """One runtime per device, made on first use, for an owner that holds this object (socompile.AdamW: its
    buckets on one device share the runtime, so its "h2d" and "d2h" streams are created once, not per
    bucket)."""

    def __init__(self):
        self._by_device: dict[str, DeviceRuntime] = {}
        self._lock = threading.Lock()

    def get(self, device: str | torch.device, runtime: str = "auto") -> DeviceRuntime:
        """The runtime of ``device`` under ``runtime`` (option/env choice, ``resolve_runtime``)."""
        key = (str(torch.device(device)) if str(device) != "auto" else "auto", runtime)
        with self._lock:
            if key not in self._by_device:
                self._by_device[key] = device_runtime(*key)
            return self._by_device[key]


def device_runtime(device: str | torch.device = "auto", runtime: str = "auto") -> DeviceRuntime:
    """The runtime for ``device``: "auto" picks CUDA when this torch has a usable GPU, else the CPU stand-in;
    a CPU device under the emulated runtime (``resolve_runtime``) gets the emulated CUDA device."""
    name = str(device)
    if name in ("auto", "cpu") and runtime != "cpu" and resolve_runtime(runtime) == "emulated":
        return _emulated_runtime()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(name).type
    if kind == "cpu":
        return CPURuntime()
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"socompile: device {name!r} asked for, but this torch has no usable CUDA "
                               f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use 'cpu' or 'auto'")
        return CUDARuntime(name)
    raise ValueError(f"socompile runtime supports 'cpu', 'cuda[:N]' or 'auto', got {name!r}")
