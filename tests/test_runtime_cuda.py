"""The CUDA runtime on a real GPU (skipped without one; bench/gpu_check.sh runs these). Written without a GPU
at hand: the same logic is tested on the CPU in test_runtime_device.py with a stand-in for torch.cuda."""
import threading

import pytest
import torch

from socompile.runtime import device as dev

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_selection_picks_cuda_and_host_buffers_are_pinned():
    rt = dev.device_runtime("auto")
    assert isinstance(rt, dev.CUDARuntime)
    assert rt.host_buffer(1024, torch.float32).is_pinned()
    assert rt.empty(1024, torch.bfloat16).is_cuda


def test_a_delayed_copy_on_the_side_stream_is_waited_for_by_the_compute_stream_without_host_sync():
    rt = dev.CUDARuntime("cuda")
    h2d = rt.stream("h2d")
    src = rt.host_buffer(1 << 20, torch.float32)
    src.copy_(torch.arange(1 << 20, dtype=torch.float32))
    dst = rt.empty(1 << 20, torch.float32)
    dst.zero_()
    h2d.submit(lambda: torch.cuda._sleep(50_000_000))        # the copy starts late (~tens of ms)
    done = rt.copy_async(dst, src, h2d)
    assert not done.query()                                   # the host was not blocked
    rt.wait_on_compute(done)
    total = dst.sum()                                         # queued on the compute stream after the wait
    assert total.item() == float(sum(range(1 << 20)))


def test_a_host_thread_waits_on_the_event_of_its_copy_only():
    rt = dev.CUDARuntime("cuda")
    d2h = rt.stream("d2h")
    other = rt.stream("other")
    busy = other.submit(lambda: torch.cuda._sleep(2_000_000_000))   # ~1 s of work elsewhere (2e9 cycles)
    src = torch.full((4096,), 3.0, device="cuda")
    dst = rt.host_buffer(4096, torch.float32)
    done = rt.copy_async(dst, src, d2h)
    seen = []
    worker = threading.Thread(target=lambda: (done.synchronize(), seen.append(dst.sum().item())))
    worker.start()
    worker.join(timeout=30)
    assert seen == [3.0 * 4096]
    # The waiter finished while the other stream still ran: it waited for its event only. (Joining alone could
    # not fail: a waiter blocked by the ~1 s of other work also finishes well within the 30 s timeout.)
    assert not busy.query()
    torch.cuda.synchronize()


def test_flow_fetch_into_device_memory_is_booked_and_exact():
    from socompile.plan.plan import BucketPlan, Plan
    from socompile.runtime.flat_bucket import FlatBucket
    from socompile.runtime.offload import OffloadRuntime
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(7))]
    bucket = FlatBucket(0, params)
    plan = Plan(target="test", bucket_size=1, unoptimized_params=(), predicted=(("param_dtype_bytes", 4),),
                buckets=(BucketPlan(index=0, params=("a", "b"), numel=64 * 32 + 7, grad_bytes=0,
                                    optimizer_site="cpu", ready_after="bw:x", ready_position=0,
                                    weight_mode="flow", prefetch_distance=1, param_link_dtype="bfloat16"),))
    rt = OffloadRuntime(plan, [bucket], dev.CUDARuntime("cuda"))
    rt.prefetch("fw", 0)
    flat = rt.wait("fw", 0)
    assert flat.is_cuda and flat.dtype == torch.bfloat16
    assert rt.ledger.current == flat.numel() * 2
    torch.testing.assert_close(flat.float().cpu(), bucket.master.to(torch.bfloat16).float(), atol=0, rtol=0)
    rt.release("fw", 0)
    assert rt.ledger.current == 0


def test_fused_adamw_on_the_gpu_matches_the_socompile_kernel():
    from socompile.runtime.cpu_adam import step_bucket
    from socompile.runtime.device_adam import fused_step
    from socompile.runtime.flat_bucket import FlatBucket
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 17))]
    cpu = FlatBucket(0, params)
    cpu.group_of = [0]
    gpu = FlatBucket.__new__(FlatBucket)
    gpu.__dict__.update({k: v for k, v in cpu.__dict__.items()})
    for name in ("master", "grad", "exp_avg", "exp_avg_sq"):
        setattr(gpu, name, getattr(cpu, name).clone().cuda())
    groups = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled=True)]
    for _ in range(3):
        g = torch.randn(cpu.sizes[0])
        cpu.grad[:cpu.sizes[0]].copy_(g)
        gpu.grad[:cpu.sizes[0]].copy_(g)
        cpu.has_grad = gpu.has_grad = [True]
        step_bucket(cpu, groups)
        fused_step(gpu, groups)
        cpu.steps = gpu.steps = [cpu.steps[0] + 1]
    torch.testing.assert_close(gpu.master.cpu(), cpu.master, atol=1e-5, rtol=0)
