"""Activations per layer: keep, recompute (activation checkpointing), selective (recompute all but attention)
or offload to host memory, as planned (``Plan.activations``: layer group such as "layers.3" -> "keep" |
"recompute" | "selective" | "offload").

**recompute** is applied at partition time (``repartition``, called by backend._apply_plan right after the first
plan): the forward nodes of each such layer in the joint graph are tagged the way torch's selective activation
checkpointing tags them (``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``, ``meta["ac_graph_id"]`` one per
layer), the layer's outputs to the rest of the forward are tagged ``MUST_SAVE`` (they are the next layer's
input, the one tensor a checkpointed layer keeps), random ops are tagged ``MUST_SAVE`` (recomputing them would
draw new numbers), and the stock min-cut partitioner runs again; it honours the tags. **selective** is the
same with the layer's attention kernels (SDPA / flash attention) and their outputs (out, logsumexp, RNG state:
what the attention backward reads besides q, k, v) also tagged ``MUST_SAVE``: the backward recomputes the
projections, norms, rotary and MLP from the layer's input, never the attention itself. The IR is rebuilt from
the new graphs and the plan is made again with the first plan's activation choices pinned, so every node the
plan names (bucket ``ready_after``, flow anchors) is a node of the graphs that run.

**offload** (and selective_offload's checkpoints) is applied by two passes on the partitioned graphs, in
activation_offload.py (listed with the other passes in table.py).
"""
from __future__ import annotations

import contextlib
import logging
import operator

import torch
from torch import fx

from ..options import ACTIVATION_CHOICES as CHOICES
from .layers import OFFLOADED, layer_of

log = logging.getLogger("socompile")

RECOMPUTE_NAME = "activation_recompute"   # the name its before/after dumps carry (applied at partition time)

_override: dict[str, str] | None = None


@contextlib.contextmanager
def override(choices: dict[str, str]):
    """Pin per-layer choices by hand for graphs compiled inside the block (the partition happens at the first
    call of the compiled model)::

        with socompile.passes.activations.override({"layers.0": "recompute", "layers.1": "offload"}):
            loss = F.cross_entropy(cmodel(x)...)      # first call: compiles with these choices

    Layers not named keep the planner's choice."""
    global _override
    bad = {k: v for k, v in choices.items() if v not in CHOICES}
    if bad:
        raise ValueError(f"activation choices must be one of {CHOICES}, got {bad}")
    previous, _override = _override, dict(choices)
    try:
        yield
    finally:
        _override = previous


