"""The invariant checker: prove a plan is safe to apply before any pass applies it (the rewritten graphs are
checked by socompile/passes/check.py, after every pass).

Checked, each with a message naming the bucket, parameter or number at fault:
- every bucket is stepped exactly once (unique indices 0..N-1, one site each, one optimizer task in the replay);
- every gradient lands in exactly one bucket (optimized parameters with a gradient == union of bucket params);
- each bucket's ``ready_after`` comes after all its gradients and after every backward read of its weights;
- every weight-flow bucket is present before each use (fetched, then waited for, before the compute that reads
  it, forward and backward) and is released only after its last use (plan/flow_schedule.py);
- predicted peaks are within budget (device memory, host memory);
- per-layer activation choices name repeated layer groups of the graph, once each, with a known choice.
"""
from __future__ import annotations

from ..capture.ir import IR
from ..units import human_bytes
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
    problems += _activation_choices(plan, ir)
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
    """Each flow bucket is fetched into its own device buffer, waited for before its first use and released
    after its last use, per phase (plan/flow_schedule.py; the runtime allocates one buffer per fetch, so no
    buffer can be handed to another bucket while still in use). Checked here: the distance is valid, only
    CPU-stepped buckets flow, and the schedule orders prefetch <= wait <= first use <= last use < release."""
    from .flow_schedule import flow_schedule
    out = []
    for b in plan.buckets:
        if b.weight_mode != "flow":
            continue
        if b.prefetch_distance < 0:
            out.append(f"bucket {b.index} flows but has prefetch distance {b.prefetch_distance}: its weights "
                       f"would not be present at first use")
        if b.optimizer_site == "device":
            out.append(f"bucket {b.index} is stepped on the device but flows: its master weights live on the "
                       f"device, there is nothing to stream")
    if out:
        return out
    for phase, actions in flow_schedule(plan, ir).items():
        seen: dict[int, list[str]] = {}
        for a in actions:
            seen.setdefault(a.bucket, []).append(a.kind)
        for bucket, kinds in seen.items():
            if kinds != ["prefetch", "wait", "release"]:
                out.append(f"{phase}: flow bucket {bucket} is scheduled {kinds}, not prefetch, wait, release")
    return out


def _activation_choices(plan: Plan, ir: IR) -> list[str]:
    from ..perf.analysis import is_repeated_layer, layer_group
    from .plan import ACTIVATION_CHOICES
    out = []
    layers = {layer_group(n) for n in ir.params if is_repeated_layer(n)}
    seen: set[str] = set()
    for layer, choice in plan.activations:
        if choice not in ACTIVATION_CHOICES:
            out.append(f"layer {layer} has activation choice {choice!r} (valid: {', '.join(ACTIVATION_CHOICES)})")
        if layer not in layers:
            out.append(f"activation choice for {layer}, which is not a repeated layer of the graph")
        if layer in seen:
            out.append(f"layer {layer} has more than one activation choice")
        seen.add(layer)
    if any(c != "keep" for _, c in plan.activations) and plan.recompute == "none":
        out.append("some layers recompute or offload their activations but plan.recompute is 'none'")
    return out


def _budgets(plan: Plan, hw) -> list[str]:
    out = []
    pred = dict(plan.predicted)
    peak, budget = pred.get("device_peak_bytes"), pred.get("device_budget_bytes")
    if peak is not None and budget is not None and peak > budget:
        out.append(f"predicted device peak {human_bytes(peak)} exceeds the budget {human_bytes(budget)}")
    host = pred.get("host_bytes")
    if hw is not None and host is not None and host > hw.host_memory:
        out.append(f"predicted host memory {human_bytes(host)} exceeds {hw.name}'s {human_bytes(hw.host_memory)}")
    return out


def _replay(plan: Plan, costs, cost) -> list[str]:
    """Replay the step and check its order: one optimizer task per bucket, prefetches before their reads."""
    from ..perf.simulate import simulate
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
