"""The runtime abstraction (socompile/runtime/device.py): CPU streams as single-thread executors and events as
futures; the CUDA implementation's ordering logic, checked on the CPU with a recording stand-in for torch.cuda;
and the selection logic, which must never touch torch.cuda beyond is_available() on a CPU build."""
import threading
import time

import pytest
import torch

from socompile.runtime import device as dev
from socompile.runtime.memory import DeviceLedger


def test_work_on_one_cpu_stream_runs_in_submission_order_on_its_own_thread():
    rt = dev.CPURuntime()
    seen = []
    s = rt.stream("h2d")
    events = [s.submit(lambda i=i: (time.sleep(0.002 * (3 - i)), seen.append((i, threading.current_thread().name))))
              for i in range(3)]
    events[-1].synchronize()
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(name.startswith("socompile-h2d") for _, name in seen)
    rt.shutdown()


def test_two_cpu_streams_overlap_and_wait_event_orders_across_them():
    rt = dev.CPURuntime()
    gate = threading.Event()
    a, b = rt.stream("a"), rt.stream("b")
    blocked = a.submit(gate.wait)
    ran = b.submit(lambda: "b ran")          # stream b is not stuck behind stream a's work
    ran.synchronize()
    assert ran.query() and not blocked.query()
    b.wait_event(blocked)                     # from here on, b's work waits for a's event; the caller does not
    later = b.submit(lambda: None)
    time.sleep(0.01)
    assert not later.query()
    gate.set()
    later.synchronize()
    assert blocked.query()
    rt.shutdown()


def test_cpu_copy_async_is_a_real_copy_into_a_separate_buffer_and_casts():
    rt = dev.CPURuntime()
    src = torch.randn(1000)
    dst = rt.empty(1000, torch.bfloat16)
    assert dst.data_ptr() != src.data_ptr()
    rt.wait_on_compute(rt.copy_async(dst, src, rt.stream("h2d")))
    torch.testing.assert_close(dst, src.to(torch.bfloat16), atol=0, rtol=0)
    rt.shutdown()


def test_an_error_in_stream_work_is_raised_by_synchronize():
    rt = dev.CPURuntime()
    event = rt.stream("x").submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        event.synchronize()
    rt.shutdown()


class _Recorder:
    """Stands in for runtime.device._TorchCuda: records what the CUDA runtime asks torch.cuda to do."""

    def __init__(self):
        self.calls = []

    class _Stream:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def wait_event(self, event):
            self.log.append(("wait_event", self.name, event.name))

        def wait_stream(self, other):
            self.log.append(("wait_stream", self.name, other.name))

        def synchronize(self):
            raise AssertionError("a host thread must never synchronize a whole stream")

    class _Event:
        count = 0

        def __init__(self, log):
            _Recorder._Event.count += 1
            self.log, self.name = log, f"e{_Recorder._Event.count}"

        def record(self, stream):
            self.log.append(("record", self.name, stream.name))

        def query(self):
            return True

        def synchronize(self):
            self.log.append(("event_synchronize", self.name))

    def new_stream(self):
        self.calls.append(("new_stream",))
        return self._Stream(self.calls, f"s{sum(c[0] == 'new_stream' for c in self.calls)}")

    def new_event(self):
        return self._Event(self.calls)

    def current_stream(self):
        return self._Stream(self.calls, "compute")

    def use_stream(self, stream):
        import contextlib
        self.calls.append(("use_stream", stream.name))
        return contextlib.nullcontext()

    def record_stream(self, tensor, stream):
        self.calls.append(("record_stream", stream.name))

    def is_device(self, tensor):
        return tensor.device.type == "cuda"     # never here: the recorder keeps every tensor on the CPU

    def empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def pinned(self, numel, dtype):
        self.calls.append(("pinned", numel))
        return torch.empty(numel, dtype=dtype)


