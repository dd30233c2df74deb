"""The plan report as a terminal table and as JSON.

One row per layer group (the buckets of ``layers.7`` and so on), identical consecutive layers collapsed into one
row (``layers.0..27 x28``), then the predictions: memory (with formulas of batch and sequence when the trace was
symbolic), step time, overlap, and every decision with its reason.
"""
from __future__ import annotations

import json
import re

from ..hardware.cpu_adam import adam_kernel_bytes
from ..plan.host_waits import FIRST_READ, SETTLED
from ..plan.plan import BucketPlan, Plan
from ..moment_format import QBLOCK, format_of
from ..units import human_bytes


def human_formula(text: str) -> str:
    """'262144*batch*seq + 2147483648' -> '2.1 GB + 262.1 KB*batch*seq' (bytes formulas from the planner)."""
    terms = []
    for term in str(text).replace(" - ", " + -").split(" + "):
        m = re.fullmatch(r"\s*(-?\d+)(?:\*(.+))?\s*", term)
        if m and (m.group(2) or not re.search(r"[a-z]", term)):
            coeff = human_bytes(int(m.group(1)))
            terms.append(f"{coeff}*{m.group(2)}" if m.group(2) else coeff)
        else:
            terms.append(term.strip())
    return " + ".join(terms)


def _signature(buckets: list[BucketPlan], activation: str = "-") -> tuple:
    return tuple((b.numel, b.optimizer_site, b.weight_mode, b.prefetch_distance, b.cast_site, b.link_dtype,
                  b.rollback) for b in buckets) + (activation,)


def _activation_of(plan: Plan, group: str) -> str:
    """The activation choice of a row's layer group ('-' for groups outside the repeated layers)."""
    choices = dict(plan.activations)
    if not choices:
        return "keep" if re.search(r"\.\d+", group) else "-"
    for name in re.findall(r"[\w.]*?\.\d+", group):
        if name in choices:
            return choices[name]
    return "-"


def _groups(plan: Plan) -> list[tuple[str, list[BucketPlan]]]:
    """Buckets grouped by layer group, in forward order (last gradients first)."""
    groups: dict[str, list[BucketPlan]] = {}
    for b in reversed(plan.buckets):
        groups.setdefault(b.layers or f"bucket {b.index}", []).append(b)
    return list(groups.items())


def _collapse(groups, plan: Plan | None = None):
    """Merge consecutive groups 'prefix.N' with identical bucket signatures (and activation choice) into
    'prefix.A..B xK'."""
    out = []
    for name, buckets in groups:
        m = re.fullmatch(r"(.*\.)(\d+)", name)
        act = _activation_of(plan, name) if plan is not None else "-"
        if out and m:
            last = out[-1]
            if last["prefix"] == m.group(1) and last["sig"] == _signature(buckets, act) \
                    and int(m.group(2)) == last["end"] + 1:
                last["end"] = int(m.group(2))
                last["count"] += 1
                last["buckets"] += buckets
                continue
        out.append({"name": name, "prefix": m.group(1) if m else None, "start": int(m.group(2)) if m else None,
                    "end": int(m.group(2)) if m else None, "count": 1, "sig": _signature(buckets, act),
                    "buckets": list(buckets), "first": buckets, "activations": act})
    return out


def _row(entry) -> tuple[str, ...]:
    first = entry["first"]
    if entry["count"] > 1:
        label = f"{entry['prefix']}{entry['start']}..{entry['end']} x{entry['count']}"
    else:
        label = entry["name"]
    per_layer = sum(b.numel for b in first)
    sites = "/".join(sorted({b.optimizer_site for b in first}))
    modes = "/".join(sorted({b.weight_mode for b in first}))
    dist = max(b.prefetch_distance for b in first)
    cast = "/".join(sorted({b.cast_site for b in first}))
    link = "/".join(sorted({f"{b.link_dtype}>{b.param_link_dtype}" for b in first}))
    rollback = "/".join(sorted({b.rollback for b in first}))
    ready = min(b.ready_s for b in entry["buckets"])
    done = max(b.stepped_s for b in entry["buckets"])
    idx = sorted(b.index for b in entry["buckets"])
    buckets = f"{idx[0]}" if len(idx) == 1 else f"{idx[0]}-{idx[-1]}"
    return (label, buckets, f"{per_layer / 1e6:.1f}M", human_bytes(per_layer * 16), sites, modes,
            str(dist) if dist else "-", cast, link, rollback, entry.get("activations", "-"), f"{ready * 1e3:.1f}",
            f"{done * 1e3:.1f}")


