"""CPU Adam step, side by side: socompile_ext vs torch.optim.AdamW (fused, foreach) vs DeepSpeedCPUAdam vs
the machine's ceiling (a C pass with the step's loads and stores and no arithmetic).

    .venv/bin/python bench/adam.py                          # N = 16M and 128M, 1 and 64 tensors (a few minutes)
    .venv/bin/python bench/adam.py --sizes 4M --repeats 3   # quick
    .venv/bin/python bench/adam.py --deepspeed-python /tmp/dsvenv/bin/python   # DeepSpeed from another venv

Configurations: N parameters as one tensor or as 64 tensors summing to N; "fp32" (fp32 grads) and "bf16"
(bf16 grads in, bf16 copy of the updated params out: what an offloaded mixed-precision step needs; a torch
user does this as grad.float() -> step -> param.to(bf16), so torch and DeepSpeed are timed with those casts).
Both move 28 bytes per parameter in one pass (fp32: read p g m v 16 B, write p m v 12 B; bf16: read 4+2+4+4,
write 4+4+4+2), and "GB/s" is always 28 B * N / seconds, so the column compares methods directly.

Each method: `--warmup` untimed steps, then `--repeats` timed steps, the methods interleaved round-robin so
load from other processes falls on all alike; median and min-max of seconds per step. All methods step the
same buffers (128M params: ~8 GB in all, freed between configurations).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if "--thp" in sys.argv:  # must be set before torch allocates anything: torch reads it in its CPU allocator
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BYTES_PER_PARAM = 28
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def chunks(n, k):
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def filled(numel, lo=-1.0, hi=1.0, dtype=torch.float32):
    return torch.empty(numel, dtype=dtype).uniform_(lo, hi)


class Problem:
    """Parameters, gradients and moments of one configuration, shared by every method (each method steps
    the same buffers; the values only drift, which does not change the timing)."""

    def __init__(self, n, ntensors, mode):
        sizes = chunks(n, ntensors)
        self.n, self.ntensors, self.mode = n, ntensors, mode
        gdt = torch.bfloat16 if mode == "bf16" else torch.float32
        self.p = [filled(s).requires_grad_() for s in sizes]
        self.g = [filled(s, -1e-2, 1e-2).to(gdt) for s in sizes]
        self.m = [torch.zeros(s) for s in sizes]
        self.v = [torch.zeros(s) for s in sizes]
        self.p16 = [torch.zeros(s, dtype=torch.bfloat16) for s in sizes] if mode == "bf16" else [None] * ntensors
        # state "B" for ping-pong, shared by ours and the ceiling; zero-filled so page faults are not timed
        self.alt = [(torch.zeros(s), torch.zeros(s), torch.zeros(s)) for s in sizes]
        # the fp32 .grad buffers torch and DeepSpeed read: the grads themselves, or buffers the casts fill
        self.g32 = self.g if mode == "fp32" else [torch.zeros(s) for s in sizes]


# ------------------------------------------------------------------ the methods (each returns a step function)

def make_ours(pr, pingpong):
    import socompile_ext as se

    cur = [(p.detach(), m, v) for p, m, v in zip(pr.p, pr.m, pr.v)]
    other = list(pr.alt)
    step = [0]
    kw = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])

    def run():
        step[0] += 1
        for i in range(pr.ntensors):
            (p, m, v), (po, mo, vo) = cur[i], other[i]
            if pingpong:
                se.adam_step(p, pr.g[i], m, v, step=step[0], **kw, param_out=po, exp_avg_out=mo, exp_avg_sq_out=vo,
                             param_bf16_out=pr.p16[i])
                cur[i], other[i] = other[i], cur[i]  # validation passed: B becomes the current state
            else:
                se.adam_step(p, pr.g[i], m, v, step=step[0], **kw, param_bf16_out=pr.p16[i])

    return run


def make_ceiling(pr, pingpong):
    import socompile_ext as se

    params = [p.detach() for p in pr.p]

    def run():
        for i in range(pr.ntensors):
            outs = pr.alt[i] if pingpong else (None, None, None)
            se._copy_ceiling(params[i], pr.g[i], pr.m[i], pr.v[i], *outs, param_bf16_out=pr.p16[i])

    return run


def _with_casts(pr, step_fn):
    """A torch user's mixed-precision step: bf16 grads -> fp32 .grad, fp32 step, fp32 params -> bf16 copy."""
    detached = [p.detach() for p in pr.p]

    def run():
        for p, g in zip(pr.p, pr.g32):
            p.grad = g
        with torch.no_grad():
            if pr.mode == "bf16":
                torch._foreach_copy_(pr.g32, pr.g)
            step_fn()
            if pr.mode == "bf16":
                torch._foreach_copy_(pr.p16, detached)

    return run


def make_torch(pr, impl):
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    return _with_casts(pr, torch.optim.AdamW(pr.p, **HP, **kw).step)


def make_deepspeed(pr):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(pr.p, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"],
                           adamw_mode=True)
    return _with_casts(pr, opt.step)


