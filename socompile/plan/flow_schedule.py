"""Where each weight-flow bucket is fetched, waited for and released, in forward and again in backward.

A pure function of the Plan and the IR, used by the weight-flow passes (which insert exactly these nodes) and
by the memory prediction (which walks exactly these events), so the predicted and the measured device peak of
the runtime's flow buffers are the same number.

Per phase, flow buckets are ordered by their first use (the first node that reads one of their weights, or a
view of one). For bucket j with prefetch distance d:

    prefetch(j)   just before the first use of the flow bucket d places earlier (j - d); at the graph's
                  first use of any flow bucket when j - d < 0; d = 0: just before its own first use
    wait(j)       just before its own first use (the compute waits for the copy, not the host)
    release(j)    just after its last use (a view saved for backward only is no use: the forward pass rebuilds
                  it from the host master)

A bucket that no node of a phase reads is not fetched in that phase (e.g. an untied embedding in backward).
"""
from __future__ import annotations

import dataclasses

from ..capture.ir import IR
from .plan import Plan

PHASES = (("fw", "forward"), ("bw", "backward"))


@dataclasses.dataclass(frozen=True)
class FlowAction:
    phase: str          # "fw" or "bw"
    kind: str           # "prefetch", "wait", "release"
    bucket: int
    anchor: str         # IR node key the action is placed at
    where: str          # "before" or "after" the anchor
    key: tuple          # sort key: execution order of the actions within the phase


def _uses(plan: Plan, ir: IR, phase: str, bucket) -> list[int]:
    """Positions of the nodes of ``phase`` that read the bucket's weights (or a view of them)."""
    return [ir.graph.nodes[k]["order"] for k in _readers(ir, phase, bucket)]


def _readers(ir: IR, phase: str, bucket) -> list[str]:
    readers = ir.fw_readers if phase == "fw" else ir.bw_readers
    return [k for p in bucket.params for k in readers.get(p, ()) if ir.graph.nodes[k]["kind"] != "output"]


def _span(ir: IR, phase: str, bucket) -> tuple[int, int] | None:
    """(first use, last use that holds the fetched buffer: views saved for backward only do not, see
    _saved_view_only) of the bucket in ``phase``; None when the phase does not read it."""
    keys = _readers(ir, phase, bucket)
    if not keys:
        return None
    order = [ir.graph.nodes[k]["order"] for k in keys]
    holding = [o for k, o in zip(keys, order) if not _saved_view_only(ir, k)]
    return min(order), max(holding or order)


def _saved_view_only(ir: IR, key: str) -> bool:
    """A forward view of a weight whose only forward consumers are the graph's output or more such views (the
    partitioners put ``t(w)`` saved for backward at the end of the forward): the weight-flow pass rebuilds
    it from the host master (passes/weight_flow.py), so it does not hold the fetched buffer until there."""
    if not key.startswith("fw:") or not ir.graph.nodes[key]["is_view"]:
        return False
    return all(ir.graph.nodes[s]["kind"] == "output" or _saved_view_only(ir, s)
               for s in ir.graph.successors(key) if s.startswith("fw:"))


def flow_schedule(plan: Plan, ir: IR) -> dict[str, list[FlowAction]]:
    return bucket_flow_schedule(plan.buckets, ir)


def bucket_flow_schedule(buckets, ir: IR, spans_cache: dict | None = None) -> dict[str, list[FlowAction]]:
    """flow_schedule of a list of BucketPlans (a candidate placement the planner has not made a Plan of yet).
    ``spans_cache``: a dict kept across calls on the same IR (the planner tries many placements of the same
    buckets; a bucket's span depends only on its parameters)."""
    cache = {} if spans_cache is None else spans_cache
    out: dict[str, list[FlowAction]] = {}
    for phase, _ in PHASES:
        order = ir.fw_order if phase == "fw" else ir.bw_order
        spans = []
        for b in buckets:
            if b.weight_mode != "flow":
                continue
            key = (phase, b.params)
            if key not in cache:
                cache[key] = _span(ir, phase, b)
            if cache[key] is not None:
                spans.append((*cache[key], b.index, b.prefetch_distance))
        spans.sort()
        actions = []
        for j, (first, last, idx, dist) in enumerate(spans):
            gate = spans[j - dist][0] if j - dist >= 0 else spans[0][0]
            # Before a node: prefetches (sub-order 0, by bucket position), then the wait (1); after: release.
            actions.append(FlowAction(phase, "prefetch", idx, order[gate], "before", (gate, 0, 0, j)))
            actions.append(FlowAction(phase, "wait", idx, order[first], "before", (first, 0, 1, j)))
            actions.append(FlowAction(phase, "release", idx, order[last], "after", (last, 1, 0, j)))
        out[phase] = sorted(actions, key=lambda a: a.key)
    return out


def flow_peak(schedule: dict[str, list[FlowAction]], nbytes: dict[int, int]) -> tuple[int, dict[str, int]]:
    """Peak bytes of live flow buffers (one per fetch, live from prefetch to release), overall and per phase."""
    per_phase = {}
    for phase, actions in schedule.items():
        live = peak = 0
        for a in actions:
            if a.kind == "prefetch":
                live += nbytes[a.bucket]
                peak = max(peak, live)
            elif a.kind == "release":
                live -= nbytes[a.bucket]
        per_phase[phase] = peak
    return max(per_phase.values(), default=0), per_phase
