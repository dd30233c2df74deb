"""Measure this machine and write a hardware profile (``python -m socompile calibrate``).

What is measured, and how:
- host memory bandwidth: STREAM-style copy of a buffer much larger than the caches, counted as read + write;
- CPU Adam: ``socompile_ext.adam_step`` on fp32 p/g/m/v when the extension is built, else torch's AdamW
  (fused if available, else foreach), reported as the bytes/s it streams at 28 B/param;
- copy rates "host->device" and "device->host": on a CUDA machine, pinned-memory copies; without a GPU the
  "device" is this CPU (DESIGN section 5), so a copy between two host buffers.
Device FLOP/s is measured as a bf16 and an fp32 matmul on the device (on a CPU this is slow and is what the
plan gets; fp32 models compute at the fp32 rate, a third of bf16 on this AVX512-BF16 CPU). On a CPU "device"
also: the attention kernels' FLOP/s per direction, dtype and query shape, elementwise bytes/s per dtype
(``device_kernel_rates``; measure_kernel_rates says what and why) and elements/s per elementwise family
(measure_elementwise_rates). The runtime's own work, which a CPU "device" pays on the cores that compute: per
bucket step and per gradient tensor (measure_bucket_overhead, any machine), per flow fetch
(measure_weight_fetch_overhead) and per offloaded activation.
"""
from __future__ import annotations

import dataclasses
import os
import time

from .hardware.profiles import ADAM_BYTES_FP32_GRAD, GB, THIS_MACHINE, HardwareProfile, KernelRate

# Query shapes (tokens, head dim) at which the CPU attention kernels are measured: their FLOP rate depends on
# both (bf16 backward: ~9 GFLOP/s at 128 x 32, ~40 at 512 x 128 on one AVX512-BF16 core); the simulator
# interpolates between them. (batch x heads) slices of ATTENTION_TOKENS // seq tokens each: the rate per slice
# does not depend on their number, once a call is long enough that its fixed costs do not count.
ATTENTION_SHAPES = ((128, 32), (128, 128), (512, 32), (512, 128))
ATTENTION_TOKENS = 2048
# Sides of the square matmuls measured per dtype: a CPU's matmul rate grows with the size (bf16 on one core:
# ~95 GFLOP/s at 128, ~190 at 512). Each side is measured again as a tall product of the same FLOPs, tokens
# MATMUL_TALL times the width (half the side, so 4x the side long): a CPU trains models whose batch of tokens is
# several times their width (tiny: 1024 x 128), and without bf16 matrix instructions such a product runs at
# ~1.6x the square's rate (an AVX2 EPYC, one thread: 5.5 vs 3.4 GFLOP/s). The simulator looks a matmul node up
# by its (shortest, longest) dimension. Operands are cycled through MATMUL_OPERAND_BYTES, more than a core's L2
# cache (measure_cold_matmul_flops).
MATMUL_SIDES = (128, 256, 512)
MATMUL_TALL = 8
MATMUL_RUN_SECONDS = 0.1   # the most one timed run of a shape's matmuls takes (measure_cold_matmul_flops)
MATMUL_OPERAND_BYTES = 16 * 2**20
# Operand size of the elementwise measurement: one layer's activations of a model a CPU trains, which sit in the
# caches, where converting bf16 to fp32 and back costs more than the bytes (bf16: ~2.5x the time per byte of fp32).
ELEMENTWISE_BYTES = 2**20
# Elements of the operands the elementwise families' rates are measured on (measure_elementwise_rates): a tiny or
# small step's elementwise ops read tensors of that order (batch 8 x seq 128 x 64-512 features: 2**16-2**19
# elements), which stay in the cores' caches, where a bf16 op's conversions, a math op's transcendentals or a
# reduction's accumulation, not the bytes, set the time.
ELEMENTWISE_ELEMENTS = 2**16
ELEMENTWISE_ROW = 128   # the reduction's row length (a head dim or a small model's features)
# Fastest of this many runs for the matmul and attention rates: with 2 the rate moved by ~30% run to run on a
# machine shared with other jobs; 5 keeps quick calibration under ~5 s.
MATMUL_REPEATS = 5


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


