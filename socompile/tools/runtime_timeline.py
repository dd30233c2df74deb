"""A timeline of one real training step from the runtime's recorded events (EventLog), as SVG and as text.

    python -m socompile.tools.runtime_timeline --out docs/runtime_timeline.svg [--preset tiny --layers 2]
        [--trace step.json]   (the measured step and the simulated one side by side, for Perfetto)

Lanes are the threads that recorded events: the compute thread (forward and backward; flow waits and releases,
gradient hand-offs), the ``h2d`` stream (weight copies) and the CPU optimizer worker (bucket steps). On this
CPU-only build each lane is a real thread; on CUDA the h2d lane is a CUDA stream and its events are recorded
when the copy is queued, not when it runs.
"""
from __future__ import annotations

import argparse
import html

from ..perf import chrome_trace as chrome_trace_format
from ..runtime.events import Event

LANES = (("compute", "compute (graph)"), ("h2d", "h2d stream"), ("optimizer", "CPU optimizer"))
SPANS = {"h2d_start": ("h2d_end", "h2d", "#4e79a7"), "step_start": ("step_end", "optimizer", "#e15759"),
         "upload_start": ("upload_end", None, "#76b7b2"),   # lane: the thread that uploads (worker or step())
         "forward_start": ("forward_end", "compute", "#bab0ac"), "backward_start": ("backward_end", "compute", "#d4cfcb")}
MARKS = {"fw_wait": "#59a14f", "bw_wait": "#59a14f", "fw_release": "#f28e2b", "bw_release": "#f28e2b",
         "grads_ready": "#b07aa1", "commit": "#000000"}


def _lane(event: Event) -> str:
    if "h2d" in event.thread:
        return "h2d"
    if "optimizer" in event.thread:
        return "optimizer"
    return "compute"


def spans(events: list[Event]) -> list[tuple[str, str, int, float, float]]:
    """(lane, kind, bucket, start s, end s) of every span, times from the first event."""
    t0 = min(e.t_ns for e in events)
    open_: dict[tuple[str, int], Event] = {}
    out = []
    for e in events:
        if e.kind in SPANS:
            open_[(e.kind, e.bucket)] = e
        for start, (end, lane, _) in SPANS.items():
            if e.kind == end and (start, e.bucket) in open_:
                s = open_.pop((start, e.bucket))
                out.append((lane or _lane(s), start[:-6], e.bucket, (s.t_ns - t0) / 1e9, (e.t_ns - t0) / 1e9))
    return out


def to_svg(events: list[Event], title: str, width: int = 900) -> str:
    t0 = min(e.t_ns for e in events)
    total = max(e.t_ns for e in events) - t0 or 1
    left, lane_h, top = 120, 34, 40
    x = lambda t_ns: left + (t_ns - t0) / total * (width - left - 10)   # noqa: E731
    rows = {name: top + i * lane_h for i, (name, _) in enumerate(LANES)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + len(LANES) * lane_h + 36}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="4" y="16" font-size="13">{html.escape(title)}</text>']
    for name, label in LANES:
        parts.append(f'<text x="4" y="{rows[name] + 18}">{label}</text>')
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{rows[name] + 28}" y2="{rows[name] + 28}" '
                     f'stroke="#ddd"/>')
    for lane, kind, bucket, s, e in spans(events):
        color = next(c for k, (_, _, c) in SPANS.items() if k.startswith(kind))
        x0, x1 = left + s * 1e9 / total * (width - left - 10), left + e * 1e9 / total * (width - left - 10)
        y = rows[lane] + (2 if kind in ("forward", "backward") else 6)
        h = 24 if kind in ("forward", "backward") else 18
        parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{h}" fill="{color}" '
                     f'opacity="0.85"><title>{kind} bucket {bucket}: {(e - s) * 1e3:.2f} ms</title></rect>')
        if kind in ("forward", "backward"):
            parts.append(f'<text x="{x0 + 3:.1f}" y="{y + 14}" fill="#444">{kind}</text>')
        elif x1 - x0 > 14:
            parts.append(f'<text x="{x0 + 2:.1f}" y="{y + 13}" fill="white">{bucket}</text>')
    for e in events:
        if e.kind in MARKS:
            px = x(e.t_ns)
            y = rows[_lane(e)]
            parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{y + 2}" y2="{y + 28}" stroke="{MARKS[e.kind]}" '
                         f'stroke-width="1.5"><title>{e.kind} bucket {e.bucket}</title></line>')
    axis_y = top + len(LANES) * lane_h + 12
    for i in range(6):
        t = total * i / 5
        px = left + i / 5 * (width - left - 10)
        anchor = "start" if i == 0 else "end" if i == 5 else "middle"
        parts.append(f'<text x="{px:.1f}" y="{axis_y}" text-anchor="{anchor}">{t / 1e6:.1f} ms</text>')
    legend = [("weight copy (h2d)", "#4e79a7"), ("bucket step", "#e15759"), ("upload", "#76b7b2"),
              ("flow wait", "#59a14f"),
              ("flow release", "#f28e2b"), ("grads handed to optimizer", "#b07aa1")]
    lx = left
    for label, color in legend:
        parts.append(f'<rect x="{lx}" y="{axis_y + 10}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{axis_y + 19}">{label}</text>')
        lx += 30 + 6 * len(label)
    parts.append("</svg>")
    return "\n".join(parts)


