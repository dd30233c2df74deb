"""The emulated CUDA device (runtime/emulated_cuda.py): the CUDA runtime's own code (runtime/device.py
CUDARuntime) with real asynchrony on the CPU, its selection (option ``runtime``, SOCOMPILE_RUNTIME), and the
risks it was built to expose (docs/runtime.md, "What it found") (each test names its risk).

Delays: every queued operation waits 0..max_delay seconds. Tests that need a copy to be still in flight give the
device a long delay (``slow``: 50 ms, far above the microseconds a host call takes between queuing and checking)."""
import threading
import time

import pytest
import os

import torch

import socompile
from socompile.options import OptionError, Options
from socompile.runtime import device as dev
from socompile.runtime.emulated_cuda import EmulatedCuda, EmulatedHazard


def runtime(seed=0, max_delay=0.003):
    api = EmulatedCuda(seed=seed, max_delay=max_delay)
    return dev.CUDARuntime("cpu", api=api), api


def slow():
    """A device whose queued operations wait exactly 50 ms (the generator's range pinned to one value)."""
    rt, api = runtime(max_delay=0.0)
    api._delay = lambda: 0.05
    return rt, api


# ------------------------------------------------------------------------------------------ the device
def test_a_copy_lands_late_and_the_compute_stream_waits_for_it():
    rt, api = slow()
    src = rt.host_buffer(1000, torch.float32)
    src.copy_(torch.arange(1000.0))
    dst = rt.empty(1000, torch.float32)
    done = rt.copy_async(dst, src, rt.stream("h2d"))
    assert not done.query()                      # queued, not run: the host was not blocked
    assert dst.isnan().all()                     # read before it landed: poisoned, not silently stale
    rt.wait_on_compute(done)                     # the compute stream (this thread) waits for the event
    assert done.query() and torch.equal(dst, torch.arange(1000.0))


def test_side_streams_overlap_and_wait_event_orders_across_them_without_blocking_the_caller():
    rt, api = slow()
    a, b = rt.stream("a"), rt.stream("b")
    x = rt.empty(10, torch.float32)
    host = rt.host_buffer(10, torch.float32)
    host.fill_(3.0)
    first = rt.copy_async(x, host, a)            # a: host -> x
    b.wait_event(first)                          # b's later work waits for a's copy; the caller does not
    out = rt.host_buffer(10, torch.float32)
    start = time.perf_counter()
    second = rt.copy_async(out, x, b)            # b: x -> out, must see the 3s
    assert time.perf_counter() - start < 0.04 and not second.query()
    second.synchronize()
    assert first.query() and torch.equal(out, torch.full((10,), 3.0))


def test_an_event_never_recorded_is_complete_and_waiting_on_it_is_a_no_op():
    rt, api = runtime()
    event = api.new_event()
    assert event.query()
    api.new_stream().wait_event(event)
    event.synchronize()


def test_the_worker_threads_current_stream_is_the_default_compute_stream_as_on_cuda():
    # Risk 2 (part): uploads issued from the optimizer's worker thread call current_stream() there. On CUDA
    # (legacy default stream) that is the device's default stream, the one the graph runs on, unless the
    # thread entered a stream context; the emulated device models exactly that.
    rt, api = runtime()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(api.current_stream()))
    worker.start()
    worker.join()
    assert seen == [api.compute] and api.current_stream() is api.compute
    side = api.new_stream()
    with api.use_stream(side):
        assert api.current_stream() is side
    assert api.current_stream() is api.compute


def test_device_memory_is_told_from_pinned_host_memory_so_record_stream_and_device_casts_run():
    # Risk 3: the recorder kept every tensor on the CPU, so these branches of copy_many_async never ran.
    rt, api = runtime()
    grads = [torch.randn(64).to(torch.bfloat16), torch.randn(32).to(torch.bfloat16)]   # device (graph output)
    host = rt.host_buffer(96, torch.float32)
    assert api.is_device(grads[0]) and not api.is_device(host) and not api.is_device(host[10:20])
    done = rt.copy_many_async([(host[:64], grads[0]), (host[64:], grads[1])], rt.stream("d2h"))
    done.synchronize()
    assert api.counts["device_casts"] == 2            # the bf16 -> fp32 conversion ran on the side stream
    assert api.counts["record_stream"] >= 2           # the device tensors were recorded on the side stream
    torch.testing.assert_close(host, torch.cat([g.float() for g in grads]), atol=0, rtol=0)
    with pytest.raises(EmulatedHazard, match="host memory"):
        api.record_stream(host, api.new_stream())


def test_a_source_rewritten_before_its_copy_ran_is_a_hazard_naming_stream_tensor_and_op():
    rt, api = slow()
    grad = torch.ones(256)                            # device memory (a gradient the graph produced)
    host = rt.host_buffer(256, torch.float32)
    done = rt.copy_async(host, grad, rt.stream("d2h"))
    grad.fill_(7.0)                                   # the graph reuses the buffer before the copy ran
    with pytest.raises(EmulatedHazard, match=r"stream 's\d+', op copy_: source tensor\(256,\) float32 .* rewritten"):
        done.synchronize()
    assert host.isnan().all()                         # the copy's result is poisoned too
    assert len(api.hazards) == 1
    with pytest.raises(EmulatedHazard, match="1 hazard"):
        api.check()


