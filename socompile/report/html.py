"""A self-contained HTML plan report: the text table and an SVG timeline of one simulated step.

Lanes: GPU compute, a second GPU stream (casts of uploaded weights), the link host->device and device->host,
and one lane per CPU optimizer worker. No scripts, no external files: it opens anywhere and prints.
"""
from __future__ import annotations

import html

from .table import plan_table

COLORS = {"compute": "#4e79a7", "transfer": "#f28e2b", "adam": "#59a14f", "cast": "#b07aa1", "comm": "#e15759"}
LANE_TITLES = {"gpu": "GPU compute", "gpu_aux": "GPU cast stream", "h2d": "link host->device",
               "d2h": "link device->host", "net:intra": "GPU<->GPU in node", "net:inter": "GPU<->GPU network"}


def _lanes(sim) -> list[str]:
    present = set(sim.lane_of)
    fixed = [lane for lane in ("gpu", "gpu_aux", "h2d", "d2h") if lane in present or lane in ("gpu", "h2d", "d2h")]
    cpus = sorted((lane for lane in present if lane.startswith("cpu")), key=lambda s: int(s[3:]))
    nets = sorted(lane for lane in present if lane.startswith("net"))
    return fixed + nets + cpus


def timeline_svg(sim, width: int = 1100, lane_height: int = 26, title: str = "") -> str:
    """An SVG drawing of a SimResult: one row per lane, one rectangle per task, a time axis in ms."""
    lanes = _lanes(sim)
    left, top = 150, 30
    height = top + lane_height * len(lanes) + 70
    span = sim.step_time or 1.0
    scale = (width - left - 20) / span
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12" role="img">',
           f'<title>{html.escape(title or sim.schedule)}</title>',
           f'<text x="8" y="18" font-weight="bold">{html.escape(title or sim.schedule)}: step '
           f'{sim.step_time * 1e3:.1f} ms</text>']
    for i, lane in enumerate(lanes):
        y = top + i * lane_height
        name = LANE_TITLES.get(lane, f"CPU Adam {lane[3:]}" if lane.startswith("cpu") else lane)
        out.append(f'<rect x="{left}" y="{y}" width="{width - left - 20}" height="{lane_height - 4}" '
                   f'fill="#f3f3f3"/>')
        out.append(f'<text x="8" y="{y + lane_height / 2 + 2}">{html.escape(name)}</text>')
    row = {lane: i for i, lane in enumerate(lanes)}
    for task, s, e in zip(sim.tasks, sim.start, sim.end):
        if e <= s or task.lane not in row:
            continue
        x = left + s * scale
        w = max(0.5, (e - s) * scale)
        y = top + row[task.lane] * lane_height
        out.append(f'<rect x="{x:.2f}" y="{y + 1}" width="{w:.2f}" height="{lane_height - 6}" '
                   f'fill="{COLORS.get(task.kind, "#999")}" stroke="white" stroke-width="0.3">'
                   f'<title>{html.escape(task.name)}: {s * 1e3:.2f}-{e * 1e3:.2f} ms</title></rect>')
    axis_y = top + lane_height * len(lanes) + 12
    for k in range(11):
        t = span * k / 10
        x = left + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y - 8}" stroke="#ccc"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 6}" text-anchor="middle">{t * 1e3:.3g} ms</text>')
    for j, (kind, color) in enumerate(COLORS.items()):
        out.append(f'<rect x="{left + j * 110}" y="{axis_y + 14}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{left + j * 110 + 16}" y="{axis_y + 24}">{kind}</text>')
    out.append("</svg>")
    return "\n".join(out)


def plan_html(plan, sims: list | None = None, title: str = "socompile plan") -> str:
    """The report page: summary table and one timeline per simulated schedule (plan first, baselines after)."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:20px;color:#222} pre{font-size:12px;background:#fafafa;"
             "padding:8px;border:1px solid #ddd;overflow-x:auto} h2{font-size:16px;margin-top:24px}</style>",
             "</head><body>", f"<h1>{html.escape(title)}</h1>"]
    for sim in sims or ():
        s = sim.summary()
        parts.append(f"<h2>{html.escape(sim.schedule)}: {s['step_time_s'] * 1e3:.1f} ms per step, GPU busy "
                     f"{s['gpu_utilisation'] * 100:.0f}%, {s['tflops']:.0f} TFLOP/s</h2>")
        parts.append(timeline_svg(sim, title=sim.schedule))
    parts.append("<h2>Plan</h2>")
    parts.append(f"<pre>{html.escape(plan_table(plan))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
