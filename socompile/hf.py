"""The Hugging Face Trainer in one switch: ``socompile.hf.Trainer`` for ``transformers.Trainer``.

    from socompile.hf import Trainer                      # instead of: from transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      socompile_options={"target": "gh200"})   # optional: the backend's options
    trainer.train()

What the subclass does, so that nothing else in a Trainer script changes:

- **The optimizer** is ``socompile.AdamW``, built from ``TrainingArguments`` the way the Trainer builds its own
  AdamW: ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, and the Trainer's two parameter groups
  (``weight_decay`` for the names ``get_decay_parameter_names`` returns, 0 for biases and norms). The Trainer's
  learning-rate scheduler is built around it as usual (schedulers write ``param_groups[i]["lr"]``).
- **Clipping** is the optimizer's: ``max_grad_norm`` goes to ``socompile.AdamW``, which validates the global norm
  before it commits what backward stepped on the CPU, and the Trainer's own clip is not run (it would clip a
  second time). The ``grad_norm`` the Trainer logs is the optimizer's pre-clip norm, the number torch's
  ``clip_grad_norm_`` returns.
- **Gradient accumulation**: ``gradient_accumulation_steps`` goes to the optimizer too.
- **Compiling**: the model is compiled in place with ``backend="superoffload"`` and ``socompile_options``, so
  the Trainer saves and loads the same ``state_dict`` keys. ``TrainingArguments(torch_compile=True,
  torch_compile_backend="superoffload")`` is taken to mean the same (accelerate would refuse the name).

A plain ``transformers.Trainer`` works too, with four coordinated settings (docs/hf.md, "By hand").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
import transformers

from .optim.adamw import AdamW

BACKEND = "superoffload"
# The Trainer's AdamW variants: socompile.AdamW computes the same update (the fused kernel included).
_ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused"}


def _optim_name(args: transformers.TrainingArguments) -> str:
    optim = args.optim
    return getattr(optim, "value", optim)


def _without_trainer_compile(args: transformers.TrainingArguments) -> transformers.TrainingArguments:
    """A copy of ``args`` in which the Trainer compiles nothing: socompile.hf.Trainer compiles the model
    itself, with options (accelerate's DynamoBackend lists torch's own backends only)."""
    backend = args.torch_compile_backend
    if not args.torch_compile and backend is None:
        return args
    if backend not in (None, BACKEND):
        raise ValueError(
            f"socompile.hf.Trainer compiles the model with backend={BACKEND!r}, but TrainingArguments asks for "
            f"torch_compile_backend={backend!r}. Drop torch_compile / torch_compile_backend from TrainingArguments "
            "(or set it to 'superoffload'), or use transformers.Trainer for another backend.")
    if args.torch_compile_mode is not None:
        raise ValueError(
            f"TrainingArguments(torch_compile_mode={args.torch_compile_mode!r}) with socompile.hf.Trainer: the "
            "superoffload backend runs host-side work at every step that CUDA-graph modes would skip. Drop "
            "torch_compile_mode.")
    return dataclasses.replace(args, torch_compile=False, torch_compile_backend=None)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains with socompile: see the module's docstring. ``socompile_options``
    are the backend's options (``torch.compile(..., options=...)``); every other argument is the Trainer's."""

    def __init__(self, model=None, args: transformers.TrainingArguments | None = None, *positional,
                 socompile_options: Mapping[str, Any] | None = None, **kwargs):
        if args is not None:
            if _optim_name(args) not in _ADAMW_OPTIMS:
                raise ValueError(
                    f"socompile.hf.Trainer trains with socompile.AdamW, but TrainingArguments asks for "
                    f"optim={_optim_name(args)!r}. Use optim='adamw_torch_fused' (the default) or 'adamw_torch', "
                    "or transformers.Trainer for another optimizer.")
            args = _without_trainer_compile(args)
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None and not isinstance(optimizers[0], AdamW):
            raise TypeError(
                f"socompile.hf.Trainer(optimizers=({type(optimizers[0]).__name__}, ...)): the superoffload backend "
                "steps the optimizer inside backward and needs a socompile.AdamW. Leave optimizers out (the Trainer "
                "builds socompile.AdamW from TrainingArguments) or pass a socompile.AdamW.")
        self.socompile_options = dict(socompile_options or {})
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"socompile.hf.Trainer(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        if model is not None and getattr(model, "_compiled_call_impl", None) is None:
            model.compile(backend=BACKEND, options=self.socompile_options)   # in place: same state_dict keys
        super().__init__(model, args, *positional, **kwargs)
        if self.args.max_grad_norm is not None and math.isfinite(self.args.max_grad_norm) and \
                self.args.max_grad_norm < 0:
            raise ValueError(f"TrainingArguments(max_grad_norm={self.args.max_grad_norm}) must be >= 0")

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """socompile.AdamW with the Trainer's parameter groups and hyper-parameters (see the module's docstring)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        max_norm = self.args.max_grad_norm
        self.optimizer = AdamW(
            groups, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay,
            max_grad_norm=max_norm if max_norm else None,
            grad_accumulation_steps=self.args.gradient_accumulation_steps)
        return self.optimizer

    def _clip_grad_norm(self, model):
        """The Trainer's clip, taken over by the optimizer (``max_grad_norm``): nothing is clipped here. Returns
        the pre-clip global norm, as torch's ``clip_grad_norm_`` would, for the Trainer to log."""
        return self._grad_norm_now(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self._grad_norm_now(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _grad_norm_now(self, model) -> torch.Tensor:
        # max_norm=inf: torch's function with a coefficient of 1, which socompile's wrapper (optim/script_clip.py)
        # computes over the gradients the optimizer holds and leaves untouched.
        return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
