"""Which module produced a graph node, from the ``nn_module_stack`` Dynamo records on it.

Read by the IR (capture/ir.py: the planner attributes saved tensors to layers by it) and by the activation
passes (passes/layers.py: which layer's tensors to offload or recompute), so both attribute a node to the same
layer. Graphs traced without Dynamo (plan reports: capture/trace.py) have no module stacks.
"""
from __future__ import annotations

import re

from torch import fx

_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"(?:\.?_modules)?\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(path: str) -> str:
    """Dynamo's module path as a parameter-name prefix: "L['self'].layers.0.attn" -> "layers.0.attn";
    "L['self']._modules['layers']._modules['0']" -> "layers.0"."""
    path = _PREFIX.sub("", path)
    return _ITEM.sub(lambda m: "." + m.group(1), path).strip(".")


def module_paths(node: fx.Node) -> tuple[str, ...]:
    """The module paths of ``node``'s stack, outermost first; () when Dynamo recorded none."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(module_path(v[0] if isinstance(v, tuple) else str(v)) for v in stack.values())


def innermost_layer(paths, layers) -> str | None:
    """The layer group (one of ``layers``) of the innermost of ``paths`` inside one."""
    found = None
    for path in paths:
        for layer in layers:
            if path == layer or path.startswith(layer + "."):
                found = layer
    return found
