"""Pass: stream the weights of weight-flow buckets to the device for each use, in forward and again in backward.

Pattern inserted per flow bucket b (places from plan/flow_schedule.py; d = b's prefetch distance)::

    ... before the first use of the flow bucket d places earlier ...
    socompile.prefetch(rt, phase, b)                       # device buffer + async host->device copy
    ... compute of earlier buckets overlaps the copy ...
    flat_b = socompile.wait_weights(rt, phase, b, numel, link_dtype, device)
    w_i = flat_b[off_i : off_i + n_i].view(shape_i)        # per parameter i of b
    w_i = convert_element_type(w_i, compute_dtype)         # only when the link precision differs (a device cast)
    ... every use of parameter i (or of a saved view of it) now reads w_i (or the same view of w_i) ...
    socompile.release(rt, phase, b, [last readers])         # after the last use

Forward: saved-for-backward outputs that are the parameter or a view of it are rebuilt from the parameter
itself (the host master), never from w_i, so nothing the backward keeps holds the device buffer: it is freed
at its last use. Backward: those saved placeholders are re-materialised from the re-fetched w_i by replaying
the same view ops (e.g. ``aten.t``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ..dtypes import TORCH_DTYPES
from ..ops import offload_ops  # noqa: F401  (registers socompile::prefetch / wait_weights / release)
from .graph_build import GraphBuilder

FW_NAME = "weight_flow_forward"
BW_NAME = "weight_flow_backward"



@dataclasses.dataclass(frozen=True)
class SavedViews:
    """What weight_flow_forward hands to weight_flow_backward: per backward placeholder that saves a view of a
    flow parameter, the view ops to replay on the re-fetched weights (``(target, args after the input)``)."""
    chains: tuple[tuple[str, tuple], ...] = ()

    def by_placeholder(self) -> dict[str, tuple]:
        return dict(self.chains)


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _flow_placeholders(gm: fx.GraphModule, ctx, phase: str, flow_params: set[str]) -> dict[str, list[fx.Node]]:
    """Placeholders that are a flow parameter or (backward) a saved view of one, by parameter name."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        data = ctx.ir.graph.nodes.get(f"{phase}:{node.name}")
        alias = data.get("alias_of") if data else None
        if alias in flow_params:
            out.setdefault(alias, []).append(node)
    return out


def _last_readers(anchor: fx.Node) -> list[fx.Node]:
    """Tensor outputs of the last reader (its getitems when it returns a tuple)."""
    if isinstance(anchor.meta.get("val"), torch.Tensor):
        return [anchor]
    return [u for u in anchor.users if isinstance(u.meta.get("val"), torch.Tensor)]


def _apply(gm: fx.GraphModule, plan, ctx, phase: str, pass_name: str, chains: dict) -> fx.GraphModule:
    """``chains``: bw placeholder name -> view ops to replay on the parameter (filled in forward, read in
    backward)."""
    # Graphs planned for reading only (offline plan/dump: no optimizer, no runtime) get no flow nodes.
    schedule = ctx.flow_schedule.get(phase, [])
    if not schedule or ctx.offload is None:
        return gm
    runtime = ctx.offload
    build = GraphBuilder(gm, pass_name)
    nodes = {n.name: n for n in gm.graph.nodes}
    buckets = {b.index: b for b in plan.buckets}
    flow_params = {p for b in plan.buckets if b.weight_mode == "flow" for p in b.params}
    holders = _flow_placeholders(gm, ctx, phase, flow_params)
    fetched: dict[fx.Node, str] = {}        # per-parameter weight node -> parameter name
    tickets: dict[int, fx.Node] = {}        # bucket -> its prefetch node, whose output its wait takes (order by data)
    for action in schedule:
        anchor = nodes[action.anchor.split(":", 1)[1]]
        b = buckets[action.bucket]
        why = f"bucket {b.index} ({b.layers}) flows, prefetch distance {b.prefetch_distance}"
        if action.kind == "prefetch":
            with gm.graph.inserting_before(anchor):
                tickets[b.index] = build.call(torch.ops.socompile.prefetch.default, (runtime.handle, phase, b.index),
                                              f"{why}: start its copy to the device", anchor)
        elif action.kind == "wait":
            flat_bucket = runtime.buckets[b.index]
            like = next(holders[p][0] for p in b.params if p in holders).meta["val"]
            link = TORCH_DTYPES[b.param_link_dtype]
            with gm.graph.inserting_before(anchor):
                flat = build.call(torch.ops.socompile.wait_weights.default,
                                  (runtime.handle, phase, b.index, flat_bucket.numel, link, like.device,
                                   tickets.pop(b.index, None)),
                                  f"{why}: its weights are needed from here", anchor)
                for i, name in enumerate(b.params):
                    if name not in holders:
                        continue
                    param_val = holders[name][0].meta["val"]     # a view has its parameter's dtype
                    start, size = flat_bucket.offsets[i], flat_bucket.sizes[i]
                    w = build.call(torch.ops.aten.slice.Tensor, (flat, 0, start, start + size), why, anchor)
                    w = build.call(torch.ops.aten.view.default, (w, list(flat_bucket.params[i].shape)), why, anchor)
                    if param_val.dtype != link:
                        w = build.call(torch.ops.prims.convert_element_type.default, (w, param_val.dtype),
                                       f"{why}: cast {b.param_link_dtype} -> {param_val.dtype} on the device", anchor)
                    fetched[w] = name
                    for holder in holders[name]:
                        value = w
                        if phase == "bw" and not _is_parameter_input(holder):
                            for target, rest in chains.get(holder.name) or _chain_in(ctx.forward_graph, holder.name):
                                value = build.call(target, (value, *rest), f"{why}: saved view re-materialised",
                                                   holder)
                        holder.replace_all_uses_with(value, delete_user_cb=lambda user: user.op != "output")
        else:   # release
            after = _last_readers(anchor)
            position = {n: i for i, n in enumerate(gm.graph.nodes)}
            with gm.graph.inserting_after(max([anchor, *after], key=position.__getitem__)):
                build.call(torch.ops.socompile.release.default, (runtime.handle, phase, b.index, after),
                           f"{why}: last use in this phase", anchor)
    if phase == "fw":
        _saved_outputs_from_master(gm, build, fetched, holders, chains)
    else:
        _unpin_from_optimizer_steps(gm, fetched)
    return gm


