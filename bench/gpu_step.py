"""One GPU: the runtime's copy stream (bandwidth, overlap with compute) and the step time of a ~1B Llama with and
without socompile offload. Run by bench/gpu_check.sh; written without a GPU at hand (see docs/runtime.md).

    python bench/gpu_step.py [--preset llama-1b] [--batch 2] [--seq 1024] [--steps 8]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import socompile
from socompile.models import build
from socompile.models.llama import PRESETS
from socompile.runtime.device import CUDARuntime


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
    print(f"overlap: matmuls alone {alone * 1e3:.1f} ms, copies alone {copy_s * 1e3:.1f} ms, together "
          f"{both * 1e3:.1f} ms ({'overlapped' if both < 0.9 * (alone + copy_s) else 'NOT overlapped'})")


def time_steps(model, opt, data, steps: int, warmup: int) -> float:
    times = []
    for i, (x, y) in enumerate(data[:warmup + steps]):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    copy_stream_check()
    overrides = {"n_layers": args.layers} if args.layers else {}
    vocab = PRESETS[args.preset].vocab_size
    data = [(torch.randint(0, vocab, (args.batch, args.seq), device="cuda"),
             torch.randint(0, vocab, (args.batch, args.seq), device="cuda")) for _ in range(args.warmup + args.steps)]

    torch.manual_seed(0)
    model = build(args.preset, **overrides).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    t = time_steps(torch.compile(model), opt, data, args.steps, args.warmup)
    print(f"without offload ({n / 1e9:.2f}B params, fp32 master + bf16 autocast, Inductor + fused AdamW on the GPU): "
          f"{t * 1e3:.1f} ms/step, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del model, opt
    torch.cuda.empty_cache()

    torch.manual_seed(0)
    model = build(args.preset, **overrides).cuda()
    try:
        opt = socompile.AdamW(model.parameters(), lr=1e-4)
        cmodel = torch.compile(model, backend=socompile.SuperOffload(target="gh200", bucket_size="64MB"))
        torch.cuda.reset_peak_memory_stats()
        t = time_steps(cmodel, opt, data, args.steps, args.warmup)
        print(f"with offload (socompile): {t * 1e3:.1f} ms/step, peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    except (TypeError, RuntimeError) as exc:
        # Expected today: socompile's buckets hold fp32 CPU parameters (docs/runtime.md, "Not done").
        print(f"with offload (socompile): not supported on CUDA yet: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
