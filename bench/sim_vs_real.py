"""Simulated vs measured step time on this machine, plan shape by plan shape.

    python bench/sim_vs_real.py [--presets tiny,small] [--cases stationary,flow] [--steps 12] [--warmup 3]

The "device" of a CPU-only build is this CPU (DESIGN section 5), so every plan shape the runtime supports runs
here for real: the simulator replays each compiled plan on the ``this-machine`` profile (measured by
``socompile.calibrate``, as ``python -m socompile calibrate`` does; by default right before each case, so that
its calibration sees the machine its steps run on) and the same compiled model, its loss inside the compiled
graph as the simulator assumes, trains for a few steps. Per case: the simulated step, the fastest and the median
measured step (with min-max over the timed steps; warm-up steps, which compile, are excluded), sim/real and
sim/median. sim/real is the simulated step over the *fastest* measured one, because calibration keeps the
fastest of its repetitions too: both then describe the machine with the least interference from other
processes. The last two lines are ``# sim/median step: min X max Y`` and ``sim/real: min X max Y``; the goal is
every sim/real within 0.8-1.25.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

import socompile
from socompile.data import ByteBatches, stdlib_corpus
from socompile.models import WithLMLoss, build
from socompile.tools.runtime_timeline import simulate_compiled

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


@dataclasses.dataclass(frozen=True)
class Case:
    """One plan shape: backend options, optimizer arguments and the model's dtype."""
    name: str
    options: dict
    optimizer: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.float32


CASES = (
    Case("stationary", {"weight_mode": "stationary", "gpu_buckets": 0}),
    Case("flow", {"weight_mode": "flow", "gpu_buckets": 0, "prefetch_distance": 1}),
    Case("gpu buckets", {"weight_mode": "stationary", "gpu_buckets": 2}),
    Case("separate master fp32", {"weight_mode": "stationary", "gpu_buckets": 0}, {"host_master": "separate"}),
    Case("separate master bf16", {"weight_mode": "stationary", "gpu_buckets": 0}, dtype=torch.bfloat16),
    Case("activation offload", {"weight_mode": "stationary", "gpu_buckets": 0, "activations": "offload"}),
    Case("grad accumulation x2", {"weight_mode": "stationary", "gpu_buckets": 0}, {"grad_accumulation_steps": 2}),
)
BUCKET_SIZE = {"tiny": "256KB", "small": "1MB"}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclasses.dataclass
class Result:
    case: str
    preset: str
    simulated: float
    measured: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.measured)

    @property
    def fastest(self) -> float:
        return min(self.measured)

    @property
    def ratio(self) -> float:
        """sim/real: against the fastest step (the module's docstring says why)."""
        return self.simulated / self.fastest

    @property
    def median_ratio(self) -> float:
        return self.simulated / self.median


def calibrated_profile_path(directory: str, as_gpu: bool = False, clock: str = "wall",
                            name: str = "this-machine") -> str:
    """Measure this machine now, on the clock the steps are timed on, and write the profile file ``name``.json
    the plans target (one per case with --calibrate per-case, else one for every case); the user's cached
    ``this-machine`` profile is left alone. ``as_gpu``: the model before CPU-only builds were modelled (a
    separate device, one FLOP rate for every dtype, no dispatch cost)."""
    from socompile.calibrate import calibrate
    from socompile.hardware.profiles import save_profile
    profile = calibrate(quick=True, clock=CLOCKS[clock])   # the clock the steps are timed on
    if as_gpu:
        profile = dataclasses.replace(profile, device_is_host=False, device_fp32_flops=0.0, device_op_latency=0.0,
                                      device_kernel_rates=(), cpu_grad_overhead=0.0, weight_fetch_overhead=0.0)
    return str(save_profile(profile, os.path.join(directory, f"{name}.json")))


def describe_profile(path: str) -> str:
    """The calibrated numbers the simulator charges by (a ratio far off is often a noisy calibration)."""
    from socompile.hardware.profiles import load_profile
    hw = load_profile(path)
    attention = {(r.kernel, r.dtype): r.rate for r in hw.device_kernel_rates if r.shape == (128, 32)}
    parts = [f"device bandwidth {hw.device_bandwidth / 1e9:.1f} GB/s", f"CPU Adam {hw.adam_bandwidth / 1e9:.1f} GB/s",
             f"matmul bf16 {hw.device_bf16_flops / 1e9:.0f} fp32 {hw.device_fp32_flops / 1e9:.0f} GFLOP/s",
             f"op latency {hw.device_op_latency * 1e6:.1f} us", f"copy hand-off {hw.link_latency * 1e6:.0f} us",
             f"per bucket {hw.cpu_bucket_overhead * 1e6:.0f} us + {hw.cpu_grad_overhead * 1e6:.0f} us per tensor",
             f"per flow fetch {hw.weight_fetch_overhead * 1e6:.0f} us",
             f"per offloaded tensor {hw.activation_offload_overhead * 1e6:.0f} us",
             f"bf16 elementwise x{hw.elementwise_slowdown('torch.bfloat16'):.2f}"]
    parts += [f"{family} {dtype[6:]} {hw.elementwise_rate(family, dtype) / 1e9:.1f} Gelem/s"
              for family in ("binary", "math", "reduction") for dtype in ("torch.float32", "torch.bfloat16")
              if hw.elementwise_rate(family, dtype)]
    parts += [f"{kernel} {dtype[6:]} {rate / 1e9:.1f}" for (kernel, dtype), rate in sorted(attention.items())]
    return "# profile: " + ", ".join(parts) + (" (attention GFLOP/s at 128 x 32)" if attention else "")