def record_step(preset: str = "tiny", layers: int = 2, batch: int = 8, seq: int = 128, warmup: int = 3,
                options: dict | None = None):
    """Train a few steps with every bucket stepped on the CPU and its weights flowing; return the events of
    one more step (forward, backward, opt.step())."""
    import torch
    import torch.nn.functional as F

    import socompile
    from socompile.data import ByteBatches, stdlib_corpus
    from socompile.models import build

    torch.manual_seed(0)
    model = build(preset, n_layers=layers)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "256KB",
                                      "weight_mode": "flow", "prefetch_distance": 1, **(options or {})})
    cmodel = torch.compile(model, backend=backend)
    data = ByteBatches(stdlib_corpus(200_000), batch, seq, seed=0)

    def loss():
        x, y = next(data)
        return F.cross_entropy(cmodel(x).flatten(0, 1), y.flatten())
    for _ in range(warmup):
        loss().backward()
        opt.step()
        opt.zero_grad()
    return record_one_step(opt, loss), backend.compiled[0]


def record_one_step(opt, forward, sync=lambda: None) -> list[Event]:
    """The events of one training step: ``forward()`` returns the loss, then backward, ``opt.step()`` and
    ``opt.zero_grad()``, then the wait for the CPU jobs those returned before (``opt.wait_pending``), so every
    bucket's step and upload is in; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the first event and
    after that wait, so the step's queued device work is inside them too."""
    sync()
    opt.events.clear()
    opt.events.record("forward_start")
    loss = forward()
    opt.events.record("forward_end")
    opt.events.record("backward_start")
    loss.backward()
    opt.events.record("backward_end")
    opt.step()
    opt.zero_grad()
    opt.wait_pending("record_one_step")
    sync()
    return opt.events.events()


def chrome_trace(events: list[Event], pid: int = chrome_trace_format.MEASURED_PID) -> dict:
    """Recorded events in the Chrome trace event format (Perfetto, chrome://tracing), one lane per thread that
    recorded: each start/end pair of SPANS is one complete event (ph "X") on the thread of its start, every
    other event an instant (ph "i"); times in microseconds from the first event. Every event appears once."""
    if not events:
        return chrome_trace_format.trace(chrome_trace_format.metadata(pid, "measured step", []))
    t0 = min(e.t_ns for e in events)
    threads = list(dict.fromkeys(e.thread for e in events))
    tid = {name: i for i, name in enumerate(threads, start=1)}
    ends = {end: start for start, (end, _, _) in SPANS.items()}
    open_: dict[tuple[str, int], list[Event]] = {}
    out = chrome_trace_format.metadata(pid, "measured step (opt.events)", threads)
    placed: list[tuple[int, dict]] = []   # (position of the first event, trace event): kept in record order
    for position, e in enumerate(events):
        start_kind = ends.get(e.kind)
        if e.kind in SPANS:
            open_.setdefault((e.kind, e.bucket), []).append((position, e))
        elif start_kind is not None and open_.get((start_kind, e.bucket)):
            first, s = open_[(start_kind, e.bucket)].pop(0)
            args = {"bucket": e.bucket} if e.bucket >= 0 else None
            placed.append((first, chrome_trace_format.complete(start_kind[:-6], "runtime", (s.t_ns - t0) / 1e9,
                                                               (e.t_ns - t0) / 1e9, pid, tid[s.thread], args)))
        else:
            placed.append((position, _instant(e, t0, pid, tid)))
    for pending in open_.values():   # a start whose end was not recorded (yet): a moment
        placed += [(position, _instant(e, t0, pid, tid)) for position, e in pending]
    return chrome_trace_format.trace(out + [event for _, event in sorted(placed, key=lambda p: p[0])])


def _instant(e: Event, t0: int, pid: int, tid: dict[str, int]) -> dict:
    return chrome_trace_format.instant(e.kind, "runtime", (e.t_ns - t0) / 1e9, pid, tid[e.thread],
                                       {"bucket": e.bucket} if e.bucket >= 0 else None)


def text_summary(events: list[Event]) -> str:
    lines = [f"{'lane':10s} {'what':9s} {'bucket':>6s} {'start ms':>9s} {'end ms':>8s}"]
    for lane, kind, bucket, s, e in sorted(spans(events), key=lambda r: r[3]):
        lines.append(f"{lane:10s} {kind:9s} {bucket:6d} {s * 1e3:9.2f} {e * 1e3:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/runtime_timeline.svg")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trace", default=None, help="also write the step as a Chrome trace (JSON) here, with "
                        "the simulated step of the same plan beside it")
    args = parser.parse_args(argv)
    events, ctx = record_step(args.preset, args.layers)
    title = (f"one step of {args.preset} ({args.layers} layers), {len(ctx.plan.buckets)} buckets, all on the CPU, "
             f"weights flowing at distance 1 (recorded on this machine)")
    with open(args.out, "w") as f:
        f.write(to_svg(events, title))
    print(text_summary(events))
    print(f"wrote {args.out}")
    if args.trace:
        chrome_trace_format.write(chrome_trace_format.merge(simulate_compiled(ctx).chrome_trace(),
                                                                  chrome_trace(events)), args.trace)
        print(f"wrote {args.trace}")


def simulate_compiled(ctx, **kwargs):
    """The simulated step (SimResult) of a compiled graph pair's plan, on the profile it was planned for."""
    from ..perf.analysis import analyze
    from ..perf.cost import CostModel
    from ..perf.simulate import simulate
    from ..plan import get_profile
    cost = CostModel(get_profile(ctx.options.target), ctx.ir.symbol_values)
    return simulate(ctx.plan, analyze(ctx.ir, cost), cost, **kwargs)


if __name__ == "__main__":
    main()
