"""Which layer group a graph node belongs to, read from Dynamo's module stack; shared by the activation
passes (recompute tags in activations.py, offload in activation_offload.py)."""
from __future__ import annotations

from torch import fx

from ..capture.module_stack import innermost_layer, module_paths
from ..options import OFFLOADED_CHOICES as OFFLOADED  # noqa: F401  (re-exported for the activation passes)


def layer_of(node: fx.Node, layers) -> str | None:
    """The layer group (one of ``layers``) whose module produced ``node``, from its ``nn_module_stack``
    (innermost match wins; the stack is outermost first)."""
    return innermost_layer(module_paths(node), layers)
