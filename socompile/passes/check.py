"""The graph checker: invariants of the rewritten graphs that will run (as opposed to the plan, which
plan/verify.py checks before any pass applies it). Each pass of the table (table.py) names the invariant of
what it inserted; ``run_passes`` checks every invariant of the passes applied so far, after each pass (option
``check_graphs="each_pass"``) or after the last one (``"final"``), so a pass that breaks what an earlier one
wrote is caught too, and named.

Checked, each with a message naming the node (or the missing node) at fault:
- insert_optimizer_steps: every bucket is handed to its optimizer by exactly one node;
- weight_flow_forward / _backward: every flow bucket has one prefetch, before its one wait, and one release
  after every read of its fetched weights; no compute reads a flow parameter's placeholder (the host master)
  instead of its fetched copy;
- activation_offload_forward: every host copy is saved (a graph output) and every offloaded device tensor is
  kept alive by exactly one ``offload_wait`` of its layer, after its offload;
- activation_offload_backward: each host copy has exactly one prefetch, before exactly one wait, and nothing but
  those two reads it (every compute reads the fetched device tensor).
"""
from __future__ import annotations

import torch
from torch import fx

from ..plan.verify import PlanInvariantError

_LABEL = {"fw": "forward", "bw": "backward"}


class GraphInvariantError(PlanInvariantError):
    """The graphs break an invariant after a pass: a bug in that pass (or in the one whose invariant it lists)."""

    def __init__(self, after: str, problems: list[str]):
        super().__init__([f"after {after}: {p}" for p in problems])
        self.args = ("rewritten graphs rejected (a socompile pass bug):\n  - " + "\n  - ".join(self.problems),)
        self.after = after


def check_graph(ctx, phase: str, gm: fx.GraphModule, applied, after: str) -> None:
    """Raise GraphInvariantError (naming ``after``, e.g. "pass 'cast_gradients'") if ``gm``, the ``phase``
    graph, breaks an invariant of a pass in ``applied`` (table entries, in run order)."""
    problems = [p for entry in applied if entry.invariant is not None for p in entry.invariant(ctx, phase, gm)]
    if problems:
        raise GraphInvariantError(after, problems)


# ------------------------------------------------------------------------------------- insert_optimizer_steps
def buckets_handed_once(ctx, phase: str, gm: fx.GraphModule) -> list[str]:
    handed: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.target is torch.ops.socompile.bucket_grads_ready.default:
            handed[n.args[3]] = handed.get(n.args[3], 0) + 1
    return [f"backward: bucket {b.index} is handed to its optimizer {handed.get(b.index, 0)} times, expected once"
            for b in ctx.plan.buckets if handed.get(b.index, 0) != 1]


# ------------------------------------------------------------------------------------------------ weight flow
def flow_weights_fetched(ctx, phase: str, gm: fx.GraphModule) -> list[str]:
    """Flow buckets of ``phase`` are fetched, waited for and released once, in that order, around every read;
    nothing reads their host masters. Nothing to check where the pass had no runtime to apply (offline plans)."""
    schedule = (getattr(ctx, "flow_schedule", None) or {}).get(phase, [])
    if not schedule or getattr(ctx, "offload", None) is None:
        return []
    label = _LABEL[phase]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    found = _flow_nodes(nodes)
    out: list[str] = []
    for bucket in sorted({a.bucket for a in schedule}):
        out += _one_fetch(label, bucket, *(found[k].get(bucket, []) for k in ("prefetch", "wait", "release")), pos)
    out += _host_master_readers(ctx, phase, nodes, schedule)
    return out


def _flow_nodes(nodes: list[fx.Node]) -> dict[str, dict[int, list[fx.Node]]]:
    ops = torch.ops.socompile
    kinds = (("prefetch", ops.prefetch.default), ("wait", ops.wait_weights.default), ("release", ops.release.default))
    found: dict[str, dict[int, list[fx.Node]]] = {kind: {} for kind, _ in kinds}
    for n in nodes:
        for kind, op in kinds:
            if n.target is op:
                found[kind].setdefault(n.args[2], []).append(n)
    return found


def _one_fetch(label: str, bucket: int, pre: list, wait: list, rel: list, pos: dict) -> list[str]:
    if len(wait) != 1:
        return [f"{label}: flow bucket {bucket} has {len(wait)} socompile.wait_weights nodes, expected 1"]
    out = []
    if not pre:
        out.append(f"{label}: missing socompile.prefetch of flow bucket {bucket}: nothing starts the copy "
                   f"that node {wait[0].name!r} waits for")
    elif len(pre) > 1 or pos[pre[0]] > pos[wait[0]]:
        out.append(f"{label}: flow bucket {bucket} is prefetched by {[n.name for n in pre]}, expected one "
                   f"node before its wait {wait[0].name!r}")
    if not rel:
        out.append(f"{label}: missing socompile.release of flow bucket {bucket}: its device buffer "
                   f"(from {wait[0].name!r}) would stay booked")
    elif len(rel) > 1:
        out.append(f"{label}: flow bucket {bucket} is released {len(rel)} times ({[n.name for n in rel]})")
    else:
        late = [r.name for r in _compute_readers(wait[0]) if pos[r] > pos[rel[0]]]
        if late:
            out.append(f"{label}: flow bucket {bucket} is read by {late} after its release {rel[0].name!r}")
    return out


