"""torch's gradient clipping functions, made to see the gradients socompile holds on the host.

A bucket with a separate host master (a model on a GPU, or in bf16) keeps its gradients in a host buffer and
leaves ``.grad`` None: the device has no room for them, which is why they were offloaded. A training script's
own ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` would then see no gradients, clip nothing and
return a norm of 0. socompile therefore wraps those two functions (once, at import): for parameters whose
gradients a socompile optimizer holds, the wrapper reads and changes the held gradients, with torch's own
formulas (the same total norm, the same clamped coefficient, multiplied in the gradients' dtype), and tells the
bucket its gradients were changed, so ``step()`` redoes from them what backward already stepped
(optim/validation.py ``StepValidation.undo_for_script_gradients``). For every other parameter torch's function runs
as is.

Scripts that call ``torch.nn.utils.clip_grad_norm_`` (nanoGPT, the HF Trainer through accelerate) look the name
up at call time, so they get the wrapper; ``from torch.nn.utils import clip_grad_norm_`` before importing socompile
keeps torch's function, which then clips only the gradients in ``.grad``.
"""
from __future__ import annotations

import functools

import torch

from .owner import owner_of

_WRAPPED = "_socompile_wraps"   # the attribute that marks a wrapper and names the function it wraps


def _as_list(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _held(params: list[torch.Tensor]) -> list[tuple[object, torch.Tensor]]:
    """(bucket, host gradient) of each parameter whose gradient a socompile optimizer holds off ``.grad``."""
    held = []
    for p in params:
        if p.grad is not None:
            continue
        owner = owner_of(p)
        if owner is None:
            continue
        found = owner.held_gradient(p)
        if found is not None:
            held.append(found)
    return held


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = _as_list(parameters)
    held = _held(params)
    original = getattr(clip_grad_norm_, _WRAPPED)
    if not held and not any(owner_of(p) is not None for p in params):
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    grads = [p.grad for p in params if p.grad is not None] + [g for _, g in held]
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    # torch's clip_grads_with_norm_: one clamped coefficient, multiplied into every gradient on its device.
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    # A coefficient of exactly 1 (the norm is under max_norm, or max_norm is inf: the HF Trainer's way of
    # logging the norm without clipping) changes no value, so the gradients are left untouched: a multiply
    # would bump their version counter, and step() would redo what backward stepped for nothing. Deciding
    # reads the coefficient on the host, which socompile's gradients are on anyway.
    if bool(coef == 1.0):
        return total
    for g in grads:
        g.mul_(coef.to(g.device))
    for bucket in {id(b): b for b, _ in held}.values():
        bucket.note_script_change()
    return total


@torch.no_grad()
def clip_grad_value_(parameters, clip_value, foreach=None):
    params = _as_list(parameters)
    held = _held(params)
    original = getattr(clip_grad_value_, _WRAPPED)
    if any(p.grad is not None for p in params):
        original(params, clip_value, foreach)
    clip_value = float(clip_value)
    for bucket, g in held:
        g.clamp_(min=-clip_value, max=clip_value)
        bucket.note_script_change()


def install() -> None:
    """Put the wrappers where scripts find torch's functions (idempotent: a wrapper is never wrapped again)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for wrapper in (clip_grad_norm_, clip_grad_value_):
            current = getattr(module, wrapper.__name__)
            if getattr(current, _WRAPPED, None) is not None:
                continue
            if getattr(wrapper, _WRAPPED, None) is None:
                setattr(wrapper, _WRAPPED, current)
                functools.update_wrapper(wrapper, current, updated=())
            setattr(module, wrapper.__name__, wrapper)
