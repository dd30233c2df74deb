"""Training-step time on the CPU, side by side in one run: eager + torch AdamW(fused), torch.compile (Inductor)
+ torch AdamW(fused), and superoffload (Inductor underneath, socompile.AdamW stepped per bucket in backward).

    python bench/step_cpu.py [--preset tiny] [--steps 40] [--rounds 3]

Rounds interleave the configurations so slow drifts of a noisy machine hit all of them alike. Prints the
median and spread (min-max over all timed steps) of seconds per step, and ratios against Inductor + fused.

Weight placement rows (every bucket stepped on the CPU): all weights stationary, all weights flowing (fetched
before each use in forward and backward, released after), and the planner's choice. Beside the time, the peak
of device bytes the socompile runtime held (runtime/memory.py; on this CPU-only build the "device" copies are
separate host buffers) and the weights it streamed: flow must cut the stationary weights by at least that much.
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


def make_config(name: str, preset: str, seed: int = 0):
    torch.manual_seed(seed)
    model = build(preset)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "eager + AdamW(fused)":
        return model, torch.optim.AdamW(model.parameters(), fused=True, **hyper), None
    if name == "inductor + AdamW(fused)":
        return torch.compile(model), torch.optim.AdamW(model.parameters(), fused=True, **hyper), None
    gpu_buckets = 0 if "all CPU" in name else None
    weight_mode = "flow" if "flow" in name else "stationary" if "stationary" in name else "planned"
    opt = socompile.AdamW(model.parameters(), **hyper)
    backend = socompile.SuperOffload(bucket_size="1MB", gpu_buckets=gpu_buckets, weight_mode=weight_mode)
    return torch.compile(model, backend=backend), opt, backend


CONFIGS = ["eager + AdamW(fused)", "inductor + AdamW(fused)", "superoffload (all CPU, stationary)",
           "superoffload (all CPU, flow)", "superoffload (planned)"]


def device_columns(backend) -> tuple[str, str]:
    """(peak device MB the runtime held, MB of weights streamed per phase) of a superoffload config."""
    if backend is None or not backend.compiled or getattr(backend.compiled[0], "offload", None) is None:
        return "-", "-"
    ctx = backend.compiled[0]
    peak = ctx.offload.ledger.summary()["peak"]
    streamed = sum(4 * ctx.offload.buckets[b.index].master.numel() for b in ctx.plan.buckets
                   if b.weight_mode == "flow")
    return f"{peak / 1e6:.2f}", f"{streamed / 1e6:.2f}"


def add_timing_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The options of warm_up and timed_rounds: batch shape, timed steps per round, rounds, untimed steps."""
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first (compile, first-touch)")


def train_step(model, opt, x, y) -> None:
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad()


def warm_up(setups: dict, batches) -> None:
    """Untimed steps of every configuration ((model, optimizer, ...) per key): compiles, first touches."""
    for model, opt, *_ in setups.values():
        for x, y in batches:
            train_step(model, opt, x, y)


def timed_rounds(setups: dict, batches, rounds: int) -> dict:
    """Seconds of each step per configuration key. The configurations take turns, every batch each per round,
    so a drift of the (shared) machine's load falls on all of them alike."""
    times: dict = {key: [] for key in setups}
    for _ in range(rounds):
        for key, (model, opt, *_) in setups.items():
            for x, y in batches:
                start = time.perf_counter()
                train_step(model, opt, x, y)
                times[key].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    add_timing_arguments(parser, steps=40, warmup=5)
    args = parser.parse_args()
    data = ByteBatches(stdlib_corpus(), args.batch, args.seq, seed=0)
    batches = [next(data) for _ in range(args.warmup + args.steps)]
    setups = {name: make_config(name, args.preset) for name in CONFIGS}
    warm_up(setups, batches[:args.warmup])
    times = timed_rounds(setups, batches[args.warmup:], args.rounds)
    anchor = statistics.median(times["inductor + AdamW(fused)"])
    print(f"preset {args.preset}, batch {args.batch} x seq {args.seq}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'configuration':36s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'vs inductor+fused':>18s} "
          f"{'device peak MB':>15s} {'streamed MB':>12s}")
    for name in CONFIGS:
        t = times[name]
        med = statistics.median(t)
        peak, streamed = device_columns(setups[name][2])
        print(f"{name:36s} {med * 1e3:10.2f} {min(t) * 1e3:8.2f} {max(t) * 1e3:8.2f} {anchor / med:17.2f}x "
              f"{peak:>15s} {streamed:>12s}")
    stationary, flow = (setups[f"superoffload (all CPU, {m})"][2].compiled[0] for m in ("stationary", "flow"))
    s_peak, f_peak = stationary.offload.ledger.peak, flow.offload.ledger.peak
    f_parts = flow.offload.ledger.summary()["peak_parts"]
    cost = statistics.median(times["superoffload (all CPU, flow)"]) / statistics.median(
        times["superoffload (all CPU, stationary)"])
    print(f"weight flow: device peak {s_peak / 1e6:.2f} -> {f_peak / 1e6:.2f} MB (stationary weights -"
          f"{stationary.offload.ledger.summary()['peak_parts'].get('stationary weights', 0) / 1e6:.2f} MB, flow "
          f"buffers +{f_parts.get('weight-flow buffers', 0) / 1e6:.2f} MB); step time x{cost:.2f} "
          f"(a real copy per fetch on this CPU; on a GPU the copies overlap compute)")
    so = statistics.median(times["superoffload (all CPU, stationary)"])
    print(f"goal: superoffload no slower than inductor + fused AdamW -> ratio {anchor / so:.2f}x "
          f"({'met' if so <= anchor * 1.02 else 'NOT met'}; within 2% counts as equal on this noisy machine)")


if __name__ == "__main__":
    main()
