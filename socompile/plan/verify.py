"""The invariant checker: prove a plan is safe to apply before any pass applies it.

Checked, each with a message naming the bucket, parameter or number at fault:
- every bucket is stepped exactly once (unique indices 0..N-1, one site each, one optimizer task in the replay);
- every gradient lands in exactly one bucket (optimized parameters with a gradient == union of bucket params);
- each bucket's ``ready_after`` comes after all its gradients and after every backward read of its weights;
- every weight-flow bucket is present before each use (its prefetch ends before the compute that reads it,
  forward and backward) and is released only after its last use (its buffer is not reused before then);
- predicted peaks are within budget (device memory, host memory).
"""
from __future__ import annotations

from ..capture.ir import IR
from .plan import Plan

VALID_SITES = ("cpu", "device")
VALID_MODES = ("stationary", "flow")


class PlanInvariantError(AssertionError):
    """A plan breaks an invariant; ``problems`` lists every one found."""

    def __init__(self, problems: list[str]):
        super().__init__("plan rejected:\n  - " + "\n  - ".join(problems))
        self.problems = problems


def check(plan: Plan, ir: IR, hw=None, costs=None, cost=None) -> list[str]:
    """Every broken invariant of ``plan`` as a message (empty when the plan is safe)."""
    problems: list[str] = []
    problems += _buckets_stepped_once(plan)
    problems += _gradients_in_one_bucket(plan, ir)
    problems += _ready_points(plan, ir)
    problems += _flow_lifetimes(plan, ir)
    problems += _budgets(plan, hw)
    if costs is not None and cost is not None and not problems:
        problems += _replay(plan, costs, cost)
    return problems


def verify(plan: Plan, ir: IR, hw=None, costs=None, cost=None) -> None:
    """Raise PlanInvariantError listing every broken invariant."""
    problems = check(plan, ir, hw, costs, cost)
    if problems:
        raise PlanInvariantError(problems)


def _buckets_stepped_once(plan: Plan) -> list[str]:
    out = []
    indices = [b.index for b in plan.buckets]
    seen = set()
    for i in indices:
        if i in seen:
            out.append(f"bucket {i} appears more than once: it would be stepped twice")
        seen.add(i)
    if sorted(seen) != list(range(len(seen))):
        out.append(f"bucket indices {sorted(seen)} are not 0..{len(plan.buckets) - 1}")
    for pos, b in enumerate(plan.buckets):
        if b.index != pos and b.index in seen and indices.count(b.index) == 1:
            out.append(f"bucket {b.index} is at position {pos}: buckets must be in gradient order")
        if b.optimizer_site not in VALID_SITES:
            out.append(f"bucket {b.index} has optimizer_site {b.optimizer_site!r}: it would never be stepped "
                       f"(valid: {', '.join(VALID_SITES)})")
        if b.weight_mode not in VALID_MODES:
            out.append(f"bucket {b.index} has weight_mode {b.weight_mode!r} (valid: {', '.join(VALID_MODES)})")
        if not b.params:
            out.append(f"bucket {b.index} has no parameters")
    return out


def _gradients_in_one_bucket(plan: Plan, ir: IR) -> list[str]:
    out = []
    owner: dict[str, int] = {}
    for b in plan.buckets:
        for p in b.params:
            if p in owner:
                out.append(f"gradient of {p} is in buckets {owner[p]} and {b.index}: it would be applied twice")
            owner[p] = b.index
            if p not in ir.params:
                out.append(f"bucket {b.index} names {p}, which is not a parameter of the graph")
            elif ir.params[p].numel and b.numel < ir.params[p].numel:
                out.append(f"bucket {b.index} is smaller ({b.numel}) than its parameter {p}")
    for b in plan.buckets:
        want = sum(ir.params[p].numel for p in b.params if p in ir.params)
        if want != b.numel:
            out.append(f"bucket {b.index} says numel={b.numel} but its parameters hold {want}")
    expected = {n for n in ir.grad_node if ir.params[n].requires_grad and ir.params[n].optimized}
    for p in sorted(expected - set(owner)):
        out.append(f"gradient of {p} is in no bucket: its optimizer step would be lost")
    for p in sorted(set(owner) & set(plan.unoptimized_params)):
        out.append(f"{p} is both in bucket {owner[p]} and listed as unoptimized")
    return out