def _tangent_closure(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent (the backward part)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or \
                node.meta.get("partitioner_tag") == "is_backward" or any(i in out for i in node.all_input_nodes):
            out.add(node)
    return out


def _is_random(node: fx.Node) -> bool:
    """Draws random numbers. Attention ops are tagged random for their dropout: with ``dropout_p == 0`` they are
    not (recomputing them gives the same result, and they are the costliest tensors of a layer to save)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def _is_attention(node: fx.Node) -> bool:
    """An attention kernel (SDPA, flash / efficient / cuDNN attention; the cost model's 'attention' class)."""
    from ..perf.cost import op_class
    return isinstance(node.target, torch._ops.OpOverload) and op_class(str(node.target), False) == "attention"


def tag_recompute(joint: fx.GraphModule, layers: list[str], selective=()) -> dict[str, int]:
    """Tag the forward nodes of ``layers`` in the joint graph for recomputation; returns nodes tagged per layer.
    Layers in ``selective`` (a subset of ``layers``) keep their attention kernels' outputs (MUST_SAVE)."""
    from torch.utils.checkpoint import CheckpointPolicy
    backward = _tangent_closure(joint.graph)
    graph_id: dict[str, int] = {}
    owner: dict[fx.Node, str] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        layer = layer_of(node, layers)
        if layer is not None:
            owner[node] = layer
            graph_id.setdefault(layer, len(graph_id) + 1)   # forward order: ids increase layer after layer
    # Saved, not recomputed: random ops (recomputing would draw new numbers; a tuple is saved as its items) and
    # the layer's outputs to the rest of the forward (the next layer's input: what a checkpointed layer keeps).
    save: set[fx.Node] = set()
    for node, layer in owner.items():
        if _is_random(node) or (layer in selective and _is_attention(node)):
            save.add(node)
            save.update(u for u in node.users if u.target is operator.getitem and u not in backward)
        if any(u not in backward and u.op != "output" and owner.get(u) != layer for u in node.users):
            save.add(node)
    counts = {layer: 0 for layer in layers}
    for node, layer in owner.items():
        node.meta["ac_graph_id"] = graph_id[layer]
        if node in save:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            counts[layer] += 1
    return counts


def _choices(ctx) -> tuple[tuple[str, str], ...]:
    planned = dict(ctx.plan.activations)
    if _override:
        planned.update(_override)
    return tuple((layer, choice) for layer, choice in planned.items() if choice in CHOICES)


def repartition(ctx, fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Called by backend._apply_plan after the first plan. With an ``override``, the plan is made again with the
    overridden choices pinned. Layers to recompute: tag the joint graph, partition again, rebuild the IR and
    plan again with the same choices pinned (``plan(..., activations=...)``). Returns the graphs the passes will
    rewrite."""
    from ..plan import get_profile, plan
    repartition_fn = getattr(ctx, "repartition", None)
    ctx.repartition = None          # drop the joint graph once used (it holds fake tensors)
    choices = _choices(ctx)
    if choices != ctx.plan.activations:
        ctx.plan = plan(ctx.ir, get_profile(ctx.options.target), ctx.options, activations=choices)
        choices = ctx.plan.activations
    offload = [layer for layer, choice in choices if choice in OFFLOADED]
    if offload and (ctx.optimizer is None or not ctx.plan.buckets):
        log.warning("socompile: layers %s are planned to offload their activations, but the passes run only for "
                    "parameters of a socompile.AdamW; their activations are kept", ", ".join(offload))
    recompute = [layer for layer, choice in choices if choice in ("recompute", "selective", "selective_offload")]
    selective = {layer for layer, choice in choices if choice in ("selective", "selective_offload")}
    if not recompute:
        return fw, bw
    if repartition_fn is None:
        log.warning("socompile: layers %s are planned to recompute their activations but this compile has no "
                    "joint graph to partition again; their activations are kept", ", ".join(recompute))
        return fw, bw
    counts = tag_recompute(repartition_fn.joint, recompute, selective)
    before_fw, before_bw = fw.code, bw.code
    fw, bw = repartition_fn()
    from ..capture import build_ir, describe
    infos = [describe(i, name, ctx.param_objects[i], optimized=ctx.optimizer is not None)
             for i, name in ctx.param_names.items()]
    ctx.ir = build_ir(fw, bw, infos)
    ctx.plan = plan(ctx.ir, get_profile(ctx.options.target), ctx.options, activations=choices)
    ctx.forward_graph, ctx.backward_graph = fw, bw
    ctx.record_dump("fw", RECOMPUTE_NAME, before_fw, fw.code, fw)
    ctx.record_dump("bw", RECOMPUTE_NAME, before_bw, bw.code, bw)
    ctx.activation_recomputed = counts
    log.info("socompile: recompute activations of %d layer(s) in backward (%d selective: attention kept; %d "
             "forward nodes tagged)", len(recompute), len(selective), sum(counts.values()))
    return fw, bw


class Repartition:
    """What backend.py hands to ``repartition``: run the same partitioner on the same joint graph again."""

    def __init__(self, partition_fn, joint, joint_inputs, kwargs):
        self.partition_fn, self.joint, self.joint_inputs, self.kwargs = partition_fn, joint, joint_inputs, kwargs

    def __call__(self):
        return self.partition_fn(self.joint, self.joint_inputs, **self.kwargs)
