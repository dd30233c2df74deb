"""One GPU: the runtime's copy stream (bandwidth, overlap with compute) and the step time of a ~1B Llama with and
without socompile offload. Run by bench/gpu_check.sh; written without a GPU at hand (see docs/runtime.md).

    python bench/gpu_step.py [--preset llama-1b] [--layers N] [--batch 2] [--seq 1024] [--steps 8]
                             [--offload-dtype bf16|fp32|both] [--gpu-buckets 0,planner]

"with offload": the model on the GPU (``model.cuda()``, bf16 weights, or fp32 weights under bf16 autocast),
socompile.AdamW (a separate host master: fp32 master, gradients and Adam moments in pinned host memory, the CPU
kernel stepping each bucket while backward goes on, the updated weights uploaded per bucket) and the backend.
Each case is guarded: a failure prints its traceback and the script goes on, exiting 1 at the end. Each offload
case runs with every bucket's optimizer on the CPU (``gpu_buckets=0``) and with the planner's own choice of
GPU-stepped buckets, and prints one more step's per-bucket timeline from the runtime's events (``opt.events``):
the start and end of each CPU bucket step and upload on the thread that ran it, and of the forward and
backward. On CUDA a copy's span is the worker queueing it on its stream, not the stream running it.

What it asserts (each a failure, exit 1), with the bound's reason:
- copy stream: at least HIDDEN_FLOOR of the h2d copy time is hidden under the matmul loop (the loop is
  ~40 x 1.1 TFLOP, tens of ms on any recent GPU, longer than 1 GB of pinned copies at PCIe 5 or NVLink-C2C
  rates; copy engines do not use the SMs, so only HBM contention can slow either side: half is a low floor);
- equality: socompile (eager compute, CPU Adam) equals torch.optim.AdamW on the same GPU model and data within
  EAGER_ATOL (the forward/backward are the same aten ops, so the gradients are bitwise equal; the CPU kernel and
  torch's CUDA AdamW round each op correctly but may contract to FMAs differently: ~1 fp32 ulp per step on
  weights of magnitude <= 1, i.e. ~1e-7 per step; 3 steps stay below 1e-6, 1e-5 leaves a 10x margin);
- the loss falls: the mean of the last two steps' losses is below the first step's (random tokens: the model
  learns their unigram statistics, the loss drops from above ln(vocab) towards it);
- device memory: the measured peak (torch.cuda.max_memory_allocated over the timed steps) is within
  PEAK_TOLERANCE (10%) of the plan's prediction (``device_peak_bytes``) with eager compute, and at most 10%
  above it under Inductor (which fuses intermediates the plan frees one by one: the plan is an upper bound).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch._dynamo
import torch.nn.functional as F

import socompile
from socompile.models import WithLMLoss, build
from socompile.models.llama import PRESETS
from socompile.runtime.device import CUDARuntime
from socompile.tools.runtime_timeline import record_one_step, spans, text_summary


HIDDEN_FLOOR = 0.5
EAGER_ATOL = 1e-5
PEAK_TOLERANCE = 0.10


def check(condition: bool, message: str) -> None:
    """An assertion that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
    print(f"  ok: {message}")


def copy_stream_check(mb: int = 64, copies: int = 16) -> None:
    """h2d bandwidth from pinned memory on the runtime's side stream, and whether it overlaps a matmul loop."""
    rt = CUDARuntime("cuda")
    h2d = rt.stream("h2d")
    n = mb * 2**20 // 2
    src = rt.host_buffer(n, torch.bfloat16)
    dst = [rt.empty(n, torch.bfloat16) for _ in range(2)]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls(k=40):
        for _ in range(k):
            a @ a

    torch.cuda.synchronize()
    t = time.perf_counter()
    events = [rt.copy_async(dst[i % 2], src, h2d) for i in range(copies)]
    events[-1].synchronize()
    copy_s = time.perf_counter() - t
    print(f"h2d copies: {copies} x {mb} MB in {copy_s * 1e3:.1f} ms = {copies * mb / 1024 / copy_s:.1f} GB/s")
    torch.cuda.synchronize()
    t = time.perf_counter()
    matmuls()
    torch.cuda.synchronize()
    alone = time.perf_counter() - t
    t = time.perf_counter()
    events = [rt.copy_async(dst[i % 2], src, h2d) for i in range(copies)]
    matmuls()
    rt.wait_on_compute(events[-1])
    torch.cuda.synchronize()
    both = time.perf_counter() - t
    hidden = (alone + copy_s - both) / copy_s
    print(f"overlap: matmuls alone {alone * 1e3:.1f} ms, copies alone {copy_s * 1e3:.1f} ms, together "
          f"{both * 1e3:.1f} ms: {hidden:.0%} of the copy time hidden under compute")
    check(hidden >= HIDDEN_FLOOR, f"{hidden:.0%} of the h2d copy time hidden under compute (floor {HIDDEN_FLOOR:.0%})")