def _ready_points(plan: Plan, ir: IR) -> list[str]:
    out = []
    position = {k: i for i, k in enumerate(ir.bw_order)}
    for b in plan.buckets:
        if position.get(b.ready_after) != b.ready_position:
            out.append(f"bucket {b.index}: ready_after {b.ready_after} is not at ready_position {b.ready_position}")
            continue
        for p in b.params:
            grad = ir.grad_node.get(p)
            if grad is not None and position[grad] > b.ready_position:
                out.append(f"bucket {b.index} is stepped at backward node {b.ready_position} before the gradient "
                           f"of {p} exists (node {position[grad]})")
            late = [position[r] for r in ir.bw_readers.get(p, ()) if position[r] > b.ready_position]
            if late:
                out.append(f"bucket {b.index} updates {p} at backward node {b.ready_position} but the backward still "
                           f"reads it at node {max(late)}")
    return out


def _flow_lifetimes(plan: Plan, ir: IR) -> list[str]:
    """A flow bucket's buffer is reused by the transfer ``d + 1`` flow uses later (d = the prefetch distance of
    that later bucket): the bucket must have finished all its uses before the next flow bucket's first use
    that gates the reuse."""
    out = []
    for phase, readers in (("forward", ir.fw_readers), ("backward", ir.bw_readers)):
        order = {k: ir.graph.nodes[k]["order"] for ks in readers.values() for k in ks}
        spans = []
        for b in plan.buckets:
            if b.weight_mode != "flow":
                continue
            if b.prefetch_distance < 1:
                out.append(f"bucket {b.index} flows but has prefetch distance {b.prefetch_distance}: its weights "
                           f"would not be present at first use")
            uses = [order[k] for p in b.params for k in readers.get(p, ())
                    if ir.graph.nodes[k]["kind"] != "output" and not ir.graph.nodes[k].get("is_view")]
            if uses:
                spans.append((min(uses), max(uses), b.index, max(1, b.prefetch_distance)))
        spans.sort()
        for j, (first, _, idx, dist) in enumerate(spans):
            gate = j - dist          # the transfer for use j starts when use `gate` starts ...
            freed = gate - 1         # ... reusing the buffer of use gate-1, which must be finished by then
            if freed >= 0 and gate >= 0:
                f_first, f_last, f_idx, _ = spans[freed]
                if f_last >= spans[gate][0]:
                    out.append(f"{phase}: weight-flow bucket {f_idx} is released (buffer reused for bucket {idx}) "
                               f"at node {spans[gate][0]} before its last use at node {f_last}")
    return out


def _budgets(plan: Plan, hw) -> list[str]:
    out = []
    pred = dict(plan.predicted)
    peak, budget = pred.get("device_peak_bytes"), pred.get("device_budget_bytes")
    if peak is not None and budget is not None and peak > budget:
        out.append(f"predicted device peak {peak / 1e9:.2f} GB exceeds the budget {budget / 1e9:.2f} GB")
    host = pred.get("host_bytes")
    if hw is not None and host is not None and host > hw.host_memory:
        out.append(f"predicted host memory {host / 1e9:.1f} GB exceeds {hw.name}'s {hw.host_memory / 1e9:.0f} GB")
    return out


def _replay(plan: Plan, costs, cost) -> list[str]:
    """Replay the step and check its order: one optimizer task per bucket, prefetches before their reads."""
    from .simulate import simulate
    sim = simulate(plan, costs, cost)
    out = []
    steps: dict[int, int] = {}
    for task in sim.tasks:
        if task.kind == "adam":
            idx = int(task.name.rsplit("b", 1)[1])
            steps[idx] = steps.get(idx, 0) + 1
    for b in plan.buckets:
        if steps.get(b.index, 0) != 1:
            out.append(f"bucket {b.index} is stepped {steps.get(b.index, 0)} times in the replayed step")
    return out
