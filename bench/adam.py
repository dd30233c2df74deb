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
PREFETCH_ROW = 1024  # elements ahead for the "prefetch" rows (4 KiB of each fp32 stream)
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

def with_stores(policy, run):
    """Run a method under one store policy of the kernel (auto: streaming stores for separate outputs of at
    least 128K elements; regular; streaming: every output, in-place ones too), then restore auto."""
    import socompile_ext as se

    if policy == "auto":
        return run

    def wrapped():
        se.set_store_policy(policy)
        try:
            run()
        finally:
            se.set_store_policy("auto")

    return wrapped


def with_prefetch(elems, run):
    """Run a method with the AVX-512 path's software prefetch of the input streams `elems` elements ahead."""
    from socompile_ext import _adam

    def wrapped():
        before = _adam.get_prefetch()
        _adam.set_prefetch(elems)
        try:
            run()
        finally:
            _adam.set_prefetch(before)

    return wrapped


def with_static_schedule(run):
    """Run a method with the kernel's static block schedule (contiguous range per thread) instead of dynamic."""
    from socompile_ext import _adam

    def wrapped():
        _adam.set_dynamic_schedule(False)
        try:
            run()
        finally:
            _adam.set_dynamic_schedule(True)

    return wrapped


def make_ours(pr, pingpong, per_tensor_calls=False):
    """One adam_step_multi call for all tensors (one parallel region), or, with per_tensor_calls, one
    adam_step call per tensor (what a loop over parameters does; None for one tensor: the same thing)."""
    import socompile_ext as se

    if per_tensor_calls and pr.ntensors == 1:
        return None
    state = [[p.detach() for p in pr.p], list(pr.m), list(pr.v)]
    other = [[a[0] for a in pr.alt], [a[1] for a in pr.alt], [a[2] for a in pr.alt]]
    step = [0]
    kw = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])

    def run():
        step[0] += 1
        outs = dict(params_out=other[0], exp_avgs_out=other[1], exp_avg_sqs_out=other[2]) if pingpong else {}
        if per_tensor_calls:
            for i in range(pr.ntensors):
                pp = dict(param_out=other[0][i], exp_avg_out=other[1][i], exp_avg_sq_out=other[2][i]) if pingpong else {}
                se.adam_step(state[0][i], pr.g[i], state[1][i], state[2][i], step=step[0], **kw, **pp,
                             param_bf16_out=pr.p16[i])
        else:
            se.adam_step_multi(state[0], pr.g, state[1], state[2], step=step[0], **kw, **outs, params_bf16_out=pr.p16)
        if pingpong:  # validation passed: B becomes the current state
            state[:], other[:] = other[:], state[:]

    return run


def make_ceiling(pr, pingpong):
    import socompile_ext as se

    params = [p.detach() for p in pr.p]
    outs = [[a[j] for a in pr.alt] for j in range(3)] if pingpong else [None, None, None]

    def run():
        se._copy_ceiling_multi(params, pr.g, pr.m, pr.v, *outs, params_bf16_out=pr.p16)

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


def cpu_idle(window=0.25):
    """Fraction of all CPUs' time idle over the next `window` seconds (/proc/stat; None where absent)."""
    def read():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals[:8])  # idle + iowait, total (without guest columns)
    try:
        i0, t0 = read()
        time.sleep(window)
        i1, t1 = read()
    except OSError:
        return None
    return (i1 - i0) / max(t1 - t0, 1)


QUIET = {"max_wait": 0.0, "idle": 0.85, "rounds": 0, "quiet_rounds": 0}


def wait_quiet():
    """With --quiet-wait S: before a round, wait up to S seconds for the CPUs to be >= 85% idle (other
    processes' work shows up there; their memory traffic does). Counts the rounds that started quiet."""
    if QUIET["max_wait"] <= 0:
        return
    end = time.monotonic() + QUIET["max_wait"]
    while True:
        idle = cpu_idle()
        if idle is None or idle >= QUIET["idle"]:
            QUIET["quiet_rounds"] += 1
            break
        if time.monotonic() >= end:
            break
    QUIET["rounds"] += 1