def equals_eager_check(steps: int = 3, device: str = "cuda") -> None:
    """socompile on the GPU (tiny model, eager compute, CPU Adam with a separate host master) against
    torch.optim.AdamW on the same GPU: see EAGER_ATOL in the module docstring. ``device="cpu"`` under
    SOCOMPILE_RUNTIME=emulated: the same check on the emulated device (``--emulated``, a smoke test)."""
    import copy
    torch._dynamo.reset()
    torch.manual_seed(0)
    ours = build("tiny", n_layers=2).to(device)
    ref = copy.deepcopy(ours)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = socompile.AdamW(ours.parameters(), **hyper)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    cmodel = torch.compile(ours, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0, bucket_size="256KB"))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = (torch.randint(0, 256, (2, 32), generator=g).to(device) for _ in range(2))
        for model, o in ((cmodel, opt), (ref, ref_opt)):
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            o.step()
            o.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    check(opt.host_master == "separate", "the separate host master (the CUDA path) was used")
    with opt.materialized_weights():
        worst = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))
    check(worst <= EAGER_ATOL, f"socompile equals torch.optim.AdamW on the GPU: worst |diff| {worst:.2e} "
                               f"<= {EAGER_ATOL:.0e} after {steps} steps")


def emulated_timeline(gpu_buckets: int | None, steps: int = 3) -> None:
    """``--emulated``: a tiny bf16 model on the emulated device (separate host master, uploads per bucket),
    trained a few steps and one more printed per bucket, as offload_case does on a GPU."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(dtype=torch.bfloat16)
    opt = socompile.AdamW(model.parameters(), lr=1e-3)
    pins = {} if gpu_buckets is None else {"gpu_buckets": gpu_buckets}
    backend = socompile.SuperOffload(compute="eager", bucket_size="256KB", **pins)
    cmodel = torch.compile(WithLMLoss(model), backend=backend)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 256, (2, 64), generator=g) for _ in range(2)) for _ in range(steps + 1)]
    for x, y in batches[:steps]:
        cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
    plan = backend.compiled[0].plan
    sites = [b.optimizer_site for b in plan.buckets]
    print(f"emulated device, tiny bf16, {choice_name(gpu_buckets)}: {len(sites)} buckets, "
          f"{sites.count('cpu')} stepped on the CPU, {sites.count('device')} on the device")
    x, y = batches[-1]
    print_timeline(opt, plan, lambda: cmodel(x, y))


def time_steps(model, opt, data, steps: int, warmup: int, losses: list | None = None) -> float:
    times = []
    for i, (x, y) in enumerate(data[:warmup + steps]):
        if i == warmup:   # the peak of the timed steps: not the compile's (Inductor's autotuning, or a
            #               this-machine calibration run by the first plan: 132% of the plan on the H200)
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):   # a no-op for a bf16 model's own weights
            loss = model(x, y)   # WithLMLoss: the loss is in the compiled graph, so the plan counts its memory
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if losses is not None:
            losses.append(loss.item())
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def parse_gpu_buckets(text: str) -> list[int | None]:
    """``--gpu-buckets``: comma-separated counts of GPU-stepped buckets, "planner" for the planner's choice."""
    choices = []
    for word in text.split(","):
        word = word.strip()
        if word == "planner":
            choices.append(None)
        elif word.isdigit():
            choices.append(int(word))
        else:
            raise argparse.ArgumentTypeError(f"--gpu-buckets takes counts and 'planner', comma-separated; got "
                                             f"{word!r} in {text!r}")
    return choices


def choice_name(gpu_buckets: int | None) -> str:
    return "the planner's gpu_buckets" if gpu_buckets is None else f"gpu_buckets={gpu_buckets}"


