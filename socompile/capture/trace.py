"""Trace a model's training graphs without running a step, for plan reports and graph dumps.

The model may be built under ``FakeTensorMode`` (no memory for weights), which is how a 25B plan is made on
a laptop. NOTE: not the meta device: on meta, AOTAutograd silently drops the backward of
``nll_loss``/``cross_entropy``, so the backward graph (and every plan made from it) would be wrong.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import fx, nn

from . import fold as fold_blocks
from .params import ParamInfo, describe

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def trace_training_graphs(model: nn.Module, inputs: tuple, targets: tuple, loss_fn: LossFn = lm_loss,
                          fold: bool = True) -> tuple[fx.GraphModule, fx.GraphModule, list[ParamInfo]]:
    """Forward and backward graphs of ``loss_fn(model(*inputs), *targets)`` as AOTAutograd partitions them.

    fold: trace four of a deep model's identical blocks and repeat one of them in the graphs (capture/fold/):
    the same graphs, several times faster. Models that do not repeat cleanly are traced whole."""
    named = dict(model.named_parameters())  # tied weights appear once, as in Dynamo's inputs
    infos = [describe(i, name, p, optimized=p.requires_grad) for i, (name, p) in enumerate(named.items())]
    blocks = fold_blocks.find_blocks(model) if fold else None
    if blocks is not None:
        try:
            with fold_blocks.traced_subset(model, blocks):
                fw, bw, traced_names = _trace(model, inputs, targets, loss_fn)
            layout = fold_blocks.layout_for(traced_names, list(_state(model)), blocks, len(inputs) + len(targets))
            fw, bw = fold_blocks.expand(fw, bw, layout)
            return fw, bw, infos
        except fold_blocks.FoldError as exc:
            log.info("tracing all %d blocks of %s: %s", blocks.count, blocks.path, exc)
    fw, bw, _ = _trace(model, inputs, targets, loss_fn)
    return fw, bw, infos


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The traced graph's tensor inputs by name: parameters, then buffers (under FakeTensorMode a buffer
    captured as a constant is rejected by AOTAutograd)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _trace(model: nn.Module, inputs: tuple, targets: tuple, loss_fn: LossFn,
           ) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
    """(forward, backward, names of the parameter and buffer inputs in input order)."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    state = _state(model)
    names, values = list(state), list(state.values())
    n_params, n_inputs = len(values), len(inputs)

    def train_loss(*flat):
        params = dict(zip(names, flat[:n_params]))
        out = torch.func.functional_call(model, params, tuple(flat[n_params:n_params + n_inputs]))
        return loss_fn(out, *flat[n_params + n_inputs:])

    captured: dict[str, fx.GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        captured["fw"], captured["bw"] = fw, bw
        return fw, bw

    def no_compile(gm, _inputs):
        return gm

    compiled = aot_function(train_loss, fw_compiler=no_compile, bw_compiler=no_compile, partition_fn=partition)
    compiled(*values, *inputs, *targets)
    return captured["fw"], captured["bw"], names
