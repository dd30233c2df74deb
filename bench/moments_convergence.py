"""Does training with bf16 or int8 Adam moments converge as fp32 moments do? Side by side in one run.

    .venv/bin/python bench/moments_convergence.py                                  # tiny preset, 2000 steps
    .venv/bin/python bench/moments_convergence.py --preset small --steps 300 --lr 1e-3
    .venv/bin/python bench/moments_convergence.py --steps 200 --eval-every 50      # quick

Every format trains its own copy of the same model (same seed, same initial weights) on the same batches, in
lockstep: socompile.AdamW compiled with the superoffload backend (every bucket stepped by the CPU kernel),
moment_dtype fp32 (the anchor: torch.optim.AdamW's numbers, tests/test_backend_training.py), bf16 and int8 blocks
(both stochastically rounded, docs/kernel.md), and fp32 from other initial weights (the noise floor). Training text: the first 90% of the embedded corpus (the Python
standard library's sources, socompile.data); evaluation: fixed batches from the last 10%, every --eval-every
steps. Prints the eval-loss curves side by side and the ratios to fp32 (the final evaluation, and the mean of the
last --tail ones), and writes an SVG plot of the curves to --svg.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import socompile  # noqa: E402
from socompile.data import ByteBatches, stdlib_corpus  # noqa: E402
from socompile.models import build  # noqa: E402

# name: (moment dtype, initialisation seed). "fp32 seed 1" is the noise floor: fp32 moments from other initial
# weights, showing how far two equally good runs drift apart on this data; bf16's distance from fp32 means
# something only next to it.
FORMATS = {"fp32": (torch.float32, 0), "bf16": (torch.bfloat16, 0), "int8": ("int8", 0),
           "fp32 seed 1": (torch.float32, 1)}
AIMS = {"bf16": "; aim for bf16: within 1%", "int8": "; aim for int8: within 2%", "fp32 seed 1": "; the noise floor"}


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def make_run(preset: str, moment_dtype, seed: int, lr: float):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = build(preset)
    opt = socompile.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
                          moment_dtype=moment_dtype)
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "1MB"})
    return model, torch.compile(model, backend=backend), opt


@torch.no_grad()
def evaluate(model, batches) -> float:
    return statistics.fmean(loss_of(model, x, y).item() for x, y in batches)


def svg_plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """A line per format: eval loss against step."""
    width, height, pad = 640, 400, 50
    points = [p for c in curves.values() for p in c]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = lambda x: pad + (x - x0) / max(1, x1 - x0) * (width - 2 * pad)  # noqa: E731
    sy = lambda y: height - pad - (y - y0) / max(1e-9, y1 - y0) * (height - 2 * pad)  # noqa: E731
    colours = ["#1f77b4", "#d62728", "#2ca02c"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle">{title}</text>',
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
           f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">step</text>',
           f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">eval loss'
           f'</text>']
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        xv = x0 + (x1 - x0) * k / 4
        out.append(f'<text x="{pad - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
        out.append(f'<text x="{sx(xv):.1f}" y="{height - pad + 16}" text-anchor="middle">{xv:.0f}</text>')
    for k, (name, curve) in enumerate(curves.items()):
        colour = colours[k % len(colours)]
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in curve)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{width - pad - 110}" y="{pad + 16 * k}" fill="{colour}">{name} moments</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--formats", default="fp32,bf16,int8,fp32 seed 1", help=f"comma-separated, of {sorted(FORMATS)}")
    ap.add_argument("--tail", type=int, default=5, help="evaluations averaged for the final comparison")
    ap.add_argument("--svg", default="", help="write the plot here (default: none)")
    args = ap.parse_args()

    text = stdlib_corpus(4_000_000)
    cut = len(text) * 9 // 10
    train = ByteBatches(text[:cut], args.batch, args.seq, seed=1)
    held_out = ByteBatches(text[cut:], args.batch, args.seq, seed=2)
    eval_batches = [next(held_out) for _ in range(args.eval_batches)]
    names = [f.strip() for f in args.formats.split(",") if f.strip()]
    runs = {name: make_run(args.preset, *FORMATS[name], args.lr) for name in names}
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    seconds = {name: 0.0 for name in names}
    print(f"# {args.preset}, {args.steps} steps, batch {args.batch} x {args.seq} bytes, lr {args.lr}, "
          f"betas (0.9, 0.95), weight decay 0.1, max_grad_norm 1.0; torch {torch.__version__}")
    compared = [name for name in names if name != "fp32"] if "fp32" in names else []
    print(f"{'step':>6} " + " ".join(f"{name + ' eval':>10}" for name in names)
          + "".join(f" {name + '/fp32':>15}" for name in compared))
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            for name, (model, _, opt) in runs.items():
                with opt.materialized_weights():
                    curves[name].append((step, evaluate(model, eval_batches)))
            row = {name: curves[name][-1][1] for name in names}
            ratio = "".join(f" {row[name] / row['fp32']:15.5f}" for name in compared)
            print(f"{step:>6} " + " ".join(f"{row[name]:10.5f}" for name in names) + ratio, flush=True)
        if step == args.steps:
            break
        x, y = next(train)
        for name, (_, cmodel, opt) in runs.items():
            start = time.perf_counter()
            loss_of(cmodel, x, y).backward()
            opt.step()
            opt.zero_grad()
            seconds[name] += time.perf_counter() - start
    print()
    for name, (_, _, opt) in runs.items():   # what each run really held: the moment buffers' bytes
        held = opt.host_memory()["by_purpose"].get("Adam moments", {})
        print(f"{name} moments: {sum(held.values()) / 1e6:.2f} MB of moments held "
              f"({sorted({b.moment_format for b in opt.buckets})})")
    final = {name: curves[name][-1][1] for name in names}
    for name in names:
        best = min(v for _, v in curves[name])
        print(f"{name} moments: final eval loss {final[name]:.4f}, best {best:.4f}, "
              f"{seconds[name] / args.steps * 1e3:.1f} ms per training step")
    tail = {name: statistics.fmean(v for _, v in curves[name][-args.tail:]) for name in names}
    for name in names:
        if name != "fp32" and "fp32" in names:
            ratio, mean_ratio = final[name] / final["fp32"], tail[name] / tail["fp32"]
            print(f"{name} / fp32: final eval loss {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), mean of the last "
                  f"{args.tail} evaluations {mean_ratio:.4f} ({(mean_ratio - 1) * 100:+.2f}%)"
                  + AIMS.get(name, ""))
    if args.svg:
        svg_plot(curves, Path(args.svg), f"{args.preset}: eval loss by Adam moment format")
        print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