def print_timeline(opt, plan, forward, sync=lambda: None) -> None:
    """One more step (``forward()`` returns its loss), printed per bucket from the runtime's events; checks
    that every CPU-stepped bucket was stepped in it (and uploaded, where its master is mirrored)."""
    events = record_one_step(opt, forward, sync)
    print("  one step's timeline (ms from its start; lanes are the threads that recorded):")
    for line in text_summary(events).splitlines():
        print(f"    {line}")
    cpu = {b.index for b in plan.buckets if b.optimizer_site == "cpu"}
    kinds = {(kind, bucket) for _, kind, bucket, _, _ in spans(events)}
    check(all(("step", b) in kinds for b in cpu), f"each of the {len(cpu)} CPU-stepped buckets has its step span")
    mirrored = {b.index for b in opt.buckets if b.mirror and b.site == "cpu"}
    check(all(("upload", b) in kinds for b in mirrored),
          f"each of the {len(mirrored)} mirrored CPU buckets has its upload span")


def offload_case(args, overrides: dict, data, dtype: torch.dtype, compute: str = "inductor",
                 gpu_buckets: int | None = 0) -> None:
    """socompile on the GPU: the real path (model on the GPU, separate host master, uploads per bucket).
    ``compute``: the backend's compiler of the forward/backward ('eager' runs the graph's aten ops one by one).
    ``gpu_buckets``: the buckets whose optimizer stays on the GPU, None for the planner's choice."""
    name = {torch.bfloat16: "bf16 weights", torch.float32: "fp32 weights + bf16 autocast"}[dtype]
    name += "" if compute == "inductor" else f", {compute} compute"
    name += f", {choice_name(gpu_buckets)}"
    torch._dynamo.reset()     # a fresh compile with this backend (no guards of the previous case's compile)
    torch.manual_seed(0)
    model = build(args.preset, **overrides).to(device="cuda", dtype=dtype)
    t0 = time.perf_counter()
    opt = socompile.AdamW(model.parameters(), lr=1e-4)
    if opt.host_master != "separate":
        raise RuntimeError(f"socompile.AdamW chose host_master={opt.host_master!r} for CUDA parameters")
    pins = {} if gpu_buckets is None else {"gpu_buckets": gpu_buckets}
    backend = socompile.SuperOffload(target=args.target, bucket_size=args.bucket_size, compute=compute, **pins)
    # The loss is compiled with the model: a loss computed outside the graph holds ~3 fp32 copies of the logits
    # (0.7 GiB here) that the plan cannot see (the first GPU run measured 128% of the plan that way).
    cmodel = torch.compile(WithLMLoss(model), backend=backend)
    losses: list[float] = []
    t = time_steps(cmodel, opt, data, args.steps, args.warmup, losses)
    peak = torch.cuda.max_memory_allocated()
    total = time.perf_counter() - t0
    ctx = backend.compiled[0] if backend.compiled else None
    line = (f"with offload (socompile, {name}): {t * 1e3:.1f} ms/step, peak "
            f"{peak / 2**30:.1f} GiB (torch), {total:.0f} s with compile")
    print(line)
    if ctx is not None and ctx.plan is not None:
        sites = [b.optimizer_site for b in ctx.plan.buckets]
        modes = [b.weight_mode for b in ctx.plan.buckets]
        ledger = ctx.offload.ledger.summary()
        print(f"  plan: {len(sites)} buckets, {sites.count('cpu')} stepped on the CPU, {sites.count('device')} on "
              f"the GPU, {modes.count('flow')} flowing; runtime device peak {ledger['peak'] / 2**30:.2f} GiB "
              f"{ {k: round(v / 2**30, 2) for k, v in ledger['peak_parts'].items()} }")
        sim = ctx.plan.prediction("step_time_s")
        print(f"  simulated step on the '{args.target}' profile: {sim * 1e3:.1f} ms (simulated: the profile's "
              f"rates, the plan's buckets), measured {t * 1e3:.1f} ms, sim/real {sim / t:.2f}; simulated CPU Adam "
              f"busy {ctx.plan.prediction('cpu_adam_busy_s') * 1e3:.1f} ms, d2h link busy "
              f"{ctx.plan.prediction('link_d2h_busy_s') * 1e3:.1f} ms")
    pinned = sum(t.numel() * t.element_size() for b in opt.buckets if b.site == "cpu"
                 for t in (b.master, b.grad, b.exp_avg, b.exp_avg_sq))
    print(f"  host: {pinned / 2**30:.1f} GiB of pinned fp32 master/gradients/moments; losses "
          f"{', '.join(f'{v:.3f}' for v in losses[:3])} ... {losses[-1]:.3f}")
    check(all(v == v for v in losses), "every loss is finite")
    if ctx is not None and ctx.plan is not None:
        x, y = data[-1]

        def forward():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return cmodel(x, y)
        print_timeline(opt, ctx.plan, forward, torch.cuda.synchronize)
    last = sum(losses[-2:]) / 2
    check(len(losses) > 2 and last < losses[0],
          f"the loss falls: {losses[0]:.3f} -> {last:.3f} (mean of the last two) over {len(losses)} steps")
    predicted = ctx.plan.prediction("device_peak_bytes") if ctx is not None and ctx.plan is not None else None
    check(predicted is not None, "the plan predicts the device peak")
    ratio = peak / predicted
    if compute == "eager":
        check(abs(ratio - 1) <= PEAK_TOLERANCE,
              f"measured device peak {peak / 2**30:.2f} GiB is {ratio:.0%} of the plan's prediction "
              f"{predicted / 2**30:.2f} GiB (within {PEAK_TOLERANCE:.0%})")
    else:   # the plan frees each aten op's output after its last use, as eager runs the graph; Inductor fuses
        #     intermediates away (never adds a saved tensor: both run the same partitioned graphs), so the plan is
        #     an upper bound (the first H200 run measured 74-77% of it)
        check(ratio <= 1 + PEAK_TOLERANCE,
              f"measured device peak {peak / 2**30:.2f} GiB is {ratio:.0%} of the plan's prediction "
              f"{predicted / 2**30:.2f} GiB (Inductor: at most {1 + PEAK_TOLERANCE:.0%})")


