"""socompile_ext: the CPU Adam/AdamW kernel for offloaded optimizer steps.

One pass per step reads p, g, m, v and writes p, m, v (plus an optional bf16 copy of p), computes the
gradient's sum of squares and non-finite flag on the way, and runs at the memory-bandwidth limit with the
best SIMD path of the CPU it runs on (chosen at run time). See docs/kernel.md.

Exact rollback: pass param_out / exp_avg_out / exp_avg_sq_out (ping-pong state). The inputs are then only
read, so a failed validation keeps them: bitwise exact, no extra traffic. `adam_rollback` is the algebraic
inverse for when two copies do not fit: computed in double, NOT bitwise (error bound in docs/kernel.md),
and it cannot undo a step whose gradient was non-finite.

All tensors: CPU, contiguous, same number of elements (any shape); fp32 param/state, fp32 or bf16 grad.
Bad input raises ValueError/TypeError; nothing is ever updated through a temporary copy.

Importing this module does not import torch (the kernels take torch tensors, so torch is imported by the
first call). SOCOMPILE_ISA=scalar|avx2|avx512|neon|sve forces a path (must be usable on this CPU).
"""
from __future__ import annotations

import os

from . import _adam

__version__ = "0.1.0"
__all__ = ["adam_step", "adam_rollback", "grad_stats", "set_num_threads", "get_num_threads", "isa", "build_info"]

_torch = None


def _t():
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def _apply_isa_env():
    want = os.environ.get("SOCOMPILE_ISA", "").strip().lower()
    if not want:
        return
    usable = [name for name, ok in _adam.isa_names() if ok]
    if not _adam.force_isa(want):
        raise ValueError(f"SOCOMPILE_ISA={want!r} is not usable on this CPU/build; usable paths: {usable}")


_apply_isa_env()


# ---------------------------------------------------------------- validation

def _check(name, t, dtypes, n):
    torch = _t()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}; the CPU Adam kernel updates CPU memory in place: "
            f"pass the CPU (pinned) copy of the tensor, not {t.device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected {want} (convert the buffer once where it is allocated)")
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(
            f"{name} is not a contiguous strided tensor; pass a contiguous buffer (e.g. a flat bucket). "
            f"Calling .contiguous() here would update a temporary copy and lose the result")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements but param has {n}; all tensors must have the same numel")


def _flat(t):
    """Zero-copy 1-D numpy view of a contiguous CPU tensor (bf16 as its uint16 bits)."""
    torch = _t()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy().reshape(-1)


def _span(t):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_outputs(pairs, others):
    """pairs: (out_name, out, in_tensor); an output may be its own input (in place) or disjoint from all."""
    named = [(n, t) for n, t in others if t is not None and t.numel() > 0]
    for oname, out, inp in pairs:
        if out is None or out.numel() == 0:
            continue
        o0, o1 = _span(out)
        for name, t in named:
            if t is out:
                continue
            a0, a1 = _span(t)
            if t is inp and (a0, a1) == (o0, o1):
                continue  # in place for this tensor
            if o0 < a1 and a0 < o1:
                raise ValueError(
                    f"{oname} overlaps {name}; an output must be either the same tensor as its input "
                    f"(in-place) or a separate buffer")


def _hparams_ok(step, lr, beta1, beta2, eps, weight_decay):
    if int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count including this step), got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    if eps < 0 or lr < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, weight_decay={weight_decay}")


# ---------------------------------------------------------------- public API

def adam_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, decoupled: bool = True, grad_scale: float = 1.0,
              param_out=None, exp_avg_out=None, exp_avg_sq_out=None, param_bf16_out=None) -> tuple[float, bool]:
    """One Adam (decoupled=False: L2 weight decay) or AdamW (decoupled=True) step, torch's formula.

    grad is multiplied by grad_scale first (e.g. the clip coefficient). Each of param_out / exp_avg_out /
    exp_avg_sq_out, when given, receives the result and its input is only read (ping-pong state for
    exact rollback); otherwise that tensor is updated in place. param_bf16_out receives the updated param
    rounded to bf16 (RNE, bit-identical to .to(torch.bfloat16)). Bias correction uses `step` (1-based).

    Returns (sum of squares of the scaled gradient, whether any scaled gradient element is non-finite).
    """
    torch = _t()
    f32 = (torch.float32,)
    _check("param", param, f32, None)
    n = param.numel()
    _check("grad", grad, (torch.float32, torch.bfloat16), n)
    _check("exp_avg", exp_avg, f32, n)
    _check("exp_avg_sq", exp_avg_sq, f32, n)
    for name, t in (("param_out", param_out), ("exp_avg_out", exp_avg_out), ("exp_avg_sq_out", exp_avg_sq_out)):
        if t is not None:
            _check(name, t, f32, n)
    if param_bf16_out is not None:
        _check("param_bf16_out", param_bf16_out, (torch.bfloat16,), n)
    _hparams_ok(step, lr, beta1, beta2, eps, weight_decay)
    everything = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                  ("param_out", param_out), ("exp_avg_out", exp_avg_out), ("exp_avg_sq_out", exp_avg_sq_out),
                  ("param_bf16_out", param_bf16_out)]
    _check_outputs([("param_out", param_out, param), ("exp_avg_out", exp_avg_out, exp_avg),
                    ("exp_avg_sq_out", exp_avg_sq_out, exp_avg_sq), ("param_bf16_out", param_bf16_out, None)],
                   everything)
    # the in-place outputs must not overlap the other inputs either (e.g. param passed as exp_avg)
    _check_outputs([("param", param if param_out is None else None, param),
                    ("exp_avg", exp_avg if exp_avg_out is None else None, exp_avg),
                    ("exp_avg_sq", exp_avg_sq if exp_avg_sq_out is None else None, exp_avg_sq)], everything)
    if n == 0:
        return 0.0, False
    p = _flat(param)
    m = _flat(exp_avg)
    v = _flat(exp_avg_sq)
    g = _flat(grad)
    bf16_grad = grad.dtype == torch.bfloat16
    return _adam.step(
        p, m, v, None if bf16_grad else g, g if bf16_grad else None,
        p if param_out is None else _flat(param_out),
        m if exp_avg_out is None else _flat(exp_avg_out),
        v if exp_avg_sq_out is None else _flat(exp_avg_sq_out),
        None if param_bf16_out is None else _flat(param_bf16_out),
        int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
        float(grad_scale))


