"""Checks of socompile.AdamW's hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``) and of its moment
format (``moment_dtype``), for the constructor's arguments and for every param group alike (``add_param_group``,
per-group values).

torch.optim.AdamW's semantics and exception types: ``lr`` may be a 1-element tensor (kept as is, so an LR
scheduler that fills it in place is seen at the next step; the kernels read ``float(lr)`` at step time),
a bad value is a ``ValueError``, a value of the wrong type a ``TypeError``. Stricter than torch on one point:
a non-finite ``lr``, ``eps`` or ``weight_decay`` (torch rejects NaN only; ``inf`` gives NaN weights as surely)
is refused too. More lenient on another: integer betas (``(0, 0.99)``) are taken as floats.
"""
from __future__ import annotations

import math
import numbers

import torch


class BetasLengthError(IndexError, ValueError):
    """``betas`` has not exactly two entries. torch.optim.AdamW raises IndexError for a 1-tuple (it indexes
    ``betas[1]``); this is that type, and a ValueError as well, the type of every other bad value here."""


# torch.optim.AdamW's own words for a bad value: our messages begin with them (scripts and torch's own tests
# match them), then say more.
_TORCH_WORDS = {"lr": "Invalid learning rate", "eps": "Invalid epsilon value",
                "weight_decay": "Invalid weight_decay value"}


def _scalar(name: str, value, where: str) -> float:
    """``value`` as a float, for the checks: a real number or a 1-element tensor; else TypeError/ValueError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element: {where}{name} as a Tensor must have 1 element (one "
                             f"value for the whole group), got shape {tuple(value.shape)}; pass a Python float or a "
                             f"1-element tensor")
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    hint = f"; pass {name}={value.strip()}" if isinstance(value, str) and _parses(value) else ""
    raise TypeError(f"{where}{name} must be a float (or a 1-element tensor), got {type(value).__name__} "
                    f"{value!r}{hint}")


def _parses(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _non_negative(name: str, value, where: str) -> None:
    x = _scalar(name, value, where)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{_TORCH_WORDS[name]}: {x} ({where}{name} must be a finite number >= 0; a NaN or infinite "
                         f"{name} makes every updated weight NaN)")


def checked_betas(betas, where: str = "") -> tuple[float, float]:
    """``betas`` as a pair of floats in [0, 1) (torch turns 1-element tensors into floats too)."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or not hasattr(betas, "__getitem__"):
        raise TypeError(f"{where}betas must be a pair (beta1, beta2) of floats in [0, 1), e.g. (0.9, 0.999); "
                        f"got {type(betas).__name__} {betas!r}")
    if len(betas) != 2:
        raise BetasLengthError(f"{where}betas must have exactly 2 entries (beta1, beta2), e.g. (0.9, 0.999); "
                               f"got {len(betas)}: {tuple(betas)!r}")
    pair = tuple(_scalar(f"betas[{k}]", b, where) for k, b in enumerate(betas))
    for k, b in enumerate(pair):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {b} ({where}betas[{k}] must be in [0, 1))")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors ({where}got "
                         f"{type(betas[0]).__name__} and {type(betas[1]).__name__}; torch.optim.AdamW refuses the "
                         f"mix too)")
    return pair


def check_group(group: dict, where: str = "") -> None:
    """Check a param group's (or the defaults') hyperparameters, and normalize ``betas`` to a float pair in
    place. ``where`` prefixes the messages (e.g. "param group 1: ")."""
    for name in ("lr", "eps", "weight_decay"):
        if name in group:
            _non_negative(name, group[name], where)
    if "betas" in group:
        group["betas"] = checked_betas(group["betas"], where)


def _frozen(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def hyper_snapshot(param_groups: list[dict]) -> list[dict]:
    """The param groups' hyperparameters as they are now (tensors copied), without their parameters. A CPU job
    queued during backward steps with these: ``opt.step()`` may return before the job even starts, and an LR
    scheduler's step after it (which may fill a tensor ``lr`` in place) is the next step's, as in torch."""
    return [{k: _frozen(v) for k, v in group.items() if k != "params"} for group in param_groups]


MOMENT_DTYPES = (torch.float32, torch.bfloat16, "int8")


def check_moment_dtype(moment_dtype, rollback: str):
    """The format of the CPU buckets' exp_avg / exp_avg_sq: torch.float32 (torch's), torch.bfloat16 (stochastically
    rounded by the kernel: 8 bytes fewer per parameter read and written each step, 4 fewer held) or "int8"
    (blocks of 16 one-byte codes and an fp32 scale, stochastically rounded: 11 bytes fewer moved, 5.5 fewer held;
    docs/kernel.md)."""
    if isinstance(moment_dtype, str):
        moment_dtype = moment_dtype.lower()
    elif moment_dtype == torch.int8:
        moment_dtype = "int8"
    if moment_dtype not in MOMENT_DTYPES:
        raise TypeError(f"socompile.AdamW: moment_dtype must be torch.float32 (the default, torch's), 'int8' or "
                        f"torch.bfloat16, got {moment_dtype!r}")
    if moment_dtype != torch.float32 and rollback == "inverse":
        label, shown = ("int8", "'int8'") if moment_dtype == "int8" else ("bf16", "torch.bfloat16")
        raise ValueError(f"socompile.AdamW: rollback='inverse' (the algebraic undo of an in-place step) cannot undo "
                         f"{label} moments, which the kernel rounds stochastically; use rollback='pingpong' "
                         f"(the default) with moment_dtype={shown}")
    return moment_dtype
