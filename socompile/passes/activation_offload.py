"""Activation offload: the two passes that move offloaded layers' saved tensors to host memory in forward
and back in backward (check.py holds what they write to its invariants). Separate from activations.py (which
tags layers for recompute in the joint graph, before partitioning) because these run later, as passes of the
table (table.py), on the partitioned graphs, with a runtime of their own (runtime/activation_offload.py, bound
by socompile/pipeline.py with the buckets).

**offload** is applied by two passes on the partitioned graphs::

    forward (activation_offload_forward), for each saved-for-backward tensor t produced in an offloaded layer L:
        t = <layer compute>
        h = socompile.offload_activation(rt, "layers.3", t)       # right after t: device->host copy queued
        ... the forward goes on (and may still read t) ...
        socompile.offload_wait(rt, L, [h..], [t..])               # once the next offloaded layer has produced
                                                                  # its saved tensors (last layer: at the end);
                                                                  # t is freed right after
        return (..., h, ...)                                      # the host copy is what autograd saves

    backward (activation_offload_backward), per offloaded layer L, in the order the backward reaches them:
        ticket = socompile.prefetch_activations(rt, L, [h_1..h_k])  # when the layer before L (in backward order)
                                                                  # starts: host->device copies overlap it
        t_i = socompile.wait_activation(rt, L, i, h_i, ticket, device)  # before the first use of h_i
        ... every use of h_i reads t_i ...

Tensors that are not offloaded: parameters and views of them (weights are the planner's business, weight flow
streams them), graph inputs, tensors that are also returned to the user, and tensors whose layout a flat buffer
cannot hold (overlapping or expanded strides).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx

from ..ops import activation_ops  # noqa: F401  (registers socompile::offload_activation / prefetch / wait)
from .graph_build import GraphBuilder
from .layers import OFFLOADED, layer_of

log = logging.getLogger("socompile")

FW_NAME = "activation_offload_forward"
BW_NAME = "activation_offload_backward"


@dataclasses.dataclass(frozen=True)
class Offloaded:
    layer: str
    index: int           # position among the layer's offloaded tensors in forward order
    device: torch.device


@dataclasses.dataclass(frozen=True)
class OffloadedActivations:
    """What activation_offload_forward hands to activation_offload_backward: per forward output name (the
    backward placeholder that receives its host copy), where it came from."""
    tensors: tuple[tuple[str, Offloaded], ...] = ()

    def by_placeholder(self) -> dict[str, Offloaded]:
        return dict(self.tensors)


def _repeated_layers(ctx, layers) -> list[str]:
    """Every repeated layer group of the compiled model (from its parameter names), ``layers`` included."""
    from ..perf.analysis import is_repeated_layer, layer_group
    names = ctx.param_names.values()
    return sorted({layer_group(n) for n in names if is_repeated_layer(n)} | set(layers))


def _layer_starts(gm: fx.GraphModule, layers) -> dict[str, fx.Node]:
    """The first node of each layer group in the graph."""
    out: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            layer = layer_of(node, layers)
            if layer is not None and layer not in out:
                out[layer] = node
    return out


def _first_gradients(gm: fx.GraphModule, ctx) -> dict[str, fx.Node]:
    """Per layer group, the backward node that produces the first of its parameters' gradients (from the IR)."""
    from ..perf.analysis import is_repeated_layer, layer_group
    nodes = {n.name: n for n in gm.graph.nodes}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    out: dict[str, fx.Node] = {}
    for param, key in (getattr(ctx.ir, "grad_node", None) or {}).items():
        node = nodes.get(key.split(":", 1)[1])
        if node is None or not is_repeated_layer(param):
            continue
        layer = layer_group(param)
        if layer not in out or position[node] < position[out[layer]]:
            out[layer] = node
    return out


def _is_saved_output(desc) -> bool:
    return type(desc).__name__ == "SavedForBackwardsAOTOutput"


def _root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node


def _layer_of_saved(node: fx.Node, layers) -> str | None:
    """The layer whose saved tensor ``node`` is. The partitioner saves some outputs through a view it adds
    itself (a ``detach`` of the attention output), which has no module stack: such a view belongs to the layer
    of the tensor it views, as the plan's graph analysis counts it (perf/analysis.py: saved bytes by root)."""
    return layer_of(node, layers) or layer_of(_root(node), layers)