def measure(pr, methods, warmup, repeats):
    """Methods interleaved round-robin, one step each per round, so load from other processes on the
    machine falls on all of them alike. Returns {name: [seconds per step]}."""
    fns = {}
    for name, make in methods:
        fn = make(pr)
        if fn is None:  # not applicable to this configuration
            continue
        fns[name] = fn
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        wait_quiet()
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
    QUIET["max_wait"] = args.quiet_wait
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

    # "ours"/"ceiling" rows use the kernel's automatic store choice (printed per configuration); the rows
    # marked "regular stores" / "streaming stores" force one policy, to show what the choice is worth
    ours = lambda pp, pol="auto": lambda pr: with_stores(pol, make_ours(pr, pp))  # noqa: E731
    ceil = lambda pp, pol="auto": lambda pr: with_stores(pol, make_ceiling(pr, pp))  # noqa: E731
    methods = [("ours in-place", ours(False)), ("ours in-place, streaming", ours(False, "streaming")),
               ("ours in-place, 1 call per tensor", lambda pr: make_ours(pr, False, per_tensor_calls=True)),

               ("ours in-place, regular", lambda pr: None if pr.mode == "fp32" else with_stores("regular", make_ours(pr, False))),
               ("ours ping-pong", ours(True)), ("ours ping-pong, regular", ours(True, "regular")),
               ("torch fused", lambda pr: make_torch(pr, "fused"))]
    if not args.no_foreach:
        methods.append(("torch foreach", lambda pr: make_torch(pr, "foreach")))
    if not ds_reason:
        methods.append(("deepspeed", make_deepspeed))
    methods += [("ceiling in-place", ceil(False)), ("ceiling in-place, streaming", ceil(False, "streaming")),

                ("ceiling ping-pong", ceil(True)), ("ceiling ping-pong, regular", ceil(True, "regular"))]
    if args.extra:  # experiments that did not become defaults (see docs/kernel.md)
        methods += [("ours in-place, static schedule", lambda pr: with_static_schedule(make_ours(pr, False))),
                    ("ours in-place, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ours(pr, False))),
                    ("ours ping-pong, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ours(pr, True))),
                    ("ceiling in-place, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ceiling(pr, False))),
                    ("ceiling ping-pong, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ceiling(pr, True)))]
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
        times = measure(pr, methods, args.warmup, args.repeats)
        del pr
        gc.collect()
        for name, ts in times.items():
            label = name + (" + casts" if mode == "bf16" and name.split()[0] in ("torch", "deepspeed") else "")
            med, lo, hi, gbs = summary(ts, n)
            alltimes[(k, name)] = ts
            print(f"{fmt_size(n):>5} {nt:>7} {mode:>4}  {label:<36} {med:9.4f} {lo:9.4f} {hi:9.4f} {gbs:6.1f}", flush=True)
        print()

    print(f"# load average (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: "
          f"above ~0.5 other processes share the cores and the medians include their interference")
    if QUIET["max_wait"] > 0:
        print(f"# --quiet-wait {QUIET['max_wait']:g}: {QUIET['quiet_rounds']} of {QUIET['rounds']} rounds started with "
              f"the CPUs >= {QUIET['idle']:.0%} idle (the rest after waiting {QUIET['max_wait']:g} s)")
    print()
    print_ratios(configs, alltimes)
    print_bytes_arithmetic(configs, alltimes)
    if args.record:
        record_rates(args.record, configs, alltimes, load0)


def store_choices(pr):
    """What the kernel's automatic store policy picks for this configuration's first tensor, within the one
    adam_step_multi call over all the configuration's tensors that "ours" makes."""
    import socompile_ext as se

    p, g, m, v = pr.p[0].detach(), pr.g[0], pr.m[0], pr.v[0]
    inpl = se.store_choice(p, g, m, v, param_bf16_out=pr.p16[0], call_numel=pr.n)
    pp = se.store_choice(p, g, m, v, param_out=pr.alt[0][0], exp_avg_out=pr.alt[0][1], exp_avg_sq_out=pr.alt[0][2],
                         param_bf16_out=pr.p16[0], call_numel=pr.n)
    word = lambda c: ("streaming" if c["state"] else "regular") + (  # noqa: E731
        f" (bf16 copy: {'streaming' if c['bf16'] else 'regular'})" if pr.p16[0] is not None else "")
    return f"in-place {word(inpl)}; ping-pong {word(pp)}"


# Ratios: the methods run round-robin, so round i of every method saw about the same machine load. Each
# ratio is therefore taken per round (time_a[i] / time_b[i]) and summarised by its median and quartiles.
RATIOS = [  # (label, numerator method, denominator method): > 1 means the denominator is faster
    ("ours in-place / ceiling (regular stores) [ceiling fraction]", "ceiling in-place", "ours in-place"),
    ("ours in-place / ceiling with streaming stores", "ceiling in-place, streaming", "ours in-place"),
    ("ceiling streaming vs regular stores, in-place", "ceiling in-place", "ceiling in-place, streaming"),
    ("ours streaming vs auto stores, in-place", "ours in-place", "ours in-place, streaming"),
    ("bf16 copy streamed (auto) vs regular stores, in-place", "ours in-place, regular", "ours in-place"),
    ("ours ping-pong / ping-pong ceiling", "ceiling ping-pong", "ours ping-pong"),
    ("ours vs torch fused", "torch fused", "ours in-place"),
    ("ours vs torch foreach", "torch foreach", "ours in-place"),
    ("ours vs DeepSpeedCPUAdam", "deepspeed", "ours in-place"),
    ("ours, 1 call per tensor vs DeepSpeedCPUAdam", "deepspeed", "ours in-place, 1 call per tensor"),
    ("one multi-tensor call vs 1 call per tensor", "ours in-place, 1 call per tensor", "ours in-place"),
    ("dynamic vs static block schedule", "ours in-place, static schedule", "ours in-place"),
    ("software prefetch vs none, in-place", "ours in-place", "ours in-place, prefetch"),
    ("software prefetch vs none, ping-pong", "ours ping-pong", "ours ping-pong, prefetch"),
    ("software prefetch vs none, ceiling in-place", "ceiling in-place", "ceiling in-place, prefetch"),
    ("software prefetch vs none, ceiling ping-pong", "ceiling ping-pong", "ceiling ping-pong, prefetch"),
    ("ping-pong with prefetch vs in-place with prefetch", "ours in-place, prefetch", "ours ping-pong, prefetch"),
    ("ping-pong vs in-place (ours)", "ours in-place", "ours ping-pong"),
    ("ping-pong vs in-place (ceiling)", "ceiling in-place", "ceiling ping-pong"),
    ("ping-pong: streaming (auto) vs regular stores", "ours ping-pong, regular", "ours ping-pong"),
    ("ours ping-pong vs torch fused (in-place)", "torch fused", "ours ping-pong"),
    ("ours ping-pong vs DeepSpeedCPUAdam", "deepspeed", "ours ping-pong"),
]


def paired(alltimes, k, num, den):
    if (k, num) not in alltimes or (k, den) not in alltimes:
        return None
    rs = sorted(a / b for a, b in zip(alltimes[(k, num)], alltimes[(k, den)]))
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0], rs[0], rs[0]]
    return statistics.median(rs), q[0], q[2], rs[0], rs[-1]


def print_ratios(configs, alltimes):
    """Per-round paired ratios, then the goals of issue 3 on their medians."""
    print("Paired ratios (per round, time_numerator / time_denominator; > 1: the second-named side is faster): "
          "median [quartiles] (min-max)")
    goals = []
    for k in configs:
        n, nt, mode = k
        tag = f"{fmt_size(n)} x{nt} {mode}"
        for label, num, den in RATIOS:
            r = paired(alltimes, k, num, den)
            if r is not None:
                print(f"  {tag:<14} {label:<62} {r[0]:5.2f} [{r[1]:.2f}-{r[2]:.2f}] ({r[3]:.2f}-{r[4]:.2f})")
        get = lambda num, den: (paired(alltimes, k, num, den) or [None])[0]  # noqa: E731
        if mode == "fp32" and n >= 128 << 20:
            goals.append((f"{tag}: ours >= 95% of ceiling", get("ceiling in-place", "ours in-place"), 0.95))
            goals.append((f"{tag}: ours >= 1.1x torch fused", get("torch fused", "ours in-place"), 1.1))
        if mode == "bf16":
            goals.append((f"{tag}: ours >= 1.8x torch fused + casts", get("torch fused", "ours in-place"), 1.8))
        goals.append((f"{tag}: ping-pong no slower than in-place (within 3% noise)",
                      get("ours in-place", "ours ping-pong"), 0.97))
        goals.append((f"{tag}: never slower than DeepSpeedCPUAdam", get("deepspeed", "ours in-place"), 1.0))
        print()
    print("Goals (issue 3), on the medians of the paired ratios")
    for text, value, goal in goals:
        state = "n/a " if value is None else ("PASS" if value >= goal else "MISS")
        shown = "not measured" if value is None else f"{value:.2f} (goal >= {goal})"
        print(f"  [{state}] {text}: {shown}")


# Bytes per parameter that each method must move through DRAM at 128M params (nothing stays in cache). A
# regular store to a line that is not in cache first reads it (read-for-ownership, RFO), a streaming store
# does not; a store to a line the same pass just read needs no extra read.
TORCH_CASTS_BYTES = {
    "cast grads bf16 -> fp32 .grad (read 2, write 4, RFO 4)": 10,
    "fused AdamW, in place (read 16, write 12)": 28,
    "cast params fp32 -> bf16 copy (read 4, write 2, RFO 2)": 8,
}


def print_bytes_arithmetic(configs, alltimes):
    torch_b = sum(TORCH_CASTS_BYTES.values())
    print("\nBytes per parameter behind the goals (DRAM traffic at sizes far above the caches)")
    print(f"  fp32 in place: ours 28 B = torch fused 28 B = the ceiling's 28 B. At equal bandwidth the best possible "
          f"ratio is 28/28 = 1.00x; 1.1x over a torch that runs at the ceiling needs <= 28/1.1 = 25.5 B/param, "
          f"less than the step's own reads and writes.")
    print("  bf16 grads in, bf16 param copy out: ours 28 B (read p 4, g 2, m 4, v 4; write p m v 12, bf16 copy 2 "
          "streamed, no RFO); torch fused + casts " + " + ".join(f"{b}" for b in TORCH_CASTS_BYTES.values())
          + f" = {torch_b} B:")
    for text, b in TORCH_CASTS_BYTES.items():
        print(f"      {b:2d} B  {text}")
    print(f"    best possible ratio at equal bandwidth {torch_b}/28 = {torch_b / 28:.2f}x (without the RFOs "
          f"{torch_b - 6}/28 = {(torch_b - 6) / 28:.2f}x); 1.8x would need ours <= {torch_b / 1.8:.1f} B/param.")
    for k in configs:
        n, nt, mode = k
        r = paired(alltimes, k, "torch fused", "ceiling in-place")
        if mode == "bf16" and r is not None:
            print(f"    {fmt_size(n)} x{nt}: torch fused + casts took {r[0]:.2f}x the 28-B ceiling pass, i.e. it moved "
                  f"~{28 * r[0]:.0f} B/param at ceiling speed")


def _ratio_entry(alltimes, k, num, den) -> dict:
    """A paired ratio as stored: median and quartiles over the rounds."""
    median, q1, q3, _, _ = paired(alltimes, k, num, den)
    return {"median": round(median, 4), "quartiles": [round(q1, 4), round(q3, 4)]}


def _own_arguments(argv):
    """The command line as the user typed it (without the '--deepspeed-python ""' the re-run appends)."""
    return argv[:-2] if argv[-2:] == ["--deepspeed-python", ""] else argv


def record_rates(path, configs, alltimes, load0):
    """Store what socompile.hardware.cpu_adam reads: on the largest fp32 one-tensor configuration (ZeRO-Offload
    steps one flat fp32 partition with fp32 gradients; its casts are separate passes the simulator charges),
    ours' fraction of the streaming ceiling and the ZeRO-Offload kernel's bandwidth relative to ours, with
    DeepSpeedCPUAdam as that kernel when it ran, else torch's fused AdamW as a labelled stand-in."""
    import datetime
    import json
    import platform
    import shlex

    fp32_one = [k for k in configs if k[1] == 1 and k[2] == "fp32" and (k, "ours in-place") in alltimes
                and (k, "ceiling in-place") in alltimes]
    if not fp32_one:
        raise SystemExit("--record needs an fp32 configuration with --tensors 1 and the methods 'ours in-place' "
                         "and 'ceiling in-place'")
    k = max(fp32_one)
    baseline = "deepspeed" if (k, "deepspeed") in alltimes else "torch fused"
    if (k, baseline) not in alltimes:
        raise SystemExit("--record needs 'deepspeed' or 'torch fused' among the methods")
    if baseline == "deepspeed":
        import deepspeed
        kernel = f"DeepSpeedCPUAdam (DeepSpeed {deepspeed.__version__}, its JIT-built CPU op)"
    else:
        kernel = (f"torch {torch.__version__} AdamW(fused=True), a stand-in: DeepSpeed did not run here "
                  f"(pass --deepspeed-python)")
    gbs = {name: round(summary(alltimes[(k, name)], k[0])[3], 2)
           for name in ("ours in-place", "ceiling in-place", "torch fused", "deepspeed") if (k, name) in alltimes}
    data = {
        "ours_of_ceiling": _ratio_entry(alltimes, k, "ceiling in-place", "ours in-place"),
        "baseline_of_ours": _ratio_entry(alltimes, k, "ours in-place", baseline),
        "torch_fused_of_ours": (_ratio_entry(alltimes, k, "ours in-place", "torch fused")
                                if (k, "torch fused") in alltimes else None),
        "baseline_kernel": kernel,
        "median_gb_per_s": gbs,
        "params": k[0], "rounds": len(alltimes[(k, "ours in-place")]),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch CPU capability "
                   f"{torch.backends.cpu.get_cpu_capability()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}",
        "command": shlex.join(["python", "bench/adam.py", *_own_arguments(sys.argv[1:])]),
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"\nrecorded to {path}: ours {data['ours_of_ceiling']['median']:.2f} of the ceiling; ZeRO-Offload's kernel "
          f"({baseline}) {data['baseline_of_ours']['median']:.2f} of ours")


if __name__ == "__main__":
    main()
