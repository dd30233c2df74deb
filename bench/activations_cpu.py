"""Per-layer activations on this CPU: what autograd saves for one forward, and the step time, per choice.

    python bench/activations_cpu.py [--layers 4] [--batch 8] [--seq 128] [--steps 6] [--compute eager]

Rows: keep, recompute, offload (every repeated layer), and a mix (even layers recompute, odd layers offload).
"saved device MB" is what autograd holds between forward and backward on the device (on this build the CPU,
but outside the runtime's host copies), parameters left out; "host MB" the offloaded host copies; "in flight
peak MB" the ledger's peak of offloaded activations with a copy pending. Step time: median and minimum wall time
of ``--steps`` steps after two warm-up steps (forward, backward, socompile.AdamW step), and the median CPU time of
the process per step (all threads: the copies run on the "activations" stream's thread), which other jobs on a
shared machine disturb less than wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import socompile
from socompile.models import build
from socompile.runtime.activation_offload import IN_FLIGHT


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def measure(choice: str, args) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("tiny", n_layers=args.layers)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="1MB")
    options = {"compute": args.compute, "gpu_buckets": 0, "bucket_size": "1MB"}
    if choice == "mix":
        options["activation_layers"] = {f"layers.{i}": ("recompute" if i % 2 == 0 else "offload")
                                        for i in range(args.layers)}
    else:
        options["activations"] = choice
    backend = socompile.SuperOffload(options)
    cmodel = torch.compile(model, backend=backend)
    x = torch.randint(0, 256, (args.batch, args.seq))
    y = torch.randint(0, 256, (args.batch, args.seq))

    def step():
        _loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    ctx = backend.compiled[0]
    rt = ctx.activation_offload
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = cmodel(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    acts = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    is_host = (lambda t: rt.is_host_copy(t)) if rt is not None else (lambda t: False)
    device = sum(t.numel() * t.element_size() for t in acts if not is_host(t))
    host = sum(t.numel() * t.element_size() for t in acts if is_host(t))
    n_saved = len(acts)
    ledger = ctx.offload.ledger
    ledger.reset_peak()
    _loss(out, y).backward()
    opt.step()
    opt.zero_grad()
    # Drop the saved tensors before timing. clear(), not del: the hook above closes over `saved`, and a deleted
    # closure variable is an undefined name to pyflakes.
    saved.clear()
    del acts, out
    in_flight_peak = ledger.summary()["peak_parts"].get(IN_FLIGHT, 0)
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"choice": choice, "tensors": n_saved, "device": device, "host": host,
            "in_flight": in_flight_peak, "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times), "cpu_ms": 1e3 * statistics.median(cpu), "plan": dict(ctx.plan.activations)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compute", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--choices", default="keep,recompute,offload,mix")
    args = parser.parse_args(argv)
    print(f"tiny preset, {args.layers} layers, batch {args.batch} x seq {args.seq}, compute={args.compute}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'choice':<10} {'saved':>6} {'saved device MB':>16} {'host MB':>8} {'in flight peak MB':>18} "
          f"{'median ms':>10} {'min ms':>8} {'CPU ms':>8}")
    base = None
    for choice in args.choices.split(","):
        r = measure(choice, args)
        base = base or r["cpu_ms"]
        print(f"{choice:<10} {r['tensors']:>6} {r['device'] / 1e6:>16.2f} {r['host'] / 1e6:>8.2f} "
              f"{r['in_flight'] / 1e6:>18.2f} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} {r['cpu_ms']:>8.1f}"
              f"   CPU x{r['cpu_ms'] / base:.2f}")


if __name__ == "__main__":
    main()
