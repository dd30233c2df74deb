"""The plan report as a terminal table and as JSON."""
from __future__ import annotations

import json

from ..plan.plan import Plan


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _format_params(names: tuple[str, ...], width: int = 44) -> str:
    text = ", ".join(names)
    return text if len(text) <= width else f"{names[0]} ... {names[-1]} ({len(names)})"


def plan_table(plan: Plan, bw_length: int | None = None) -> str:
    """One row per bucket: parameters, bytes, where its optimizer runs, when its gradient is ready."""
    header = ("bucket", "params", "grad bytes", "optimizer", "weights", "grads ready at")
    rows = []
    for b in plan.buckets:
        ready = f"bw node {b.ready_position}" + (f"/{bw_length} ({b.ready_after.split(':', 1)[1]})"
                                                   if bw_length else f" ({b.ready_after.split(':', 1)[1]})")
        rows.append((str(b.index), _format_params(b.params), human_bytes(b.grad_bytes), b.optimizer_site,
                     b.weight_mode, ready))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [f"socompile plan for target {plan.target}: {len(plan.buckets)} bucket(s), "
             f"bucket size {human_bytes(plan.bucket_size)}, "
             f"{human_bytes(sum(b.grad_bytes for b in plan.buckets))} of fp32 gradients"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if plan.unoptimized_params:
        lines.append(f"{len(plan.unoptimized_params)} parameter(s) without a socompile optimizer keep .grad")
    for key, value in plan.predicted:
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True, indent=1)