def _release(dst):     # e.g. a flow bucket's weights freed too early
    dst.untyped_storage().resize_(0)


def _overwrite(dst):   # the compute stream wrote it without waiting
    dst.zero_()


@pytest.mark.parametrize("misuse, message", [
    (_release, "released while the copy was still queued"),
    (_overwrite, "written before the copy into it landed"),
], ids=["memory-released-while-the-copy-is-queued", "destination-written-before-the-copy-landed"])
def test_a_copy_destination_touched_before_the_copy_landed_is_a_hazard(misuse, message):
    rt, api = slow()
    dst = rt.empty(128, torch.float32)
    host = rt.host_buffer(128, torch.float32)
    done = rt.copy_async(dst, host, rt.stream("h2d"))
    misuse(dst)
    with pytest.raises(EmulatedHazard, match=message):
        done.synchronize()


def _copy_without_waiting_for_compute(rt, dst, src, stream):
    """What copy_async queues, less its wait_stream(compute)."""
    return stream.submit(lambda: dst.copy_(src, non_blocking=True))


def test_a_copy_not_ordered_after_the_graphs_compute_work_is_a_hazard_naming_the_missing_wait():
    # Risk: the emulated compute stream has always finished by the time a side stream is handed work, so a
    # side stream that does not wait for it (a gradient or an activation copied before the kernel that writes
    # it ran, on CUDA) would copy the right bytes here. The device counts the order instead.
    rt, api = runtime()
    grad = torch.ones(64)                             # device memory the graph just wrote
    host = rt.host_buffer(64, torch.float32)
    done = _copy_without_waiting_for_compute(rt, host, grad, rt.stream("d2h"))
    with pytest.raises(EmulatedHazard, match=r"stream 's\d+', op copy_: the copy was queued without waiting "
                                             r"for the compute stream's work .* tensor\(64,\) float32"):
        done.synchronize()
    assert host.isnan().all()                         # its result is poisoned, not silently right


def test_an_order_after_compute_holds_through_an_event_of_another_stream_until_the_graph_issues_more_work():
    rt, api = runtime()
    a, b = rt.stream("a"), rt.stream("b")
    grad, host = torch.ones(64), rt.host_buffer(64, torch.float32)
    a.stream.wait_stream(api.current_stream())        # a is ordered after the graph's work so far
    marker = api.new_event()
    marker.record(a.stream)                           # after that wait
    b.wait_event(dev.CUDAEvent(marker))               # b is ordered after it: fine without its own wait
    _copy_without_waiting_for_compute(rt, host, grad, b).synchronize()
    # that submission handed the graph's work on: b is not ordered after what the graph does next
    done = _copy_without_waiting_for_compute(rt, host, grad, b)
    with pytest.raises(EmulatedHazard, match="without waiting for the compute stream"):
        done.synchronize()
    api.hazards.clear()
    host_only = rt.host_buffer(64, torch.float32)     # host to host: no device memory, nothing to order
    _copy_without_waiting_for_compute(rt, host_only, host, rt.stream("c")).synchronize()
    assert not api.hazards


def test_copies_queued_by_the_runtimes_own_threads_are_ordered_by_their_events_not_checked():
    # The CPU optimizer worker runs no graph: its uploads are ordered by the gradient events they wait for
    # (and by copy_async's wait); the device does not know which compute work touched their memory.
    rt, api = runtime()
    weights, master = torch.zeros(64), rt.host_buffer(64, torch.float32)
    master.fill_(2.0)
    result = []
    worker = threading.Thread(name="socompile-cpu-optimizer_0", target=lambda: result.append(
        _copy_without_waiting_for_compute(rt, weights, master, rt.stream("h2d"))))
    worker.start()
    worker.join()
    result[0].synchronize()
    assert not api.hazards and torch.equal(weights, torch.full((64,), 2.0))


def test_the_delays_are_seeded():
    draws = [[EmulatedCuda(seed=s)._delay() for _ in range(5)] for s in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2]
    assert all(0.0 <= d <= 0.003 for d in draws[0])


def test_the_cuda_wait_test_now_fails_when_a_host_wait_blocks_on_other_work():
    # Risk 4: test_runtime_cuda.py's host-wait test joined with a 30 s timeout against ~1 s of other work, so
    # it passed even when the waiter waited for that work. It now asserts the other work is still running
    # when the waiter is done; the same assertion here, where a stream synchronize stands in for the bug.
    rt, api = runtime(max_delay=0.0)
    other = rt.stream("other")
    gate = threading.Event()
    other.stream._put(gate.wait)                      # long work on another stream
    busy = api.new_event()
    busy.record(other.stream)
    src = torch.full((64,), 3.0)
    dst = rt.host_buffer(64, torch.float32)
    done = rt.copy_async(dst, src, rt.stream("d2h"))
    done.synchronize()                                # the event of this copy only
    assert not busy.query() and dst.sum().item() == 3.0 * 64
    gate.set()
    waited_for_everything = threading.Thread(target=other.stream.synchronize)
    waited_for_everything.start()
    waited_for_everything.join(timeout=5)
    assert busy.query()