def _unpin_from_optimizer_steps(gm: fx.GraphModule, fetched: dict[fx.Node, str]) -> None:
    """``bucket_grads_ready`` lists the last readers of its bucket's weights only to be ordered after them;
    a view of a fetched weight in that list would keep the device buffer alive until the step. Drop those: the
    step writes the host master, which the compute no longer reads, and the fetch that read the master was
    waited for before the first use (the ops' ORDERED effect keeps the wait before the step)."""
    for node in gm.graph.nodes:
        if node.target is not torch.ops.socompile.bucket_grads_ready.default:
            continue
        kept = []
        for a in node.args[1]:
            root = a
            while isinstance(root, fx.Node) and root not in fetched and _is_view(root):
                root = root.args[0]
            if root not in fetched:
                kept.append(a)
        node.args = (node.args[0], kept, *node.args[2:])


def _is_parameter_input(node: fx.Node) -> bool:
    return type(node.meta.get("desc")).__name__ == "PlainAOTInput"


def _chain_in(fw: fx.GraphModule, name: str) -> list:
    """The view ops from a parameter placeholder to the forward node ``name`` (the forward was not rewritten,
    e.g. weight_flow_forward disabled by name, so its saved view still hangs off the parameter)."""
    node = next((n for n in fw.graph.nodes if n.name == name), None)
    ops = []
    while node is not None and node.op != "placeholder":
        if not _is_view(node) or any(isinstance(a, fx.Node) for a in node.args[1:]):
            raise NotImplementedError(f"weight flow: cannot re-materialise the saved tensor {name!r} in backward "
                                      f"(not a static view of a parameter); keep its bucket stationary")
        ops.append((node.target, tuple(node.args[1:])))
        node = node.args[0]
    if node is None:
        raise KeyError(f"weight flow: saved tensor {name!r} is not in the forward graph")
    return ops[::-1]


def _saved_outputs_from_master(gm: fx.GraphModule, build: GraphBuilder, fetched: dict[fx.Node, str],
                               holders: dict[str, list[fx.Node]], chains: dict) -> None:
    """Forward outputs (saved for backward) that are views of a fetched weight: rebuild them from the parameter
    placeholder, so the saved tensor keeps the host master alive, not the device buffer; remember the view ops
    so the backward can replay them on its re-fetched weights."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    new_args, replaced = [], []
    for arg in output.args[0]:
        ops, root = [], arg
        while isinstance(root, fx.Node) and root not in fetched and _is_view(root):
            ops.append((root.target, tuple(root.args[1:])))
            root = root.args[0]
        if isinstance(root, fx.Node) and root in fetched and ops:
            if any(isinstance(a, fx.Node) for _, rest in ops for a in rest):
                raise NotImplementedError(f"weight flow: the saved view {arg.name} of {fetched[root]} has symbolic "
                                          f"view arguments; keep this bucket stationary (weight_mode='planned')")
            ops.reverse()
            value = holders[fetched[root]][0]
            with gm.graph.inserting_before(output):
                for target, rest in ops:
                    value = build.call(target, (value, *rest), "saved for backward: a view of the host master, "
                                                               "not of the device buffer", arg)
            chains[arg.name] = ops
            new_args.append(value)
            replaced.append(arg)
        elif isinstance(root, fx.Node) and root in fetched:
            new_args.append(holders[fetched[root]][0])
        else:
            new_args.append(arg)
    output.args = (tuple(new_args),)
    for arg in replaced:
        _erase_dead_views(gm, arg, fetched)


def _erase_dead_views(gm: fx.GraphModule, node: fx.Node, fetched: dict[fx.Node, str]) -> None:
    """Erase a saved view of a fetched weight that its rebuilt copy replaced, and the views under it that nothing
    else reads: placed after the bucket's release (plan/flow_schedule.py), they would read a released buffer."""
    while isinstance(node, fx.Node) and node not in fetched and _is_view(node) and not node.users:
        parent = node.args[0]
        gm.graph.erase_node(node)
        node = parent


def weight_flow_forward(gm: fx.GraphModule, plan, ctx) -> tuple[fx.GraphModule, SavedViews]:
    chains: dict[str, tuple] = {}
    gm = _apply(gm, plan, ctx, "fw", FW_NAME, chains)
    return gm, SavedViews(tuple((name, tuple(ops)) for name, ops in chains.items()))


def weight_flow_backward(gm: fx.GraphModule, plan, ctx, saved: SavedViews | None) -> fx.GraphModule:
    """``saved`` None (weight_flow_forward turned off): the saved views are read off the forward graph."""
    return _apply(gm, plan, ctx, "bw", BW_NAME, saved.by_placeholder() if saved is not None else {})
