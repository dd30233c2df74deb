"""Which layer group a graph node belongs to, read from Dynamo's module stack; shared by the activation
passes (recompute tags in activations.py, offload in activation_offload.py)."""
from __future__ import annotations

import re

from torch import fx

from ..options import OFFLOADED_CHOICES as OFFLOADED  # noqa: F401  (re-exported for the activation passes)

_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"(?:\.?_modules)?\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(path: str) -> str:
    """Dynamo's module path as a parameter-name prefix: "L['self'].layers.0.attn" -> "layers.0.attn";
    "L['self']._modules['layers']._modules['0']" -> "layers.0"."""
    path = _PREFIX.sub("", path)
    return _ITEM.sub(lambda m: "." + m.group(1), path).strip(".")


def layer_of(node: fx.Node, layers) -> str | None:
    """The layer group (one of ``layers``) whose module produced ``node``, from its ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for value in stack.values():
        path = module_path(value[0] if isinstance(value, tuple) else str(value))
        for layer in layers:
            if path == layer or path.startswith(layer + "."):
                found = layer        # innermost match wins (the stack is outermost first)
    return found
