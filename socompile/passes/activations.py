"""Activations per layer: keep, recompute (activation checkpointing), selective (recompute all but attention)
or offload to host memory, as planned (``Plan.activations``: layer group such as "layers.3" -> "keep" |
"recompute" | "selective" | "offload").

**recompute** is applied at partition time (``repartition``, called by socompile/pipeline.py right after the
plan): the forward nodes of each such layer in the joint graph are tagged the way torch's selective activation
checkpointing tags them (``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``, ``meta["ac_graph_id"]`` one per
layer), the layer's outputs to the rest of the forward are tagged ``MUST_SAVE`` (they are the next layer's
input, the one tensor a checkpointed layer keeps), random ops are tagged ``MUST_SAVE`` (recomputing them would
draw new numbers), and the stock min-cut partitioner runs again; it honours the tags. **selective** is the
same with the layer's attention kernels (SDPA / flash attention) and their outputs (out, logsumexp, RNG state:
what the attention backward reads besides q, k, v) also tagged ``MUST_SAVE``: the backward recomputes the
projections, norms, rotary and MLP from the layer's input, never the attention itself. The pipeline rebuilds
the IR from the new graphs and re-anchors the plan on it (plan/anchor.py: the plan is not made again), so every
node the plan names (bucket ``ready_after``, flow anchors) is a node of the graphs that run.

**offload** (and selective_offload's checkpoints) is applied by two passes on the partitioned graphs, in
activation_offload.py (listed with the other passes in table.py).
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from ..options import ACTIVATION_CHOICES as CHOICES  # noqa: F401  (the choices this module applies)
from .layers import OFFLOADED, layer_of  # noqa: F401  (OFFLOADED: the choices activation_offload applies)

log = logging.getLogger("socompile")

RECOMPUTE_NAME = "activation_recompute"   # the name its before/after dumps carry (applied at partition time)



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


RECOMPUTED = ("recompute", "selective", "selective_offload")   # choices whose layer is recomputed in backward
SELECTIVE = ("selective", "selective_offload")                # ... with its attention outputs kept


def recomputed_layers(choices) -> tuple[list[str], set[str]]:
    """The layers of ``choices`` (Plan.activations) recomputed in backward, and those of them that are selective."""
    recompute = [layer for layer, choice in choices if choice in RECOMPUTED]
    selective = {layer for layer, choice in choices if choice in SELECTIVE}
    return recompute, selective


def repartition(joint: "Repartition", recompute: list[str], selective: set[str]):
    """Tag ``recompute`` (``selective``: attention kept) in the joint graph and partition it again with the same
    partitioner, which honours the tags. Returns the new (forward, backward) and the nodes tagged per layer.
    Decides nothing: the layers are the plan's (socompile/pipeline.py calls it)."""
    counts = tag_recompute(joint.joint, recompute, selective)
    fw, bw = joint()
    return fw, bw, counts


class Repartition:
    """What backend.py hands to ``repartition``: run the same partitioner on the same joint graph again."""

    def __init__(self, partition_fn, joint, joint_inputs, kwargs):
        self.partition_fn, self.joint, self.joint_inputs, self.kwargs = partition_fn, joint, joint_inputs, kwargs

    def __call__(self):
        return self.partition_fn(self.joint, self.joint_inputs, **self.kwargs)