def set_threads(threads: int) -> None:
    """The compute's and the CPU Adam kernel's threads (calibration measures with the same)."""
    torch.set_num_threads(threads)
    import socompile_ext
    socompile_ext.set_num_threads(threads)


def load_average() -> float:
    return os.getloadavg()[0]


def simulated_step(ctx, micro_batches: int = 1) -> float:
    """The simulator's step of a compiled graph pair's plan, on the profile it was planned for. With gradient
    accumulation the step runs ``micro_batches`` forward/backward passes: the replayed step is the last one (its
    gradients are stepped), each earlier one costs a forward and a backward (up to the backward's end: its
    gradients are added into the buckets, not stepped)."""
    sim = simulate_compiled(ctx)
    return sim.step_time + (micro_batches - 1) * sim.backward_end


def compile_case(case: Case, preset: str, target: str, compute: str = "eager", layers: int | None = None):
    """(compiled model-with-loss, optimizer, backend) of one case on the profile file ``target``."""
    torch.manual_seed(0)
    model = build(preset, **({"n_layers": layers} if layers else {})).to(case.dtype)
    opt = socompile.AdamW(model.parameters(), **HYPER, **case.optimizer)
    backend = socompile.SuperOffload({"target": target, "bucket_size": BUCKET_SIZE.get(preset, "1MB"),
                                      "compute": compute, **case.options})
    return torch.compile(WithLMLoss(model), backend=backend), opt, backend


def run_case(case: Case, preset: str, target: str, batches, warmup: int, compute: str = "inductor",
             layers: int | None = None, clock: str = "wall") -> Result:
    """Compile ``preset`` with the case's options, train on ``batches``; the step of each timed batch group."""
    cmodel, opt, backend = compile_case(case, preset, target, compute, layers)
    micro = opt.grad_accumulation_steps
    times = []
    now = CLOCKS[clock]
    for i in range(0, len(batches) - micro + 1, micro):
        start = now()
        for x, y in batches[i:i + micro]:
            cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
        if i // micro >= warmup:
            times.append(now() - start)
    sim = simulated_step(backend.compiled[0], micro)
    torch._dynamo.reset()
    return Result(case.name, preset, sim, times)


def format_row(r: Result) -> str:
    return (f"{r.preset:6s} {r.case:22s} {r.simulated * 1e3:9.2f} {r.fastest * 1e3:9.2f} {r.median * 1e3:9.2f} "
            f"{f'({min(r.measured) * 1e3:.1f}-{max(r.measured) * 1e3:.1f})':>16s} {r.median_ratio:7.2f} "
            f"{r.ratio:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names (default: all)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, caches)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--target", default=None, help="profile file to plan for (default: calibrate now)")
    parser.add_argument("--compute", default="eager", choices=["inductor", "eager"],
                        help="eager (default) runs one kernel per graph node, as the simulator charges them; "
                        "inductor fuses nodes (fewer, larger kernels) and compiles for minutes")
    parser.add_argument("--layers", type=int, default=None, help="override the presets' layer count")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="compute and CPU Adam threads")
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                        help="wall: seconds per step; cpu: CPU seconds of this process per step (every thread), "
                        "which with --threads 1 is the step of an idle machine even when others share the cores")
    parser.add_argument("--calibrate", default="per-case", choices=["per-case", "once"],
                        help="per-case: measure the machine right before each case (its calibration sees the load "
                        "its steps see); once: one profile for every case (ignored with --target)")
    parser.add_argument("--as-gpu", action="store_true",
                        help="simulate the device as a separate GPU (the model before CPU-only builds were modelled)")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    unknown = set(args.cases.split(",")) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in CASES)}")
    set_threads(args.threads)
    start_load = load_average()
    source = f"from {args.target}" if args.target else ("calibrated now" if args.calibrate == "once"
                                                         else "calibrated before each case")
    print(f"batch {args.batch} x seq {args.seq}, compute {args.compute}, {args.threads} threads, {args.clock} clock, "
          f"{args.steps} timed steps after {args.warmup} warm-up; profile {source}"
          f"{' (as a separate GPU)' if args.as_gpu else ''}")
    print(f"{'preset':6s} {'case':22s} {'sim ms':>9s} {'fast ms':>9s} {'med ms':>9s} {'(min-max)':>16s} "
          f"{'sim/med':>7s} {'ratio':>6s}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        shared = args.target or (calibrated_profile_path(tmp, args.as_gpu, args.clock)
                                 if args.calibrate == "once" else None)
        if shared:
            print(describe_profile(shared), flush=True)
        for preset in args.presets.split(","):
            data = ByteBatches(stdlib_corpus(400_000), args.batch, args.seq, seed=0)
            for n, case in enumerate(chosen):
                micro = case.optimizer.get("grad_accumulation_steps", 1)
                batches = [next(data) for _ in range((args.warmup + args.steps) * micro)]
                target = shared
                if target is None:   # a file per case: each compile plans for its own measurement
                    target = calibrated_profile_path(tmp, args.as_gpu, args.clock, f"this-machine-{preset}-{n}")
                    print(describe_profile(target), flush=True)
                results.append(run_case(case, preset, target, batches, args.warmup, args.compute, args.layers,
                                        args.clock))
                print(format_row(results[-1]), flush=True)
    print(f"# load average (1 min) at start {start_load:.2f}, at end {load_average():.2f} on {os.cpu_count()} CPUs: "
          f"above ~0.5 other processes share the cores")
    medians = [r.median_ratio for r in results]
    print(f"# sim/median step: min {min(medians):.2f} max {max(medians):.2f}")
    ratios = [r.ratio for r in results]
    print(f"sim/real: min {min(ratios):.2f} max {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
