"""Find the parameters among a Dynamo graph's inputs and give them their module names.

Under Dynamo, parameters are graph inputs (placeholders), never ``get_attr``. The placeholder's
``meta["grapharg"].source`` says where Dynamo found the tensor, e.g.
``L['self']._modules['layers']._modules['0']._parameters['weight']``, which we turn into ``layers.0.weight``.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import fx, nn

_KEY = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter as the planner sees it: no tensor, only facts (JSON-friendly)."""

    name: str
    input_index: int          # position among the graph's inputs (== AOT PlainAOTInput idx)
    shape: tuple[int, ...]
    dtype: str
    numel: int
    requires_grad: bool
    optimized: bool           # owned by a socompile optimizer (its step goes into the backward graph)


def source_to_name(source_name: str) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight``; unknown forms pass through."""
    head = re.match(r"^(?:L|G)\['[^']*'\]", source_name)
    if not head:
        return source_name
    parts = [a or b for a, b in _KEY.findall(source_name[head.end():])]
    return ".".join(parts) if parts else source_name


def find_parameters(gm: fx.GraphModule, example_inputs: list) -> list[tuple[int, str, nn.Parameter]]:
    """(input index, qualified name, parameter) for every graph input that is an ``nn.Parameter``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    seen: dict[str, int] = {}
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, nn.Parameter):
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        name = source_to_name(source.name) if source is not None else node.name
        if name in seen:  # two sources for different tensors should not collide; keep names unique anyway
            name = f"{name}#{index}"
        seen[name] = index
        found.append((index, name, value))
    return found


def describe(index: int, name: str, param: torch.Tensor, optimized: bool) -> ParamInfo:
    return ParamInfo(name=name, input_index=index, shape=tuple(param.shape), dtype=str(param.dtype),
                     numel=param.numel(), requires_grad=param.requires_grad, optimized=optimized)