def _host_master_readers(ctx, phase: str, nodes: list[fx.Node], schedule) -> list[str]:
    flowing = {a.bucket for a in schedule}
    flow_params = {p: b.index for b in ctx.plan.buckets if b.weight_mode == "flow" for p in b.params}
    out = []
    for n in nodes:
        if n.op != "placeholder":
            continue
        data = ctx.ir.graph.nodes.get(f"{phase}:{n.name}")
        param = data.get("alias_of") if data else None
        if param in flow_params and flow_params[param] in flowing:
            direct = [r.name for r in _compute_readers(n)]
            if direct:
                out.append(f"{_LABEL[phase]}: {direct} read flow parameter {param} through {n.name!r} (the host "
                           f"master), not its fetched copy")
    return out


def _compute_readers(node: fx.Node) -> list[fx.Node]:
    """Nodes that read ``node``'s data, looking through views and dtype casts (not the graph output)."""
    out, todo = [], [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                continue
            target = user.target
            if isinstance(target, torch._ops.OpOverload) and (target.is_view or
                                                              target is torch.ops.prims.convert_element_type.default):
                todo.append(user)
            elif target is not torch.ops.socompile.release.default:
                out.append(user)
    return out


# ---------------------------------------------------------------------------------------- activation offload
def _listed_by(nodes: list[fx.Node], op, arg: int) -> dict[fx.Node, list[fx.Node]]:
    """Node -> the ``op`` nodes (in graph order) whose argument ``arg``, a list of nodes, names it."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        if n.target is op:
            for t in n.args[arg]:
                out.setdefault(t, []).append(n)
    return out


def activations_offloaded(ctx, phase: str, gm: fx.GraphModule) -> list[str]:
    """Forward: every host copy is saved and every offloaded device tensor is kept alive by exactly one
    ``offload_wait`` of its layer, after its offload."""
    ops = torch.ops.socompile
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    returned = {a for a in nodes[-1].args[0] if isinstance(a, fx.Node)}
    waits = _listed_by(nodes, ops.offload_wait.default, 3)      # device tensor -> its offload_waits
    out: list[str] = []
    for n in nodes:
        if n.target is not ops.offload_activation.default:
            continue
        t = n.args[2]
        if n not in returned:
            out.append(f"forward: {n.name} offloads {t.name} but the host copy is not saved")
        w = [x for x in waits.get(t, []) if x.args[1] == n.args[1]]
        if len(w) != 1:
            out.append(f"forward: {t.name} (offloaded by {n.name}) is kept alive by {len(w)} "
                       f"socompile.offload_wait nodes of {n.args[1]}, expected 1")
        elif pos[w[0]] < pos[n] or n not in w[0].args[2]:
            out.append(f"forward: {w[0].name} may run before {n.name} (it must come later and take its output)")
    return out


def activations_fetched(ctx, phase: str, gm: fx.GraphModule) -> list[str]:
    """Backward: each host copy has exactly one prefetch, before exactly one wait that takes its ticket, and
    nothing but those two reads it."""
    ops = torch.ops.socompile
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    prefetched = _listed_by(nodes, ops.prefetch_activations.default, 2)   # host copy -> its prefetches
    out: list[str] = []
    for n in nodes:
        if n.target is ops.wait_activation.default:
            out += _one_wait(n, prefetched.get(n.args[3], []), pos)
    for h, pre in prefetched.items():
        if not any(u.target is ops.wait_activation.default for u in h.users):
            out.append(f"backward: saved activation {h.name} is prefetched by {pre[0].name} but never waited for")
    return out


def _one_wait(n: fx.Node, pre: list[fx.Node], pos: dict) -> list[str]:
    ops = torch.ops.socompile
    h, ticket = n.args[3], n.args[4]
    out = []
    if len(pre) != 1:
        out.append(f"backward: saved activation {h.name} is prefetched {len(pre)} times, expected once")
    elif pos[pre[0]] > pos[n]:
        out.append(f"backward: {n.name} waits for {h.name} before its prefetch {pre[0].name}")
    elif ticket is not pre[0]:
        out.append(f"backward: {n.name} takes the ticket of {getattr(ticket, 'name', ticket)}, not of the "
                   f"prefetch {pre[0].name} that copies {h.name}: a scheduler may run it first")
    waits = [u for u in h.users if u.target is ops.wait_activation.default]
    if len(waits) != 1:
        out.append(f"backward: saved activation {h.name} has {len(waits)} waits, expected 1")
    direct = [u.name for u in h.users if u.target not in (ops.wait_activation.default,
                                                          ops.prefetch_activations.default)]
    if direct:
        out.append(f"backward: {direct} read the host copy {h.name} instead of its fetched device tensor")
    return out
