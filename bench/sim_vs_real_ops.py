"""Where a simulated step differs from the measured one, op by op (diagnosis for bench/sim_vs_real.py).

    python bench/sim_vs_real_ops.py [--preset tiny] [--case stationary] [--batch 8 --seq 128 --layers N]

Compiles one case of bench/sim_vs_real.py (its loss inside the graph), trains a few warm-up steps, then runs one
step under a TorchDispatchMode that times every aten op (and socompile's custom ops) on this thread's CPU clock
(``time.thread_time``: other processes on the cores do not count). Prints, per op class (the op without its
overload: ``aten.mul``), how many ran and their milliseconds against the simulator's nodes of that class on
the calibrated profile, sorted by the larger of the two, then the totals: the step on the same clock, the sum
of the timed ops (the rest is Python outside ops: autograd, the compiled function, the runtime) and the
simulated step.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim_vs_real as bench  # noqa: E402  (a sibling script, not a package)


class OpTimer(TorchDispatchMode):
    """Seconds (thread CPU clock) and calls per op class of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


def simulated_by_class(ctx) -> tuple[dict[str, float], dict[str, int], float]:
    """(seconds per op class, nodes per op class, simulated step) of a compiled graph pair on its profile."""
    from socompile.perf.analysis import analyze
    from socompile.perf.cost import CostModel
    from socompile.plan import get_profile
    cost = CostModel(get_profile(ctx.options.target), ctx.ir.symbol_values)
    costs = analyze(ctx.ir, cost)
    seconds: dict[str, float] = {}
    nodes: dict[str, int] = {}
    for order, times in ((ctx.ir.fw_order, costs.fw_times), (ctx.ir.bw_order, costs.bw_times)):
        for key, t in zip(order, times):
            data = ctx.ir.graph.nodes[key]
            if data["kind"] != "call_function":
                continue
            name = data["op"].rsplit(".", 1)[0] if data["op"].startswith("aten.") else data["op"]
            seconds[name] = seconds.get(name, 0.0) + t
            nodes[name] = nodes.get(name, 0) + 1
    return seconds, nodes, bench.simulated_step(ctx)


def measure(case, preset: str, target: str, batches, layers: int | None):
    """(OpTimer of the last step, that step's thread CPU seconds, compiled context)."""
    cmodel, opt, backend = bench.compile_case(case, preset, target, "eager", layers)

    def step(x, y):
        cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
    for x, y in batches[:-1]:   # compile, caches
        step(x, y)
    timer = OpTimer()
    start = time.thread_time()
    with timer:
        step(*batches[-1])
    seconds = time.thread_time() - start
    ctx = backend.compiled[0]
    torch._dynamo.reset()
    return timer, seconds, ctx


def report(timer: OpTimer, step_s: float, sim: dict, sim_nodes: dict, sim_step: float, top: int) -> list[str]:
    names = sorted(set(timer.seconds) | set(sim), key=lambda n: -max(timer.seconds.get(n, 0.0), sim.get(n, 0.0)))
    lines = [f"{'op':44s} {'real n':>6s} {'real ms':>8s} {'sim n':>6s} {'sim ms':>8s} {'sim/real':>8s}"]
    for name in names[:top]:
        real, s = timer.seconds.get(name, 0.0), sim.get(name, 0.0)
        ratio = f"{s / real:8.2f}" if real > 0 else f"{'-':>8s}"
        lines.append(f"{name[:44]:44s} {timer.calls.get(name, 0):6d} {real * 1e3:8.2f} {sim_nodes.get(name, 0):6d} "
                     f"{s * 1e3:8.2f} {ratio}")
    ops_s = sum(timer.seconds.values())
    lines.append(f"# step {step_s * 1e3:.1f} ms on the thread clock, of which ops {ops_s * 1e3:.1f} ms "
                 f"({sum(timer.calls.values())} calls); simulated nodes {sum(sim.values()) * 1e3:.1f} ms, "
                 f"simulated step {sim_step * 1e3:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--case", default="stationary", choices=[c.name for c in bench.CASES])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, caches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default=None, help="profile file (default: calibrate now, thread clock)")
    parser.add_argument("--top", type=int, default=25, help="op classes printed")
    args = parser.parse_args(argv)
    case = next(c for c in bench.CASES if c.name == args.case)
    bench.set_threads(args.threads)
    from socompile.data import ByteBatches, stdlib_corpus
    data = ByteBatches(stdlib_corpus(100_000), args.batch, args.seq, seed=0)
    batches = [next(data) for _ in range(args.warmup + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or bench.calibrated_profile_path(tmp, clock="cpu")
        print(bench.describe_profile(target))
        timer, step_s, ctx = measure(case, args.preset, target, batches, args.layers)
        sim, sim_nodes, sim_step = simulated_by_class(ctx)
    print(f"{args.preset} {case.name}, batch {args.batch} x seq {args.seq}, {args.threads} thread(s)")
    print("\n".join(report(timer, step_s, sim, sim_nodes, sim_step, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