def activation_offload_forward(gm: fx.GraphModule, plan, ctx) -> tuple[fx.GraphModule, OffloadedActivations]:
    from ..runtime.activation_offload import offloadable
    layers = [layer for layer, choice in plan.activations if choice in OFFLOADED]
    if not layers or ctx.offload is None:
        return gm, OffloadedActivations()
    if BW_NAME in ctx.options.disable_passes:
        log.warning("socompile: %s is disabled, so activations are not offloaded either", BW_NAME)
        return gm, OffloadedActivations()
    rt = ctx.activation_offload      # bound by the pipeline with the buckets when layers offload
    build = GraphBuilder(gm, FW_NAME)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    descs = output.meta.get("desc")
    if descs is None:     # no descriptors: the saved tensors are the backward's non-tangent placeholders
        saved_names = {n.name for n in ctx.backward_graph.graph.nodes
                       if n.op == "placeholder" and "tangents" not in n.name}
        saved = [isinstance(a, fx.Node) and a.name in saved_names for a in outputs]
    else:
        saved = [_is_saved_output(d) for d in descs]
    returned = {a for a, s in zip(outputs, saved) if not s and isinstance(a, fx.Node)}
    plan_map: dict[str, Offloaded] = {}
    per_layer: dict[str, int] = {}
    offloads: dict[str, list[fx.Node]] = {}    # layer -> its offload nodes, in forward order
    for position, (arg, is_saved) in enumerate(zip(outputs, saved)):
        if not is_saved or not isinstance(arg, fx.Node) or arg in returned or arg.name in plan_map:
            continue
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or not offloadable(val) or _root(arg).op == "placeholder":
            continue
        layer = _layer_of_saved(arg, layers)
        if layer is None:
            continue
        index = per_layer.get(layer, 0)
        per_layer[layer] = index + 1
        with gm.graph.inserting_after(arg):
            host = build.call(torch.ops.socompile.offload_activation.default, (rt.handle, layer, arg),
                              f"{layer} offloads its activations: saved {tuple(val.shape)} {val.dtype} "
                              f"goes to host memory", arg)
        if build.fake is not None:
            with build.fake:
                host.meta["val"] = torch.empty_strided(val.size(), val.stride(), dtype=val.dtype, device="cpu")
        outputs[position] = host
        plan_map[arg.name] = Offloaded(layer, index, val.device)
        offloads.setdefault(layer, []).append(host)
    output.args = (tuple(outputs),)
    # Each offloaded layer's copies are waited for when the layer after next starts (the last layers': before
    # the forward returns): the next layer's compute overlaps them, and at most two layers' offloaded tensors
    # are on the device at once.
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for hosts in offloads.values():
        hosts.sort(key=position.__getitem__)
    starts = _layer_starts(gm, _repeated_layers(ctx, layers))
    sequence = sorted(starts, key=lambda layer: position[starts[layer]])
    for layer in sorted(offloads, key=lambda layer: position[offloads[layer][0]]):
        last = offloads[layer][-1]
        k = sequence.index(layer) if layer in sequence else -1
        later = sequence[k + 2] if 0 <= k and k + 2 < len(sequence) else None
        if later is not None and position[starts[later]] > position[last]:
            where = gm.graph.inserting_before(starts[later])
            why = f"{layer}: its copies to host memory are done before {later} starts"
        else:
            where = gm.graph.inserting_before(output)
            why = f"{layer}: its copies to host memory are done before the forward returns"
        keepalive = [h.args[2] for h in offloads[layer]]
        with where:
            build.call(torch.ops.socompile.offload_wait.default, (rt.handle, layer, offloads[layer], keepalive),
                       f"{why}; its device tensors are freed here", last)
    log.info("socompile: %d saved tensor(s) of %d layer(s) offloaded to host memory", len(plan_map), len(per_layer))
    return gm, OffloadedActivations(tuple(plan_map.items()))