def deepspeed_status():
    """None when DeepSpeedCPUAdam can be used here, else the reason."""
    try:
        import deepspeed.ops.adam  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def measure(pr, methods, warmup, repeats):
    """Methods interleaved round-robin, one step each per round, so load from other processes on the
    machine falls on all of them alike. Returns {name: [seconds per step]}."""
    fns = {}
    for name, make in methods:
        fns[name] = make(pr)
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------ report

def fmt_size(n):
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def summary(times, n):
    med = statistics.median(times)
    return med, min(times), max(times), BYTES_PER_PARAM * n / med / 1e9


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

    methods = [("ours in-place", lambda pr: make_ours(pr, False)), ("ours ping-pong", lambda pr: make_ours(pr, True)),
               ("torch fused", lambda pr: make_torch(pr, "fused"))]
    if not args.no_foreach:
        methods.append(("torch foreach", lambda pr: make_torch(pr, "foreach")))
    if not ds_reason:
        methods.append(("deepspeed", make_deepspeed))
    methods += [("ceiling in-place", lambda pr: make_ceiling(pr, False)),
                ("ceiling ping-pong", lambda pr: make_ceiling(pr, True))]

    configs = [(parse_size(s), int(t), mode) for s in args.sizes.split(",") for t in args.tensors.split(",")
               for mode in args.modes.split(",")]
    load0 = os.getloadavg()[0]
    results, best = {}, {}
    print(f"\n{'N':>5} {'tensors':>7} {'mode':>4}  {'method':<26} {'median s':>9} {'min s':>9} {'max s':>9} {'GB/s':>6}")
    for k in configs:
        n, nt, mode = k
        pr = Problem(n, nt, mode)
        times = measure(pr, methods, args.warmup, args.repeats)
        del pr
        gc.collect()
        for name, ts in times.items():
            label = name + (" + casts" if mode == "bf16" and name.split()[0] in ("torch", "deepspeed") else "")
            med, lo, hi, gbs = summary(ts, n)
            results[(k, name)] = med
            best[(k, name)] = lo
            print(f"{fmt_size(n):>5} {nt:>7} {mode:>4}  {label:<26} {med:9.4f} {lo:9.4f} {hi:9.4f} {gbs:6.1f}", flush=True)
        print()

    print(f"# load average (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: "
          f"above ~0.5 other processes share the cores and the medians include their interference\n")
    print_ratios(configs, best, "min (best-of-repeats: what the code can do when no other process interferes)",
                 verdicts=False)
    print()
    print_ratios(configs, results, "median (as the goals are stated)")


def print_ratios(configs, r, basis, verdicts=True):
    """Ratios last, against the goals of issue 3 (speed ratios are time_other / time_ours: >1 means ours is faster)."""
    print(f"Ratios of {basis} times (ceiling fraction = time_ceiling / time_ours; speed-ups = time_other / time_ours)")
    hdr = (f"{'N':>5} {'tens':>4} {'mode':>4}  {'ours/ceil':>9} {'pp/ceil-pp':>10} {'vs fused':>8} "
           f"{'vs foreach':>10} {'vs DS':>6} {'pp vs inpl':>10}")
    print(hdr)
    goals = []
    for k in configs:
        n, nt, mode = k
        ours, pp = r[(k, "ours in-place")], r[(k, "ours ping-pong")]

        def ratio(name, base=ours):
            return r[(k, name)] / base if (k, name) in r else None

        c, cpp, f, fe, d = (ratio("ceiling in-place"), ratio("ceiling ping-pong", pp), ratio("torch fused"),
                            ratio("torch foreach"), ratio("deepspeed"))
        ppv = ours / pp
        cell = lambda x, w: f"{x:{w}.2f}" if x is not None else f"{'n/a':>{w}}"  # noqa: E731
        print(f"{fmt_size(n):>5} {nt:>4} {mode:>4}  {cell(c, 9)} {cell(cpp, 10)} {cell(f, 8)} {cell(fe, 10)} "
              f"{cell(d, 6)} {cell(ppv, 10)}")
        if mode == "fp32" and n >= 128 << 20:
            goals.append((f"{fmt_size(n)} x{nt} fp32: ours >= 95% of ceiling", c, 0.95))
            goals.append((f"{fmt_size(n)} x{nt} fp32: ours >= 1.1x torch fused", f, 1.1))
        if mode == "bf16":
            goals.append((f"{fmt_size(n)} x{nt} bf16: ours >= 1.8x torch fused + casts", f, 1.8))
        goals.append((f"{fmt_size(n)} x{nt} {mode}: ping-pong no slower than in-place (within 3% noise)", ppv, 0.97))
        goals.append((f"{fmt_size(n)} x{nt} {mode}: never slower than DeepSpeedCPUAdam", d, 1.0))
    if not verdicts:
        return
    print("\nGoals (issue 3), on median times")
    for text, value, goal in goals:
        state = "n/a " if value is None else ("PASS" if value >= goal else "MISS")
        shown = "not measured" if value is None else f"{value:.2f} (goal >= {goal})"
        print(f"  [{state}] {text}: {shown}")


if __name__ == "__main__":
    main()
