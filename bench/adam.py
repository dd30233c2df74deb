"""CPU Adam step, side by side: socompile_ext vs torch.optim.AdamW (fused, foreach) vs DeepSpeedCPUAdam vs
the machine's ceiling (a C pass with the step's loads and stores and no arithmetic).

    .venv/bin/python bench/adam.py                          # N = 16M and 128M, 1 and 64 tensors (a few minutes)
    .venv/bin/python bench/adam.py --sizes 4M --repeats 3   # quick
    .venv/bin/python bench/adam.py --deepspeed-python /tmp/dsvenv/bin/python   # DeepSpeed from another venv
    .venv/bin/python bench/adam.py --sizes 64M --tensors 1 --modes fp32 --repeats 15 \
        --methods "ours in-place;torch fused;deepspeed;ceiling in-place" --record socompile/hardware/cpu_adam_measured.json
        # the rates the planner and the ZeRO-Offload baseline use (docs/planner.md, "CPU Adam rates")

Configurations: N parameters as one tensor or as 64 tensors summing to N; "fp32" (fp32 grads) and "bf16"
(bf16 grads in, bf16 copy of the updated params out: what an offloaded mixed-precision step needs; a torch
user does this as grad.float() -> step -> param.to(bf16), so torch and DeepSpeed are timed with those casts).
Both move 28 bytes per parameter in one pass (fp32: read p g m v 16 B, write p m v 12 B; bf16: read 4+2+4+4,
write 4+4+4+2), and "GB/s" is 28 B * N / seconds, so the column compares methods directly; the "bf16 moments"
rows (socompile.AdamW(moment_dtype=torch.bfloat16): m and v stored in bf16, stochastically rounded) move 20 B,
and their "GB/s" counts those; the "int8 moments" rows (moment_dtype="int8": 16 one-byte codes + one fp32 scale
per 16 parameters and moment, stochastically rounded; regular stores) move 17 B (p 4R 4W, g 4R, m and v 1.25R
1.25W each), and their "GB/s" counts those.

Each method: `--warmup` untimed steps, then `--repeats` timed steps, the methods interleaved round-robin so
load from other processes falls on all alike; median and min-max of seconds per step. All methods step the
same buffers (128M params: ~8 GB in all, freed between configurations).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

if "--thp" in sys.argv:  # must be set before torch allocates anything: torch reads it in its CPU allocator
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The parts, each imported after THP_MEM_ALLOC_ENABLE is set: the methods timed, their timing, what is printed
# and what --record writes.
from bench.adam_methods import Problem, deepspeed_status, method_table, store_choices  # noqa: E402
from bench.adam_record import record_rates  # noqa: E402
from bench.adam_report import bytes_per_param, fmt_size, print_bytes_arithmetic, print_ratios, summary  # noqa: E402
from bench.adam_timing import QuietWait, measure  # noqa: E402


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16M,128M", help="comma-separated parameter counts (K/M/G suffixes)")
    ap.add_argument("--tensors", default="1,64", help="comma-separated tensor counts the N params are split into")
    ap.add_argument("--modes", default="fp32,bf16", help="fp32 (fp32 grads) and/or bf16 (bf16 grads + bf16 param out)")
    ap.add_argument("--repeats", type=int, default=9, help="timed steps per method (median and min-max reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (page faults, JIT, caches)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every method (torch, ours, OpenMP)")
    ap.add_argument("--deepspeed-python", default=os.environ.get("SOCOMPILE_DEEPSPEED_PYTHON"),
                    help="python of a venv where deepspeed imports and this torch is visible: when deepspeed does "
                         "not import here, the whole benchmark re-runs under that interpreter")
    ap.add_argument("--no-foreach", action="store_true", help="skip torch foreach (slowest, for quick runs)")
    ap.add_argument("--methods", default="",
                    help="';'-separated method names to keep (a trailing * matches a prefix), e.g. "
                         "\"ours in-place;ours ping-pong;torch fused;ceiling*\"")
    ap.add_argument("--extra", action="store_true",
                    help="also the rows of experiments that did not become defaults: static block schedule, software "
                         "prefetch of the input streams")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each round wait up to this many seconds for the CPUs to be >= 85%% idle (a shared "
                         "machine); the report says how many rounds started quiet")
    ap.add_argument("--record", default="",
                    help="write the measured CPU Adam rates (ours / ceiling, ZeRO-Offload's kernel / ours) of the largest "
                         "fp32 one-tensor configuration to this JSON file (socompile/hardware/cpu_adam_measured.json)")
    ap.add_argument("--thp", action="store_true",
                    help="THP_MEM_ALLOC_ENABLE=1: torch backs large tensors with 2 MB transparent huge pages (all methods)")
    args = ap.parse_args()

    ds_reason = deepspeed_status()
    # abspath, not realpath: a venv python is a symlink to the base interpreter (the re-run passes "")
    if ds_reason and args.deepspeed_python and os.path.abspath(args.deepspeed_python) != os.path.abspath(sys.executable):
        print(f"# deepspeed does not import here ({ds_reason}); re-running under {args.deepspeed_python}", flush=True)
        env = {**os.environ, "SOCOMPILE_DEEPSPEED_PYTHON": ""}
        argv = [args.deepspeed_python, __file__, *sys.argv[1:], "--deepspeed-python", ""]
        os.execve(args.deepspeed_python, argv, env)

    torch.set_num_threads(args.threads)
    quiet = QuietWait(max_wait=args.quiet_wait)
    import socompile_ext as se

    se.set_num_threads(args.threads)
    info = se.build_info()
    print(f"# socompile_ext {info['version']}: isa={info['isa']} (available {','.join(info['available_isas'])}), "
          f"threads={info['num_threads']}, gcc {info['compiler']}, flags: {info['compile_flags']}")
    print(f"# torch {torch.__version__} threads={torch.get_num_threads()} capability="
          f"{torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} CPUs; python {sys.executable}")
    print(f"# warmup={args.warmup} repeats={args.repeats}; methods interleaved round-robin per repeat; "
          f"huge pages: {'THP_MEM_ALLOC_ENABLE=1' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else 'off (4 KiB)'}")
    if ds_reason:
        print(f"# DeepSpeedCPUAdam: not measured: {ds_reason} (install it into a throwaway venv that sees this "
              f"torch, see docs/kernel.md, and pass --deepspeed-python)")

    methods = method_table(foreach=not args.no_foreach, deepspeed=not ds_reason, extra=args.extra)
    if args.methods:
        keep = [w.strip() for w in args.methods.split(";") if w.strip()]
        methods = [(name, make) for name, make in methods
                   if any(name == w or (w.endswith("*") and name.startswith(w[:-1])) for w in keep)]

    configs = [(parse_size(s), int(t), mode) for s in args.sizes.split(",") for t in args.tensors.split(",")
               for mode in args.modes.split(",")]
    load0 = os.getloadavg()[0]
    alltimes = {}
    print(f"\n{'N':>5} {'tensors':>7} {'mode':>4}  {'method':<36} {'median s':>9} {'min s':>9} {'max s':>9} {'GB/s':>6}")
    for k in configs:
        n, nt, mode = k
        pr = Problem(n, nt, mode)
        print(f"# store choice (first tensor): {store_choices(pr)}")
        times = measure(pr, methods, args.warmup, args.repeats, quiet)
        del pr
        gc.collect()
        for name, ts in times.items():
            label = name + (" + casts" if mode == "bf16" and name.split()[0] in ("torch", "deepspeed") else "")
            med, lo, hi, gbs = summary(ts, n, bytes_per_param(name))
            alltimes[(k, name)] = ts
            print(f"{fmt_size(n):>5} {nt:>7} {mode:>4}  {label:<36} {med:9.4f} {lo:9.4f} {hi:9.4f} {gbs:6.1f}", flush=True)
        print()

    print(f"# load average (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: "
          f"above ~0.5 other processes share the cores and the medians include their interference")
    if quiet.max_wait > 0:
        print(f"# --quiet-wait {quiet.max_wait:g}: {quiet.quiet_rounds} of {quiet.rounds} rounds started with "
              f"the CPUs >= {quiet.idle:.0%} idle (the rest after waiting {quiet.max_wait:g} s)")
    print()
    print_ratios(configs, alltimes)
    print_bytes_arithmetic(configs, alltimes)
    if args.record:
        record_rates(args.record, configs, alltimes, load0)


if __name__ == "__main__":
    main()
