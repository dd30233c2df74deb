"""The largest llama-25b-shaped model one GH200 plans, by Adam moment format (simulated: the planner's cost model on
the gh200 profile, no run).

    .venv/bin/python bench/largest_model.py --formats float32,bfloat16,int8 --layers 30,34,35
    .venv/bin/python bench/largest_model.py --formats int8 --layers 50,52,53 --no-speculate

Each row plans ``build("llama-25b", n_layers=N)`` with bf16 weights, seq 1024, batch 4 (socompile.offline.plan_model,
options target gh200 and moment_dtype) and prints its parameters, host memory, the buckets on the algebraic
inverse and the simulated step, or why it does not fit. ``--no-speculate``: speculation off, so no bucket keeps a
ping-pong spare (each is stepped once its step is validated).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from socompile.models import build  # noqa: E402
from socompile.offline import plan_model  # noqa: E402
from socompile.plan.search_state import PlanError  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="float32,bfloat16,int8")
    ap.add_argument("--layers", default="30")
    ap.add_argument("--no-speculate", action="store_true")
    args = ap.parse_args()
    print(f"# simulated, gh200 profile, llama-25b shape, bf16 weights, seq 1024, batch 4, speculation "
          f"{'off' if args.no_speculate else 'on'}")
    print(f"{'moments':>8} {'layers':>6} {'params':>8} {'host GB':>8} {'pinned GB':>9} {'inverse':>7} {'step s':>7}")
    for fmt in args.formats.split(","):
        for n in (int(x) for x in args.layers.split(",")):
            options = {"target": "gh200", "moment_dtype": fmt, **({"speculate": False} if args.no_speculate else {})}
            try:
                plan = plan_model(lambda: build("llama-25b", n_layers=n), batch=4, seq=1024, options=options,
                                  dtype=torch.bfloat16).plan
            except PlanError as exc:
                print(f"{fmt:>8} {n:>6} does not fit: {str(exc)[:110]}", flush=True)
                continue
            inverse = sum(b.rollback == "inverse" for b in plan.buckets)
            params = sum(b.numel for b in plan.buckets) / 1e9
            print(f"{fmt:>8} {n:>6} {params:>7.2f}B {plan.prediction('host_bytes') / 1e9:>8.1f} "
                  f"{plan.prediction('host_pinned_bytes') / 1e9:>9.1f} {inverse:>7} "
                  f"{plan.prediction('step_time_s'):>7.2f}", flush=True)


if __name__ == "__main__":
    main()