# ------------------------------------------------------------------------------------------ selection
def test_runtime_option_and_environment_select_the_emulated_device(monkeypatch):
    monkeypatch.delenv("SOCOMPILE_RUNTIME", raising=False)
    assert dev.resolve_runtime("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dev.resolve_runtime("emulated") == "emulated"
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    assert dev.resolve_runtime("auto") == "emulated" and dev.resolve_runtime("cpu") == "cpu"
    assert Options.resolve({}).runtime == "emulated"
    rt = dev.device_runtime("cpu", "emulated")
    assert isinstance(rt, dev.CUDARuntime) and isinstance(rt.api, EmulatedCuda) and rt.kind == "cuda"
    assert dev.Runtimes().get("cpu").api is rt.api      # one device: every runtime agrees on host memory


def test_an_unknown_runtime_names_the_choices(monkeypatch):
    with pytest.raises(OptionError, match="'auto', 'cpu', 'cuda' or 'emulated'"):
        Options.resolve({"runtime": "gpu"})
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "gpu")
    with pytest.raises(ValueError, match="'auto', 'cpu', 'cuda', 'emulated'"):
        dev.resolve_runtime()
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", "x")
    with pytest.raises(ValueError, match="SOCOMPILE_EMULATION_SEED must be an integer"):
        dev.resolve_runtime() and dev.device_runtime("cpu")


def test_asking_for_cuda_without_a_gpu_names_the_emulated_runtime(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable CUDA.*'emulated'"):
        dev.resolve_runtime("cuda")


def test_doctor_names_the_runtime_a_compile_would_use(monkeypatch):
    from socompile.doctor import report
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    assert "runtime: emulated" in report()
    monkeypatch.delenv("SOCOMPILE_RUNTIME")
    assert f"runtime: {'cuda' if torch.cuda.is_available() else 'cpu'}" in report()


def test_an_optimizer_built_for_another_runtime_than_the_option_is_an_option_error(monkeypatch):
    monkeypatch.delenv("SOCOMPILE_RUNTIME", raising=False)
    model = torch.nn.Linear(8, 8)
    opt = socompile.AdamW(model.parameters())
    assert opt.runtime_kind == "cpu" and opt.host_master == "shared"
    cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", runtime="emulated"))
    with pytest.raises(Exception, match="SOCOMPILE_RUNTIME=emulated before building the optimizer"):
        cmodel(torch.randn(2, 8)).sum().backward()
    del opt


def test_under_the_emulated_runtime_a_cpu_model_gets_the_cuda_treatment(monkeypatch):
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    model = torch.nn.Linear(8, 8)
    opt = socompile.AdamW(model.parameters())
    assert opt.host_master == "separate" and opt.cpu_worker == "thread"
    bucket = opt.buckets[0]
    assert bucket.async_host_copies() and not bucket.runtime.api.is_device(bucket.master)
    assert bucket.runtime.api.is_device(bucket.weights)


def test_freed_host_buffers_are_forgotten_and_their_memory_may_become_device_memory():
    rt, api = runtime()
    for _ in range(3000):
        rt.host_buffer(16, torch.float32)         # freed at once
    assert len(api._host) < 2100
    kept = rt.host_buffer(16, torch.float32)
    assert not api.is_device(kept)


@pytest.mark.parametrize("runtime", ["emulated", "cpu"])
def test_a_plain_training_script_under_the_emulated_device_exits_cleanly(tmp_path, runtime):
    """The runtime's threads (the CPU worker, the emulated streams) end with the process: a script that trains
    a bf16 model for 4 steps, then leaves a backward's CPU jobs in flight (no step()), exits with status 0 and
    no "terminate called without an active exception" (a thread still joinable at exit aborts, status 134)."""
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, socompile\n"
        "from socompile.models import build\n"
        "torch.manual_seed(0)\n"
        "model = build('tiny', n_layers=1).to(torch.bfloat16)\n"
        "opt = socompile.AdamW(model.parameters(), lr=1e-3)\n"
        "cm = torch.compile(model, backend='superoffload', options={'gpu_buckets': 0, 'bucket_size': '64KB'})\n"
        "x = torch.randint(0, 256, (2, 16))\n"
        "for _ in range(4):\n"
        "    cm(x).float().mean().backward()\n"
        "    opt.step(); opt.zero_grad()\n"
        "cm(x).float().mean().backward()\n"
        "print('trained')\n")
    env = {**os.environ, "SOCOMPILE_RUNTIME": runtime, "SOCOMPILE_COMPUTE": "eager"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout and "terminate called" not in done.stderr