def activation_offload_backward(gm: fx.GraphModule, plan, ctx, record: OffloadedActivations | None) -> fx.GraphModule:
    offloaded = record.by_placeholder() if record is not None else {}
    if not offloaded:
        return gm
    rt = ctx.activation_offload      # bound by the pipeline with the buckets when layers offload
    build = GraphBuilder(gm, BW_NAME)
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    holders = {n.name: n for n in nodes if n.op == "placeholder" and n.name in offloaded}
    missing = sorted(set(offloaded) - set(holders))
    if missing:
        raise RuntimeError(f"socompile: offloaded activations {missing} are not inputs of the backward graph")
    first_compute = next(n for n in nodes if n.op != "placeholder")

    def first_use(h: fx.Node) -> fx.Node:
        return min(h.users, key=position.__getitem__) if h.users else first_compute

    by_layer: dict[str, list[fx.Node]] = {}
    for h in holders.values():
        by_layer.setdefault(offloaded[h.name].layer, []).append(h)
    uses = {h: first_use(h) for h in holders.values()}
    for hs in by_layer.values():      # copied back in the order the backward needs them (the stream is FIFO)
        hs.sort(key=lambda h: (position[uses[h]], offloaded[h.name].index))
    # the order the backward reaches the layers in (the last forward layer first)
    start = {layer: min((uses[h] for h in hs), key=position.__getitem__) for layer, hs in by_layer.items()}
    order = sorted(by_layer, key=lambda layer: position[start[layer]])
    # Prefetches first, then waits: nodes inserted before the same anchor stay in insertion order, so a layer's
    # prefetch precedes its waits even where two layers' first uses are the same node.
    # Where: when the backward of the layer plan.activation_prefetch_ahead places later in the forward gets under
    # way (its first weight gradient), so the copies overlap that layer's backward; failing that, when the offloaded
    # layer before it in backward order starts, or at the start of backward.
    sequence = []
    if ctx.forward_graph is not None:
        fw_starts = _layer_starts(ctx.forward_graph, _repeated_layers(ctx, list(by_layer)))
        fw_pos = {n: i for i, n in enumerate(ctx.forward_graph.graph.nodes)}
        sequence = sorted(fw_starts, key=lambda layer: fw_pos[fw_starts[layer]])
    grads = _first_gradients(gm, ctx)
    ahead = plan.activation_prefetch_ahead     # the planner's decision (plan/plan.py)
    tickets: dict[str, fx.Node] = {}
    for i, layer in enumerate(order):
        k = sequence.index(layer) if layer in sequence else -1
        # A layer's output is the next layer's input, read as soon as the next layer's backward starts: so the
        # first candidate that comes before the layer's first use is taken, the planned distance later or more.
        later = [sequence[j] for j in range(k + ahead, len(sequence)) if k >= 0 and sequence[j] in grads
                 and position[grads[sequence[j]]] < position[start[layer]]]
        if later:
            anchor, why = grads[later[0]], f"{layer}: its saved activations come back while the backward of " \
                                           f"{later[0]} runs"
        elif i > 0 and position[start[order[i - 1]]] < position[start[layer]]:
            ahead = order[i - 1]
            anchor, why = start[ahead], f"{layer}: its saved activations come back while the backward of {ahead} runs"
        else:
            anchor, why = first_compute, f"{layer}: its saved activations start coming back at the start of backward"
        with gm.graph.inserting_before(anchor):
            tickets[layer] = build.call(torch.ops.socompile.prefetch_activations.default,
                                        (rt.handle, layer, by_layer[layer]), why, anchor)
        if build.fake is not None:
            with build.fake:
                tickets[layer].meta["val"] = torch.empty(0, device="cpu")
    for layer in order:
        for h in by_layer[layer]:
            info = offloaded[h.name]
            v = h.meta.get("val")
            if v is not None and build.fake is not None:
                with build.fake:     # the backward receives the host copy
                    h.meta["val"] = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device="cpu")
            anchor = uses[h]
            index = by_layer[layer].index(h)     # its place in the prefetch's list
            with gm.graph.inserting_before(anchor):
                w = build.call(torch.ops.socompile.wait_activation.default,
                               (rt.handle, layer, index, h, tickets[layer], info.device),
                               f"{layer}: saved activation {index} back on the device before its first use",
                               anchor)
            if v is not None and build.fake is not None:
                with build.fake:
                    w.meta["val"] = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=info.device)
            h.replace_all_uses_with(w, delete_user_cb=lambda user: user.target not in (
                torch.ops.socompile.wait_activation.default, torch.ops.socompile.prefetch_activations.default))
    return gm