def guarded(what: str, fn, failures: list) -> None:
    try:
        fn()
    except Exception:   # noqa: BLE001 - report every stage, then exit non-zero
        failures.append(what)
        print(f"FAILED: {what}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--target", default="gh200")
    parser.add_argument("--bucket-size", default="64MB")
    parser.add_argument("--offload-dtype", choices=("bf16", "fp32", "both"), default="bf16")
    parser.add_argument("--gpu-buckets", type=parse_gpu_buckets, default=parse_gpu_buckets("0,planner"),
                        help="comma-separated: buckets whose optimizer stays on the GPU, each a case (default "
                             "'0,planner': every bucket stepped on the CPU, the offload path, and the planner's "
                             "own choice, the GPU-resident tail of the design)")
    parser.add_argument("--skip-baseline", action="store_true", help="only the socompile case(s)")
    parser.add_argument("--emulated", action="store_true",
                        help="no GPU: only the equality check, on the emulated CUDA device "
                             "(SOCOMPILE_RUNTIME=emulated must be set before this script starts): a smoke test")
    args = parser.parse_args()
    if args.emulated:
        from socompile.runtime.device import resolve_runtime
        if resolve_runtime() != "emulated":
            sys.exit("--emulated needs SOCOMPILE_RUNTIME=emulated in the environment")
        equals_eager_check(device="cpu")
        for gpu_buckets in args.gpu_buckets:
            emulated_timeline(gpu_buckets)
        return
    if not torch.cuda.is_available():
        sys.exit(f"bench/gpu_step.py needs a CUDA GPU; torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                 f"sees none")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    failures: list[str] = []
    guarded("copy stream check", copy_stream_check, failures)
    guarded("socompile equals eager on the GPU", equals_eager_check, failures)
    overrides = {"n_layers": args.layers} if args.layers else {}
    vocab = PRESETS[args.preset].vocab_size
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, vocab, (args.batch, args.seq), generator=g).cuda(),
             torch.randint(0, vocab, (args.batch, args.seq), generator=g).cuda())
            for _ in range(args.warmup + args.steps)]

    def baseline():
        torch.manual_seed(0)
        model = build(args.preset, **overrides).cuda()
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        t = time_steps(torch.compile(WithLMLoss(model)), opt, data, args.steps, args.warmup)
        print(f"without offload ({n / 1e9:.2f}B params, fp32 master + bf16 autocast, Inductor + fused AdamW on the "
              f"GPU): {t * 1e3:.1f} ms/step, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    if not args.skip_baseline:
        guarded("without offload", baseline, failures)
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}
    for dtype in dtypes[args.offload_dtype]:
        for gpu_buckets in args.gpu_buckets:
            guarded(f"with offload ({dtype}, {choice_name(gpu_buckets)})",
                    lambda dtype=dtype, k=gpu_buckets: offload_case(args, overrides, data, dtype, gpu_buckets=k),
                    failures)
    # eager compute: the device peak as the plan counts it (each aten op's output freed after its last use)
    guarded("with offload (bf16, eager compute)",
            lambda: offload_case(args, overrides, data, torch.bfloat16, "eager"), failures)
    if failures:
        print(f"gpu_step: {len(failures)} failed: {', '.join(failures)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