def adam_rollback(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, decoupled: bool = True, grad_scale: float = 1.0) -> None:
    """Undo an in-place adam_step algebraically, in place (memory-tight mode).

    Needs the same gradient, grad_scale, hyper-parameters and step count as the step it undoes. Computed
    in double with v clamped at >= 0; NOT bitwise (a few fp32 ulps, see docs/kernel.md), and a step taken
    with a non-finite gradient cannot be undone (use ping-pong state where that matters).
    """
    torch = _t()
    f32 = (torch.float32,)
    _check("param", param, f32, None)
    n = param.numel()
    _check("grad", grad, (torch.float32, torch.bfloat16), n)
    _check("exp_avg", exp_avg, f32, n)
    _check("exp_avg_sq", exp_avg_sq, f32, n)
    _hparams_ok(step, lr, beta1, beta2, eps, weight_decay)
    if beta1 == 0.0 or beta2 == 0.0 or (decoupled and lr * weight_decay == 1.0):
        raise ValueError("this step cannot be inverted (beta1 == 0, beta2 == 0 or lr*weight_decay == 1 erase "
                         "the previous state); use ping-pong state (param_out/exp_avg_out/exp_avg_sq_out)")
    everything = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    _check_outputs([("param", param, param), ("exp_avg", exp_avg, exp_avg), ("exp_avg_sq", exp_avg_sq, exp_avg_sq)],
                   everything)
    if n == 0:
        return None
    g = _flat(grad)
    bf16_grad = grad.dtype == torch.bfloat16
    rc = _adam.rollback(_flat(param), _flat(exp_avg), _flat(exp_avg_sq), None if bf16_grad else g,
                        g if bf16_grad else None, int(step), float(lr), float(beta1), float(beta2), float(eps),
                        float(weight_decay), bool(decoupled), float(grad_scale))
    if rc != 0:
        raise ValueError("this step cannot be inverted in fp32 (a coefficient rounds to 0 or 1)")
    return None


def grad_stats(grad) -> tuple[float, bool]:
    """(sum of squares in double, any element non-finite) of an fp32 or bf16 gradient; one read pass."""
    torch = _t()
    _check("grad", grad, (torch.float32, torch.bfloat16), None)
    if grad.numel() == 0:
        return 0.0, False
    g = _flat(grad)
    if grad.dtype == torch.bfloat16:
        return _adam.grad_stats(None, g)
    return _adam.grad_stats(g, None)


def set_num_threads(n: int) -> None:
    """Threads the kernels use (OpenMP). Set it so kernel + torch threads do not exceed the cores."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads needs an int >= 1, got {n!r}")
    _adam.set_num_threads(n)


def get_num_threads() -> int:
    return _adam.get_num_threads()


def isa() -> str:
    """The SIMD path in use: 'avx512' | 'avx2' | 'sve' | 'neon' | 'scalar'."""
    return _adam.current_isa()


def build_info() -> dict:
    return {
        "isa": isa(),
        "available_isas": [name for name, ok in _adam.isa_names() if ok],
        "compiled_isas": [name for name, _ in _adam.isa_names()],
        "num_threads": get_num_threads(),
        "openmp": _adam.openmp_version(),
        "compiler": _adam.compiler(),
        "compile_flags": _adam.build_flags(),
        "version": __version__,
    }


def _copy_ceiling(param, grad, exp_avg, exp_avg_sq, param_out=None, exp_avg_out=None, exp_avg_sq_out=None,
                  param_bf16_out=None) -> None:
    """Benchmark only: the step's loads and stores with no arithmetic (the machine's ceiling for the step)."""
    torch = _t()
    n = param.numel()
    for name, t, d in (("param", param, (torch.float32,)), ("grad", grad, (torch.float32, torch.bfloat16)),
                       ("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,)),
                       ("param_out", param_out, (torch.float32,)), ("exp_avg_out", exp_avg_out, (torch.float32,)),
                       ("exp_avg_sq_out", exp_avg_sq_out, (torch.float32,)),
                       ("param_bf16_out", param_bf16_out, (torch.bfloat16,))):
        if t is not None:
            _check(name, t, d, n)
    if n == 0:
        return
    p, m, v, g = _flat(param), _flat(exp_avg), _flat(exp_avg_sq), _flat(grad)
    bf = grad.dtype == torch.bfloat16
    _adam.copy_ceiling(p, m, v, None if bf else g, g if bf else None,
                       p if param_out is None else _flat(param_out), m if exp_avg_out is None else _flat(exp_avg_out),
                       v if exp_avg_sq_out is None else _flat(exp_avg_sq_out),
                       None if param_bf16_out is None else _flat(param_bf16_out))