def plan_table(plan: Plan, bw_length: int | None = None) -> str:
    """Per layer group: parameters, model-state bytes, where its optimizer runs, weight mode, prefetch distance,
    cast site and link dtypes (grads>weights), rollback mode, and when its gradients go / its step ends (ms)."""
    header = ("layers", "buckets", "params/layer", "state/layer", "optimizer", "weights", "prefetch", "cast",
              "link g>w", "rollback", "activations", "grads ms", "stepped ms")
    rows = [_row(e) for e in _collapse(_groups(plan), plan)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    pred = dict(plan.predicted)
    lines = [f"socompile plan for target {plan.target}: {len(plan.buckets)} bucket(s), "
             f"bucket size {human_bytes(plan.bucket_size)}, "
             f"{human_bytes(sum(b.grad_bytes for b in plan.buckets))} of fp32 gradients"
             + (f", backward of {bw_length} nodes" if bw_length else "")]
    if pred.get("shapes"):
        lines.append("shapes: " + ", ".join(f"{k}={v}" for k, v in pred["shapes"]))
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if plan.unoptimized_params:
        lines.append(f"{len(plan.unoptimized_params)} parameter(s) without a socompile optimizer keep .grad")
    lines += _summary(plan, pred)
    return "\n".join(lines)


def link_line(traffic) -> str:
    """'link per step: d2h 1.0 MB (gradients bfloat16), h2d 2.1 MB (weight upload float32)': the plan's
    ``link_bytes_per_step`` (or ``opt.traffic()`` as the same pairs), per direction with its parts."""
    by_direction: dict[str, list[str]] = {}
    totals: dict[str, int] = {}
    for key, nbytes in traffic:
        direction, dtype, purpose = key.split(" ", 2) if isinstance(key, str) else key
        by_direction.setdefault(direction, []).append(f"{purpose} {dtype} {human_bytes(nbytes)}")
        totals[direction] = totals.get(direction, 0) + nbytes
    return "link per step (one micro-batch): " + "; ".join(
        f"{d} {human_bytes(totals[d])} ({', '.join(parts)})" for d, parts in sorted(by_direction.items()))


def host_work_line(work) -> str:
    """'host CPU per step: read 1.2 GB, written 0.8 GB (adam kernel 1.1 GB / 0.8 GB, ...)': the plan's
    ``host_work_bytes_per_step`` (what ``opt.host_work()`` books), (purpose, read, written) triples."""
    read, written = sum(r for _, r, _ in work), sum(w for _, _, w in work)
    return (f"host CPU per step (one micro-batch): read {human_bytes(read)}, written {human_bytes(written)} ("
            + ", ".join(f"{p} {human_bytes(r)} / {human_bytes(w)}" for p, r, w in work) + ")")


def job_waits_line(waits) -> str:
    """'training thread waits for CPU jobs per step: 8 at the buckets' first reads in the next forward, 2 in
    opt.step()': the plan's ``cpu_job_waits_per_step`` (what ``opt.host_blocks()`` books), (site, count) pairs."""
    counts = dict(waits)
    return (f"training thread waits for CPU jobs per step: {counts.get(FIRST_READ, 0)} at the buckets' first reads "
            f"in the next forward (opt.step() returns before them), {counts.get(SETTLED, 0)} in opt.step()")


def _summary(plan: Plan, pred: dict) -> list[str]:
    out = []
    if "device_peak_bytes" in pred:
        out.append(f"device peak: {human_bytes(pred['device_peak_bytes'])} of {human_bytes(pred['device_budget_bytes'])}"
                   f"  = {human_formula(pred['device_peak_formula'])}")
        out.append("  " + ", ".join(f"{k} {human_bytes(v)}" for k, v in pred.get("device_parts", ()) if v))
        per_layer = ""
        if plan.activations:
            per_layer = (f"; layers: keep {pred.get('activations_keep_layers', 0)}, recompute "
                         f"{pred.get('activations_recompute_layers', 0)}, selective "
                         f"{pred.get('activations_selective_layers', 0)}, selective_offload "
                         f"{pred.get('activations_selective_offload_layers', 0)}, offload "
                         f"{pred.get('activations_offload_layers', 0)} "
                         f"({human_bytes(pred.get('activations_offloaded_bytes', 0))} to host)")
        out.append(f"activations: {human_bytes(pred['activations_bytes'])} = {human_formula(pred['activations_formula'])}"
                   f" (checkpointing: {plan.recompute}{per_layer})")
        out.append(f"host memory: {human_bytes(pred['host_bytes'])}, pinned {human_bytes(pred['host_pinned_bytes'])}"
                   f"  (" + ", ".join(f"{k} {human_bytes(v)}" for k, v in pred.get("host_parts", ()) if v) + ")")
        if pred.get("moment_bytes", 4) != 4:   # the default (fp32 moments) says nothing new
            streamed = sum(adam_kernel_bytes(QBLOCK, 4, False, pred["moment_bytes"])) / QBLOCK   # whole int8 blocks
            out.append(f"Adam moments: {format_of(pred['moment_bytes'])}, {2 * pred['moment_bytes']:g} B per "
                       f"CPU-stepped parameter (fp32: 8); CPU Adam reads and writes {streamed:g} B per parameter "
                       f"with fp32 gradients (fp32 moments: {int(sum(adam_kernel_bytes(1, 4, False)))})")
    if pred.get("link_bytes_per_step"):
        out.append(link_line(pred["link_bytes_per_step"]))
    if pred.get("host_work_bytes_per_step"):
        out.append(host_work_line(pred["host_work_bytes_per_step"]))
    if pred.get("cpu_job_waits_per_step"):
        out.append(job_waits_line(pred["cpu_job_waits_per_step"]))
    if "step_time_s" in pred:
        out.append(f"step: {pred['step_time_s'] * 1e3:.1f} ms (forward {pred['forward_s'] * 1e3:.1f}, backward "
                   f"{pred['backward_s'] * 1e3:.1f}, exposed optimizer tail {pred['exposed_tail_s'] * 1e3:.1f}); "
                   f"GPU busy {pred['gpu_utilisation'] * 100:.0f}%, {pred['tflops']:.0f} TFLOP/s, MFU "
                   f"{pred['mfu'] * 100:.0f}%")
        if pred.get("world_size", 1) > 1:
            out.append(f"per rank (dp {pred['dp_degree']} x sp {pred['sp_degree']}): collectives "
                       f"{human_bytes(pred.get('comm_ulysses_bytes', 0))} Ulysses all-to-all + "
                       f"{human_bytes(pred.get('comm_zero_bytes', 0))} ZeRO reduce-scatter/all-gather sent, "
                       f"{pred.get('comm_busy_s', 0) * 1e3:.1f} ms on the network, "
                       f"{pred.get('comm_exposed_s', 0) * 1e3:.1f} ms of it not hidden by compute")
        out.append(f"ZeRO-Offload on the same work: {pred['zero_offload_step_time_s'] * 1e3:.1f} ms "
                   f"(SuperOffload plan {pred['speedup_vs_zero_offload']:.2f}x faster)")
    out += [f"decision: {d}" for d in plan.decisions]
    if "step_time_s" not in pred:
        out += [f"{key}: {value}" for key, value in plan.predicted]
    return out


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True, indent=1)
