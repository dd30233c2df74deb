"""Measure this machine and write a hardware profile (``python -m socompile calibrate``).

What is measured, and how:
- host memory bandwidth: STREAM-style copy of a buffer much larger than the caches, counted as read + write;
- CPU Adam: ``socompile_ext.adam_step`` on fp32 p/g/m/v when the extension is built, else torch's AdamW
  (fused if available, else foreach), reported as the bytes/s it streams at 28 B/param;
- copy rates "host->device" and "device->host": on a CUDA machine, pinned-memory copies; without a GPU the
  "device" is this CPU (DESIGN section 5), so a copy between two host buffers.
Device FLOP/s is measured as a bf16 and an fp32 matmul on the device (on a CPU this is slow and is what the
plan gets; fp32 models compute at the fp32 rate, a third of bf16 on this AVX512-BF16 CPU).
"""
from __future__ import annotations

import os
import time

from .profiles import ADAM_BYTES_FP32_GRAD, GB, THIS_MACHINE, HardwareProfile


def _best_of(fn, repeats: int, clock=time.perf_counter) -> float:
    """Fastest of ``repeats`` runs on ``clock`` (time.process_time: CPU seconds, for single-threaded
    measurements on a machine that other processes share)."""
    fn()  # warm up: page faults and thread start-up are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def measure_copy_bandwidth(nbytes: int, repeats: int = 3, src_device: str = "cpu", dst_device: str = "cpu",
                           clock=time.perf_counter) -> float:
    """Bytes/s of ``dst.copy_(src)``; host-to-host counts read + write, cross-device counts the bytes moved."""
    import torch
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=src_device)
    dst = torch.empty_like(src, device=dst_device)
    if src_device == "cpu" and dst_device != "cpu":
        src = src.pin_memory()
    if dst_device == "cpu" and src_device != "cpu":
        dst = dst.pin_memory()
    src.fill_(1.0)

    def run():
        dst.copy_(src)
        if src_device != "cpu" or dst_device != "cpu":
            torch.cuda.synchronize()
    seconds = _best_of(run, repeats, clock)
    moved = nbytes * (2 if src_device == dst_device == "cpu" else 1)
    return moved / seconds


def measure_adam_bandwidth(numel: int, repeats: int = 3, clock=time.perf_counter) -> tuple[float, str]:
    """(bytes/s at 28 B/param, which implementation) of one fp32 AdamW step over ``numel`` parameters."""
    import torch
    p, g, m, v = (torch.full((numel,), 0.01, dtype=torch.float32) for _ in range(4))
    try:
        import socompile_ext
        counter = iter(range(1, 10**9))

        def run():
            socompile_ext.adam_step(p, g, m, v, step=next(counter), lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                    weight_decay=0.1)
        kind = f"socompile_ext ({socompile_ext.isa() if hasattr(socompile_ext, 'isa') else 'native'})"
    except ImportError:
        param = torch.nn.Parameter(p)
        param.grad = g
        try:
            opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
            kind = "torch AdamW fused"
            opt.step()
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW([param], lr=1e-3, foreach=True)
            kind = "torch AdamW foreach"

        def run():
            opt.step()
    seconds = _best_of(run, repeats, clock)
    return numel * ADAM_BYTES_FP32_GRAD / seconds, kind


def measure_matmul_flops(n: int, device: str = "cpu", repeats: int = 2, dtype=None, clock=time.perf_counter) -> float:
    import torch
    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
    return 2 * n**3 / _best_of(run, repeats, clock)


def measure_op_latency(repeats: int = 200, clock=time.perf_counter) -> float:
    """Seconds of one tiny op on the CPU (dispatch, no data): what each kernel of a CPU "device" costs on top
    of its bytes and FLOPs."""
    import torch
    x = torch.zeros(1)

    def run():
        for _ in range(repeats):
            x.add_(1.0)
    return _best_of(run, 3, clock) / repeats


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def calibrate(quick: bool = False, name: str = THIS_MACHINE, clock=time.perf_counter) -> HardwareProfile:
    """Measure this machine. ``quick`` uses smaller buffers (a few seconds; noisier). ``clock``: see _best_of
    (the CPU measurements only; a GPU's are timed on the wall clock)."""
    import torch
    buffer = (64 if quick else 512) * 2**20
    host_bw = measure_copy_bandwidth(buffer, clock=clock)
    adam_bw, adam_kind = measure_adam_bandwidth((4 if quick else 32) * 2**20, clock=clock)
    cores = os.cpu_count() or 1
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        h2d = measure_copy_bandwidth(buffer, src_device="cpu", dst_device="cuda")
        d2h = measure_copy_bandwidth(buffer, src_device="cuda", dst_device="cpu")
        dev_bw = measure_copy_bandwidth(buffer, src_device="cuda", dst_device="cuda") * 2
        flops = measure_matmul_flops(4096 if quick else 8192, device="cuda")
        fp32_flops = measure_matmul_flops(4096 if quick else 8192, device="cuda", dtype=torch.float32)
        op_latency = 0.0   # launches are queued ahead of the GPU: hidden
        dev_mem, where = props.total_memory, f"GPU {props.name}"
    else:
        # DESIGN section 5: without a GPU the device is this CPU; "link" copies are host memcpy (moved bytes).
        h2d = d2h = host_bw / 2
        dev_bw = host_bw
        flops = measure_matmul_flops(512 if quick else 1024, clock=clock)
        fp32_flops = measure_matmul_flops(512 if quick else 1024, dtype=torch.float32, clock=clock)
        op_latency = measure_op_latency(clock=clock)
        dev_mem, where = _host_memory() // 2, "no GPU: the device is this CPU"
    return HardwareProfile(
        name=name, device_memory=int(dev_mem), device_bandwidth=dev_bw, device_bf16_flops=flops,
        host_memory=_host_memory(), host_bandwidth=host_bw, host_cores=cores, link_bandwidth=h2d,
        link_latency=10e-6, cpu_adam_bandwidth=adam_bw, device_reserved=0 if not torch.cuda.is_available() else GB,
        link_bandwidth_d2h=d2h, device_is_host=not torch.cuda.is_available(), device_fp32_flops=fp32_flops,
        device_op_latency=op_latency,
        source=f"measured by socompile calibrate ({'quick' if quick else 'full'}; {where}; CPU Adam: {adam_kind})")