def measure_matmul_flops(n: int, device: str = "cpu", repeats: int = MATMUL_REPEATS, dtype=None,
                         clock=time.perf_counter) -> float:
    import torch
    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
    return 2 * n**3 / _best_of(run, repeats, clock)


def measure_cold_matmul_flops(n: int, dtype, operand_bytes: int = MATMUL_OPERAND_BYTES, repeats: int = MATMUL_REPEATS,
                               clock=time.perf_counter, tokens: int | None = None) -> float:
    """FLOP/s of a linear layer's matmuls of width ``n`` over ``tokens`` rows (default ``n``: squares) whose
    operands are not in the cores' caches: each call reads a different pair of a set ``operand_bytes`` large,
    as a training step's matmuls read activations and weights that other kernels ran over since (~20% slower
    than one pair multiplied again and again here).

    The pairs take turns at the three layouts a linear layer's step uses: the forward's ``x @ W.T``, the input
    gradient's ``dY @ W`` and the weight gradient's ``dY.T @ X`` (as many matmuls as one layout would take;
    each 2 * tokens * n * n FLOPs). Where the CPU has no bf16 matrix instructions the layouts differ by up to
    7x (an AVX2 EPYC, one thread, side 512: 1.3 GFLOP/s for ``a @ b``, 9.6 for ``a @ b.T``), so one layout
    alone mis-states a training step's matmuls; fp32 differs little."""
    import torch
    tokens = tokens or n
    layouts = ((lambda a, b: a @ b.t(), (n, n)), (lambda a, b: a @ b, (n, n)), (lambda a, b: a.t() @ b, (tokens, n)))
    pair_bytes = (tokens * n + n * n) * torch.empty((), dtype=dtype).element_size()

    def pair(i: int):
        multiply, b_shape = layouts[i % 3]
        return torch.randn(tokens, n).to(dtype), torch.randn(*b_shape).to(dtype), multiply
    operands = [pair(i) for i in range(3)]
    once = _best_of(lambda: [multiply(a, b) for a, b, multiply in operands], 1, clock) / 3
    # A run of more than MATMUL_RUN_SECONDS gains nothing: a matmul that slow (bf16 without matrix
    # instructions: ~80 ms at side 512) reads its operands from memory in a negligible part of its time, so
    # cycling through more of them would only lengthen calibration (it took 12 of a quick calibration's 17 s).
    pairs = max(3, min(operand_bytes // pair_bytes, int(MATMUL_RUN_SECONDS / max(once, 1e-9))))
    operands += [pair(i) for i in range(3, pairs)]

    def run():
        for a, b, multiply in operands:
            multiply(a, b)
    return 2 * tokens * n * n * pairs / _best_of(run, repeats, clock)


def measure_attention_flops(seq: int, head_dim: int, dtype, backward: bool, repeats: int = MATMUL_REPEATS,
                            clock=time.perf_counter) -> float:
    """FLOP/s of the CPU's causal flash attention kernel (forward, or the backward kernel) for a query of ``seq``
    x ``head_dim``, as a transformer lays q, k, v out ((batch, seq, heads, dim) transposed); FLOPs counted as the
    simulator counts them (capture/sizes.py: torch's formulas, lower triangle only)."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from .capture.sizes import causal_fraction
    aten = torch.ops.aten
    slices = max(1, ATTENTION_TOKENS // seq)
    q, k, v = (torch.randn(1, seq, slices, head_dim).to(dtype).transpose(1, 2) for _ in range(3))
    shape = q.shape
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    if backward:
        seconds = _best_of(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, logsumexp, 0.0, True), repeats, clock)
        flops = sdpa_backward_flop_count(shape, shape, shape, shape)
    else:
        seconds = _best_of(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True), repeats,
                           clock)
        flops = sdpa_flop_count(shape, shape, shape)
    return flops * float(causal_fraction(seq)) / seconds


def measure_elementwise_bandwidth(dtype, nbytes: int = ELEMENTWISE_BYTES, repeats: int = 5,
                                  clock=time.perf_counter) -> float:
    """Bytes/s (two read, one written) of ``a * b`` in ``dtype`` on ``nbytes`` operands."""
    import torch
    a = torch.rand(nbytes // 4).to(dtype)
    b = torch.rand(nbytes // 4).to(dtype)
    out = torch.empty_like(a)
    inner = 20   # one multiply of a cache-resident megabyte is ~10 us: time a batch

    def run():
        for _ in range(inner):
            torch.mul(a, b, out=out)
    return 3 * a.numel() * a.element_size() * inner / _best_of(run, repeats, clock)


def measure_matmul_rates(dtype, clock=time.perf_counter) -> tuple[KernelRate, ...]:
    """FLOP/s of a linear layer's matmuls in ``dtype`` at each of MATMUL_SIDES, as a square and as a tall
    product of the same FLOPs (tokens MATMUL_TALL x the width), keyed by (shortest, longest) side."""
    rates = []
    for side in MATMUL_SIDES:
        rates.append(KernelRate("matmul", str(dtype), measure_cold_matmul_flops(side, dtype, clock=clock),
                                (side, side)))
        width = round(side / MATMUL_TALL ** (1 / 3))   # tokens x width x width: the square's FLOPs
        rates.append(KernelRate("matmul", str(dtype), measure_cold_matmul_flops(
            width, dtype, clock=clock, tokens=MATMUL_TALL * width), (width, MATMUL_TALL * width)))
    return tuple(rates)


def measure_kernel_rates(clock=time.perf_counter) -> tuple[KernelRate, ...]:
    """A CPU "device"'s rates that one FLOP rate and one bandwidth do not give: matmuls per dtype and size,
    the attention kernels per direction, dtype and shape, and elementwise throughput per dtype.

    The fp32 matmuls (~0.5 s of the ~25) are measured again after the bf16 ones and the faster of each pair
    kept: on a shared 2-core VM one calibration's fp32 rate read 61-94 GFLOP/s from one run to the next, set by
    a slow phase of a few seconds that a fastest-of-5 within 0.1 s cannot step around."""
    import torch
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        rates.extend(measure_matmul_rates(dtype, clock))
        for seq, head_dim in ATTENTION_SHAPES:
            for kernel, backward in (("attention", False), ("attention_backward", True)):
                rates.append(KernelRate(kernel, str(dtype), measure_attention_flops(seq, head_dim, dtype, backward,
                                                                                    clock=clock), (seq, head_dim)))
        rates.append(KernelRate("elementwise", str(dtype), measure_elementwise_bandwidth(dtype, clock=clock)))
    again = {r.shape: r.rate for r in measure_matmul_rates(torch.float32, clock)}
    return tuple(dataclasses.replace(r, rate=max(r.rate, again[r.shape]))
                 if r.kernel == "matmul" and r.dtype == str(torch.float32) else r for r in rates)


def measure_copy_latency(repeats: int = 200, clock=time.perf_counter) -> float:
    """Seconds of one small copy handed to a stream thread and waited for, as the CPU runtime moves every
    "link" transfer (runtime/device.py CPURuntime): the hand-off, not the bytes."""
    import torch

    from .runtime.device import CPURuntime
    runtime = CPURuntime()
    stream = runtime.stream("calibrate")
    src, dst = torch.zeros(16), torch.empty(16)

    def run():
        for _ in range(repeats):
            runtime.copy_async(dst, src, stream).synchronize()
    try:
        return _best_of(run, 3, clock) / repeats
    finally:
        runtime.shutdown()


def measure_bucket_overhead(tensors: int = 16, numel: int = 2**14, repeats: int = 10,
                            clock=time.perf_counter) -> tuple[float, float]:
    """(seconds per bucket, seconds per gradient tensor) of the optimizer runtime's work beyond its kernel, as a
    compiled backward drives it: ``torch.ops.socompile.bucket_grads_ready`` per bucket of a real
    ``socompile.AdamW``'s claim, then ``step()`` and ``zero_grad()``. The same ``numel`` parameters (same kernel
    bytes) in three layouts: one bucket of one tensor (A), one bucket of ``tensors`` tensors (B), ``tensors``
    buckets of one tensor (C); B - A is ``tensors - 1`` extra tensors, C - B ``tensors - 1`` extra buckets."""
    import torch

    from .ops.optimizer_ops import bucket_grads_ready   # torch.ops.socompile.bucket_grads_ready, as graphs call it
    from .optim.adamw import AdamW

    def seconds_per_step(buckets: int, per_bucket: int) -> float:
        size = numel // (buckets * per_bucket)
        lists = [[torch.nn.Parameter(torch.zeros(size)) for _ in range(per_bucket)] for _ in range(buckets)]
        grads = [[torch.full((size,), 1e-3) for _ in ps] for ps in lists]
        opt = AdamW([p for ps in lists for p in ps], lr=1e-3)
        claim = opt.claim(lists)

        def run():
            for _ in range(repeats):
                for b, gs in enumerate(grads):
                    bucket_grads_ready(gs, [], claim.handle, b, list(range(len(gs))))
                opt.step()
                opt.zero_grad()
        return _best_of(run, 3, clock) / repeats
    one = seconds_per_step(1, 1)
    many_tensors = seconds_per_step(1, tensors)
    many_buckets = seconds_per_step(tensors, 1)
    return max(0.0, (many_buckets - many_tensors) / (tensors - 1)), max(0.0, (many_tensors - one) / (tensors - 1))


def measure_weight_fetch_overhead(link_latency: float, repeats: int = 50, clock=time.perf_counter) -> float:
    """Seconds of the runtime's work per flow fetch beyond the copy hand-off (``link_latency``, charged per
    transfer already): ``socompile::prefetch``, ``wait_weights`` and ``release`` of a tiny flow bucket on an
    OffloadRuntime over a hand-built one-bucket plan, through the ops the compiled graph calls."""
    import torch

    from .ops.offload_ops import prefetch, release, wait_weights   # torch.ops.socompile's, as graphs call them
    from .plan.plan import BucketPlan, Plan
    from .runtime.device import CPURuntime
    from .runtime.flat_bucket import FlatBucket
    from .runtime.offload import OffloadRuntime
    bucket = FlatBucket(0, [torch.nn.Parameter(torch.zeros(16))])
    plan = Plan(target="calibrate", bucket_size=1, unoptimized_params=(), predicted=(("param_dtype_bytes", 4),),
                buckets=(BucketPlan(index=0, params=("w",), numel=16, grad_bytes=64, optimizer_site="cpu",
                                    ready_after="bw:w", ready_position=0, weight_mode="flow", prefetch_distance=1),))
    device = CPURuntime()
    runtime = OffloadRuntime(plan, [bucket], device)

    def run():
        for _ in range(repeats):
            ticket = prefetch(runtime.handle, "fw", 0)
            weights = wait_weights(runtime.handle, "fw", 0, 16, torch.float32, device.device, ticket)
            release(runtime.handle, "fw", 0, [weights])
    try:
        return max(0.0, _best_of(run, 3, clock) / repeats - link_latency)
    finally:
        device.shutdown()


def measure_elementwise_rates(op_latency: float = 0.0, elements: int = ELEMENTWISE_ELEMENTS, repeats: int = 5,
                              clock=time.perf_counter) -> tuple[KernelRate, ...]:
    """Elements/s per elementwise family and dtype on ``elements``-element operands (ELEMENTWISE_ELEMENTS):
    binary ``a * b``, math ``silu(a)``, reduction (a row sum over ELEMENTWISE_ROW-wide rows); the op's dispatch
    (``op_latency``, charged per node already) is taken out."""
    import torch
    import torch.nn.functional as F
    rates = []
    inner = 20   # one op on 2**16 cached elements is ~10-50 us: time a batch
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.rand(elements).to(dtype), torch.rand(elements).to(dtype)
        rows = a.view(-1, ELEMENTWISE_ROW)
        for family, op in (("binary", lambda: a * b), ("math", lambda: F.silu(a)), ("reduction", lambda: rows.sum(-1))):
            def run(op=op):
                for _ in range(inner):
                    op()
            seconds = _best_of(run, repeats, clock) / inner - op_latency
            rates.append(KernelRate(f"elementwise_{family}", str(dtype), elements / max(seconds, 1e-9)))
    return tuple(rates)


def measure_activation_offload_overhead(tensors: int = 16, repeats: int = 10, clock=time.perf_counter) -> float:
    """Seconds of the CPU runtime's work per saved tensor that a layer offloads and fetches back, through the
    ops the compiled graph calls (ops/activation_ops.py): tiny tensors, so the hand-offs and bookkeeping, not
    the bytes (those are charged at the copy bandwidth)."""
    import torch

    from .ops import activation_ops  # noqa: F401  (registers torch.ops.socompile's activation ops)
    from .runtime.activation_offload import ActivationOffloadRuntime
    from .runtime.device import CPURuntime
    device = CPURuntime()
    runtime = ActivationOffloadRuntime(device)
    ops, saved = torch.ops.socompile, [torch.zeros(16) for _ in range(tensors)]

    def layer():
        for _ in range(repeats):
            hosts = [ops.offload_activation(runtime.handle, "calibrate", t) for t in saved]
            ops.offload_wait(runtime.handle, "calibrate", hosts, saved)
            ticket = ops.prefetch_activations(runtime.handle, "calibrate", hosts)
            for i, host in enumerate(hosts):
                ops.wait_activation(runtime.handle, "calibrate", i, host, ticket, device.device)
    try:
        return _best_of(layer, 3, clock) / (repeats * tensors)
    finally:
        device.shutdown()   # the handle table holds the runtime weakly: it goes with this frame


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


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu") -> int:
    """Bytes of the highest-level CPU caches, each distinct cache counted once (sysfs); 0 where unreadable."""
    import glob
    caches: dict[str, int] = {}   # of the highest level seen: size by the CPUs sharing it
    top = 0
    for index in glob.glob(f"{sysfs}/cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int(open(f"{index}/level").read())
            size = open(f"{index}/size").read().strip()
            shared = open(f"{index}/shared_cpu_list").read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        nbytes = int(size.rstrip("KMG") or 0) * scale
        if level > top:
            caches, top = {}, level
        if level == top:
            caches[shared] = nbytes
    return sum(caches.values())


def streaming_bytes(minimum: int) -> int:
    """A working set that streams from memory, as a step's GB-sized buckets do: at least ``minimum`` and 4x the
    last-level cache (a quick calibration's 64 MB Adam fitted in a 16-core server's cache: the first H200 run
    measured CPU Adam at 237 GB/s that way, and the simulated step ran 0.43x the real one)."""
    return max(minimum, 4 * last_level_cache_bytes())


def calibrate(quick: bool = False, name: str = THIS_MACHINE, clock=time.perf_counter) -> HardwareProfile:
    """Measure this machine. ``quick`` uses smaller buffers (a few seconds; noisier). ``clock``: see _best_of
    (the CPU measurements only; a GPU's are timed on the wall clock)."""
    import torch
    buffer = streaming_bytes((64 if quick else 512) * 2**20)
    host_bw = measure_copy_bandwidth(buffer, clock=clock)
    # p, g, m, v: 16 B per parameter stream through the kernel
    adam_bw, adam_kind = measure_adam_bandwidth(buffer // 16, clock=clock)
    cores = os.cpu_count() or 1
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        h2d = measure_copy_bandwidth(buffer, src_device="cpu", dst_device="cuda")
        d2h = measure_copy_bandwidth(buffer, src_device="cuda", dst_device="cpu")
        dev_bw = measure_copy_bandwidth(buffer, src_device="cuda", dst_device="cuda") * 2
        flops = measure_matmul_flops(4096 if quick else 8192, device="cuda")
        fp32_flops = measure_matmul_flops(4096 if quick else 8192, device="cuda", dtype=torch.float32)
        op_latency = 0.0   # launches are queued ahead of the GPU: hidden
        kernel_rates = ()  # datasheet rates x efficiency, as the shipped GPU profiles
        link_latency = 10e-6
        dev_mem, where = props.total_memory, f"GPU {props.name}"
    else:
        # DESIGN section 5: without a GPU the device is this CPU; "link" copies are host memcpy (moved bytes).
        h2d = d2h = host_bw / 2
        dev_bw = host_bw
        flops = measure_matmul_flops(512 if quick else 1024, clock=clock)
        fp32_flops = measure_matmul_flops(512 if quick else 1024, dtype=torch.float32, clock=clock)
        op_latency = measure_op_latency(clock=clock)
        kernel_rates = measure_kernel_rates(clock=clock)
        # The least of two ~2 ms measurements ~20 s apart: one read 3.3-3.8 us in most calibrations here and
        # 5.7-8.1 us in a slow phase of the machine (measure_kernel_rates says why the fastest of one short burst
        # does not step around it); a tiny step dispatches thousands of ops, so it moves the step by ~20%.
        op_latency = min(op_latency, measure_op_latency(clock=clock))
        kernel_rates += measure_elementwise_rates(op_latency, clock=clock)
        link_latency = measure_copy_latency(clock=clock)   # a copy is a hand-off to a stream thread
        dev_mem, where = _host_memory() // 2, "no GPU: the device is this CPU"
    per_bucket, per_tensor = measure_bucket_overhead(clock=clock)
    return HardwareProfile(
        name=name, device_memory=int(dev_mem), device_bandwidth=dev_bw, device_bf16_flops=flops,
        host_memory=_host_memory(), host_bandwidth=host_bw, host_cores=cores, link_bandwidth=h2d,
        link_latency=link_latency, cpu_adam_bandwidth=adam_bw, device_reserved=0 if not torch.cuda.is_available() else GB,
        link_bandwidth_d2h=d2h, device_is_host=not torch.cuda.is_available(), device_fp32_flops=fp32_flops,
        device_op_latency=op_latency, device_kernel_rates=kernel_rates,
        cpu_bucket_overhead=per_bucket, cpu_grad_overhead=per_tensor,
        weight_fetch_overhead=0.0 if torch.cuda.is_available() else measure_weight_fetch_overhead(link_latency,
                                                                                                  clock=clock),
        activation_offload_overhead=0.0 if torch.cuda.is_available() else measure_activation_offload_overhead(
            clock=clock),
        source=f"measured by socompile calibrate ({'quick' if quick else 'full'}; {where}; CPU Adam: {adam_kind})")


def profile_for_target(target: str) -> HardwareProfile:
    """The profile a ``target`` option names; ``this-machine`` with no cached profile is measured now (as
    ``python -m socompile calibrate --quick`` does) and cached where that command caches it.

    A compile asks for the profile while AOTAutograd's fake mode (and functionalization) is active, where the
    measuring buffers would be fake tensors with no memory to time: the measurement runs with no mode active."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .hardware.profiles import profile_cache_path, save_profile
    from .hardware.targets import get_profile
    cached = profile_cache_path()
    if target == THIS_MACHINE and not cached.exists():
        with _disable_current_modes():
            save_profile(calibrate(quick=True), cached)
    return get_profile(target)
