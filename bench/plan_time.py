"""Planning time and peak RSS: 7B/13B/25B presets, and 8/16/32/64 layers of one width (each in a fresh process).

    python bench/plan_time.py [--quick]     # --quick: 8/16/32 layers of llama-1b width only
Plans trace 4 blocks and repeat one (capture/fold/); the 7B rows also time tracing every block, side by side.
Goals: 7B <= 15 s, 25B <= 45 s, < 2 GB RSS, time growing no faster than linearly in layers.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
t0 = time.perf_counter()
from socompile.offline import plan_model
from socompile.models.llama import PRESETS, build
import dataclasses
name, layers, fold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fold"
factory = (lambda: build(name)) if layers == 0 else (lambda: build(dataclasses.replace(PRESETS[name], n_layers=layers)))
t1 = time.perf_counter()
ctx = plan_model(factory, batch=4, seq=4096, options={"target": "gh200"}, dtype=torch.bfloat16, run_passes=False,
                 fold=fold)
t2 = time.perf_counter()
print(json.dumps({"total_s": t2 - t0, "plan_s": t2 - t1, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "buckets": len(ctx.plan.buckets), "bw_nodes": len(ctx.ir.bw_order)}))
"""


def run(name: str, layers: int = 0, fold: bool = True) -> dict:
    args = [sys.executable, "-c", CHILD, name, str(layers), "fold" if fold else "full"]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    quick = "--quick" in sys.argv
    rows = []
    if not quick:
        # Side by side: folded tracing (the default) against tracing every block, alternating, 3 times each.
        pairs = [(run("llama-7b"), run("llama-7b", fold=False)) for _ in range(3)]
        folded, full = ([p[i]["plan_s"] for p in pairs] for i in (0, 1))
        ratios = sorted(b / a for a, b in zip(folded, full))
        print(f"llama-7b trace+plan: folded {statistics.median(folded):.1f} s [{min(folded):.1f}-{max(folded):.1f}], "
              f"every block traced {statistics.median(full):.1f} s [{min(full):.1f}-{max(full):.1f}]; "
              f"speed-up median {ratios[1]:.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
        rows.append(("llama-7b", pairs[1][0]))
        rows.append(("llama-7b (every block)", pairs[1][1]))
        for name in ("llama-13b", "llama-25b"):
            rows.append((name, run(name)))
    for layers in (8, 16, 32) if quick else (8, 16, 32, 64):
        rows.append((f"llama-1b width, {layers} layers", run("llama-1b", layers)))
    print(f"{'model':<28}{'total s':>9}{'trace+plan s':>14}{'peak RSS MB':>13}{'buckets':>9}{'bw nodes':>10}")
    for name, r in rows:
        print(f"{name:<28}{r['total_s']:>9.1f}{r['plan_s']:>14.1f}{r['rss_mb']:>13.0f}{r['buckets']:>9}{r['bw_nodes']:>10}")
    layer_rows = [(int(n.split(",")[1].split()[0]), r["plan_s"]) for n, r in rows if "layers" in n]
    (l0, t0), (l1, t1) = layer_rows[0], layer_rows[-1]
    print(f"time ratio {l1}/{l0} layers: {t1 / t0:.2f} (linear would be {l1 / l0:.1f})")


if __name__ == "__main__":
    main()
