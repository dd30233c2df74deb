"""Where each weight-flow bucket is fetched, waited for and released, in forward and again in backward.

A pure function of the Plan and the IR, used by the weight-flow passes (which insert exactly these nodes) and
by the memory prediction (which walks exactly these events), so the predicted and the measured device peak of
the runtime's flow buffers are the same number.

Per phase, flow buckets are ordered by their first use (the first node that reads one of their weights, or a
view of one). For bucket j with prefetch distance d:

    prefetch(j)   just before the first use of the flow bucket d places earlier (j - d); at the graph's
                  first use of any flow bucket when j - d < 0; d = 0: just before its own first use
    wait(j)       just before its own first use (the compute waits for the copy, not the host)
    release(j)    just after its last use

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
    readers = ir.fw_readers if phase == "fw" else ir.bw_readers
    out = []
    for p in bucket.params:
        for k in readers.get(p, ()):
            if ir.graph.nodes[k]["kind"] != "output":
                out.append(ir.graph.nodes[k]["order"])
    return out


def flow_schedule(plan: Plan, ir: IR) -> dict[str, list[FlowAction]]:
    out: dict[str, list[FlowAction]] = {}
    for phase, _ in PHASES:
        order = ir.fw_order if phase == "fw" else ir.bw_order
        spans = []
        for b in plan.buckets:
            if b.weight_mode != "flow":
                continue
            uses = _uses(plan, ir, phase, b)
            if uses:
                spans.append((min(uses), max(uses), b.index, b.prefetch_distance))
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