def test_cuda_copy_is_non_blocking_on_the_side_stream_after_the_compute_stream_and_records_an_event():
    api = _Recorder()
    rt = dev.CUDARuntime("cuda", api=api)
    s = rt.stream("h2d")
    src, dst = torch.randn(8), torch.empty(8)
    copies = []
    original = torch.Tensor.copy_

    def spy(self, other, non_blocking=False):
        copies.append(non_blocking)
        return original(self, other)
    torch.Tensor.copy_ = spy
    try:
        event = rt.copy_async(dst, src, s)
    finally:
        torch.Tensor.copy_ = original
    assert copies == [True]
    kinds = [c[0] for c in api.calls]
    # the side stream first waits for the compute stream, then the copy runs on it and an event is recorded there
    assert kinds.index("wait_stream") < kinds.index("use_stream") < kinds.index("record")
    assert ("record", event.event.name, s.stream.name) in api.calls
    rt.wait_on_compute(event)                       # the compute stream waits on the event: no host block
    assert api.calls[-1] == ("wait_event", "compute", event.event.name)
    event.synchronize()                             # a host worker waits on this event only
    assert api.calls[-1] == ("event_synchronize", event.event.name)
    assert rt.host_buffer(4, torch.float32).numel() == 4 and ("pinned", 4) in api.calls


def test_two_threads_asking_for_a_cuda_stream_at_once_get_the_same_one():
    # The training thread and the CPU worker both ask for "h2d"; a slow stream creation (as a real one can be)
    # lets both see it missing: without the registry's lock each made its own, and an event recorded on one
    # ordered nothing on the other.
    api = _Recorder()
    made = api.new_stream

    def slow_new_stream():
        time.sleep(0.05)
        return made()
    api.new_stream = slow_new_stream
    rt = dev.CUDARuntime("cuda", api=api)
    got = []
    threads = [threading.Thread(target=lambda: got.append(rt.stream("h2d"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(got) == 2 and got[0] is got[1]
    assert sum(c[0] == "new_stream" for c in api.calls) == 1


def test_selection_picks_cpu_without_cuda_and_explains_a_cuda_request(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("Stream", "Event", "current_stream", "stream"):   # any of these on a CPU build would raise
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("touched")))
    rt = dev.device_runtime("auto")
    assert isinstance(rt, dev.CPURuntime)
    rt.wait_on_compute(rt.copy_async(rt.empty(4, torch.float32), torch.ones(4), rt.stream("h2d")))
    with pytest.raises(RuntimeError, match="no usable CUDA"):
        dev.device_runtime("cuda")
    with pytest.raises(ValueError, match="'cpu', 'cuda"):
        dev.device_runtime("meta")
    rt.shutdown()


def test_selection_picks_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dev, "CUDARuntime", lambda name: ("cuda runtime", name))
    assert dev.device_runtime("auto") == ("cuda runtime", "cuda")


def test_ledger_counts_current_peak_breakdown_and_per_phase():
    ledger = DeviceLedger()
    ledger.alloc("stationary weights", 0, 100)
    ledger.set_phase("forward")
    ledger.alloc("weight-flow buffers", ("fw", 1), 50)
    ledger.alloc("weight-flow buffers", ("fw", 2), 30)
    ledger.free("weight-flow buffers", ("fw", 1))
    ledger.set_phase("backward")
    ledger.alloc("weight-flow buffers", ("bw", 2), 30)
    s = ledger.summary()
    assert s["current"] == 160 and s["peak"] == 180
    assert s["peak_parts"] == {"stationary weights": 100, "weight-flow buffers": 80}
    assert s["phase_peak"] == {"setup": 100, "forward": 180, "backward": 160}
    with pytest.raises(RuntimeError, match="released but not held"):
        ledger.free("weight-flow buffers", ("fw", 1))
    with pytest.raises(RuntimeError, match="booked twice"):
        ledger.alloc("weight-flow buffers", ("bw", 2), 30)


def test_an_optimizer_owns_one_runtime_per_device_shared_by_its_buckets():
    """The runtime cache has an owner (socompile.AdamW), not the process: one optimizer's buckets on a device
    share one runtime (its streams are made once), another optimizer has its own."""
    import socompile
    from torch import nn

    def params():
        return [nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(3)]
    first = socompile.AdamW(params(), bucket_size=256, host_master="separate")
    second = socompile.AdamW(params(), bucket_size=256, host_master="separate")
    runtimes = {id(b.runtime) for b in first.store.pool()}
    assert len(first.store.pool()) > 1 and len(runtimes) == 1 and None not in {b.runtime for b in first.store.pool()}
    assert first.store.pool()[0].runtime is first.runtimes.get("cpu", first.runtime_kind)
    assert second.store.pool()[0].runtime is not first.store.pool()[0].runtime
    assert isinstance(first.store.pool()[0].runtime, dev.CPURuntime)
