"""Speculation-then-validation: step time with and without speculation at several clipping rates.

    python bench/stv.py [--preset tiny] [--steps 60] [--compute inductor]

For each target clipping rate r, max_grad_norm is set to the (1 - r) quantile of the gradient norms of a probe
run, so about r of the steps clip. Both runs (speculate on/off) train the same model on the same data; the
table gives median and spread of step time, the measured clipping rate, and the rollback counters.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import socompile
from socompile.data import ByteBatches, stdlib_corpus
from socompile.models import build

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def train(preset, batches, max_norm, speculate: bool, compute: str, warmup: int):
    torch.manual_seed(0)
    model = build(preset)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=max_norm, **HYPER)
    backend = socompile.SuperOffload(compute=compute, bucket_size="512KB", gpu_buckets=0, speculate=speculate)
    cmodel = torch.compile(model, backend=backend)
    times, norms, clipped = [], [], 0
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        F.cross_entropy(cmodel(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            clipped += opt.last_step_clipped
        norms.append(opt.last_grad_norm)
    torch._dynamo.reset()
    return times, norms, clipped / max(len(times), 1), opt.stats


def simulated(model: str, seq: int, batch: int, target: str, rates: list[float]) -> None:
    """The simulator's view of the same question on the target machine (planned under FakeTensorMode)."""
    import torch as _torch

    from socompile.offline import plan_model
    from socompile.perf.simulate import simulate

    ctx = plan_model(model, batch=batch, seq=seq, options={"target": target}, dtype=_torch.bfloat16,
                     run_passes=False)
    details = ctx.plan_details   # the planning plan_model did
    times = {mode: simulate(details.plan, details.costs, details.cost, speculation=mode).step_time
             for mode in ("on", "off", "redo")}
    print(f"\nsimulated on {target}: {model}, seq {seq}, batch {batch}; step seconds with speculation "
          f"{times['on']:.3f}, without {times['off']:.3f}, clipped step (all redone) {times['redo']:.3f}")
    print(f"{'clip rate':>9s} {'speculation s':>14s} {'no speculation s':>17s} {'speedup':>8s}")
    for rate in rates:
        # Upper bound for speculation: every clipped step redoes every CPU bucket after backward (the running
        # norm usually stops speculation earlier, and predicted clipping holds it).
        spec = (1 - rate) * times["on"] + rate * times["redo"]
        print(f"{rate:9.0%} {spec:14.3f} {times['off']:17.3f} {times['off'] / spec:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compute", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--rates", default="0,0.01,0.1,0.5")
    parser.add_argument("--sim-model", default="llama-13b", help="model for the simulated rows ('' to skip)")
    parser.add_argument("--sim-target", default="gh200")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.sim_model:
        simulated(args.sim_model, 4096, 4, args.sim_target, rates)
    data = ByteBatches(stdlib_corpus(), args.batch, args.seq, seed=0)
    batches = [next(data) for _ in range(args.warmup + args.steps)]
    _, probe_norms, _, _ = train(args.preset, batches, 1e30, True, args.compute, args.warmup)
    ordered = sorted(probe_norms[args.warmup:])
    print(f"preset {args.preset}, batch {args.batch} x seq {args.seq}, {args.steps} timed steps, "
          f"compute {args.compute}, {torch.get_num_threads()} threads")
    header = (f"{'target clip':>11s} {'measured':>9s} {'spec ms':>8s} {'(min-max)':>15s} {'no-spec ms':>10s} "
              f"{'(min-max)':>15s} {'speedup':>8s} {'speculated':>10s} {'rolled back':>11s} {'held':>5s}")
    print("\nmeasured on this machine:")
    print(header)
    for rate in rates:
        index = min(len(ordered) - 1, int(len(ordered) * (1 - rate)))
        max_norm = 1e30 if rate == 0 else ordered[index] * 0.999
        spec_t, _, spec_rate, stats = train(args.preset, batches, max_norm, True, args.compute, args.warmup)
        plain_t, _, _, _ = train(args.preset, batches, max_norm, False, args.compute, args.warmup)
        s, p = statistics.median(spec_t), statistics.median(plain_t)
        print(f"{rate:11.0%} {spec_rate:9.0%} {s * 1e3:8.2f} {f'({min(spec_t)*1e3:.1f}-{max(spec_t)*1e3:.1f})':>15s} "
              f"{p * 1e3:10.2f} {f'({min(plain_t)*1e3:.1f}-{max(plain_t)*1e3:.1f})':>15s} {p / s:7.2f}x "
              f"{stats['speculated']:10d} {stats['rolled_back']:11d} {stats['held']:5d}")
    print("goal: speculation never slower than no speculation at 50% clipping, faster at 0-10% (speedup >= 1)")


if __name__ == "__main__":
    main()
