"""A language model and its loss as one module, so ``torch.compile`` captures the loss in the training graph.

The planner sees only what is compiled. A cross-entropy computed outside the compiled model holds its own
temporaries on the device (the logits cast to fp32, log-softmax, and their gradients: about three fp32 copies
of the logits at the start of backward) that no plan can count; compiled with the model they are in the graph
the plan is made from, as they are in plan reports (capture/trace.py traces the same loss).
"""
from __future__ import annotations

import torch
from torch import nn

from ..capture.trace import lm_loss


class WithLMLoss(nn.Module):
    """``WithLMLoss(model)(tokens, targets)`` is the next-token cross-entropy of ``model(tokens)``'s logits,
    computed in fp32 (bf16 logits are upcast first, as mixed-precision training does)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(tokens).float(), targets)
