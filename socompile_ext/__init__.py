"""socompile_ext: the CPU Adam/AdamW kernel for offloaded optimizer steps.

One pass per step reads p, g, m, v and writes p, m, v (plus an optional bf16 copy of p), computes the
gradient's sum of squares and non-finite flag on the way, and runs at the memory-bandwidth limit with the
best SIMD path of the CPU it runs on (chosen at run time). See docs/kernel.md.

Exact rollback: pass param_out / exp_avg_out / exp_avg_sq_out (ping-pong state). The inputs are then only
read, so a failed validation keeps them: bitwise exact, no extra traffic. `adam_rollback` is the algebraic
inverse for when two copies do not fit: computed in double, NOT bitwise (error bound in docs/kernel.md),
and it cannot undo a step whose gradient was non-finite.

All tensors: CPU, contiguous, same number of elements (any shape); fp32 param, fp32 or bf16 moments (both
alike), fp32 or bf16 grad. int8 moments: exp_avg / exp_avg_sq (and their outputs) are torch.uint8 buffers of
20 * ceil(n / 16) bytes in the block format of csrc/adam.h (socompile/runtime/int8_moments.py converts).
Bad input raises ValueError/TypeError; nothing is ever updated through a temporary copy.

Importing this module does not import torch (the kernels take torch tensors, so torch is imported by the
first call). SOCOMPILE_ISA=scalar|avx2|avx512|neon|sve forces a path (must be usable on this CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from . import _adam

__version__ = "0.1.0"
__all__ = ["adam_step", "adam_rollback", "grad_stats", "set_num_threads", "get_num_threads", "isa", "build_info",
           "store_choice", "set_store_policy", "get_store_policy", "adam_step_multi", "KernelSettings",
           "kernel_settings"]

def _t():
    """torch, imported at the first kernel call rather than with this module (sys.modules caches it)."""
    import torch

    return torch


def _force_isa(want: str, source: str) -> None:
    usable = [name for name, ok in _adam.isa_names() if ok]
    if not _adam.force_isa(want):
        raise ValueError(f"{source}={want!r} is not usable on this CPU/build; usable paths: {usable}")


def _apply_isa_env():
    want = os.environ.get("SOCOMPILE_ISA", "").strip().lower()
    if want:
        _force_isa(want, "SOCOMPILE_ISA")


_apply_isa_env()


# ---------------------------------------------------------------- validation

def _check(name, t, dtypes, n):
    """Validate one tensor; return its data address."""
    torch = _t()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(
            f"{name} is on device {t.device}; the CPU Adam kernel updates CPU memory in place: "
            f"pass the CPU (pinned) copy of the tensor, not a {t.device.type} tensor")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected {want} (convert the buffer once where it is allocated)")
    if t.layout is not torch.strided or not t.is_contiguous():
        raise ValueError(
            f"{name} is not a contiguous strided tensor; pass a contiguous buffer (e.g. a flat bucket). "
            f"Calling .contiguous() here would update a temporary copy and lose the result")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements but param has {n}; all tensors must have the same numel")
    return t.data_ptr()


def _check_no_overlap(buffers, n=None):
    """buffers: (name, address or 0, element size, written[, numel]). A written buffer must not share memory with
    any other buffer (an output given as the very same memory as its input was already folded into an in-place
    entry by the caller): the kernel would read values it has already overwritten. Sort and sweep, so a list
    of many tensors costs O(k log k)."""
    spans = sorted((a, a + (b[4] if len(b) > 4 else n) * es, name, w) for b in buffers for name, a, es, w in [b[:4]]
                   if a)
    active = []
    for a0, a1, name, w in spans:
        active = [s for s in active if s[1] > a0]
        for b0, b1, other, wo in active:  # b0 <= a0 < b1: they overlap
            if w or wo:
                first, second = (name, other) if w else (other, name)
                raise ValueError(
                    f"{first} overlaps {second}; an output must be either exactly its own input (in place) "
                    f"or a separate buffer")
        active.append((a0, a1, name, w))


def _hparams_ok(step, lr, beta1, beta2, eps, weight_decay):
    if int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count including this step), got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    if eps < 0 or lr < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, weight_decay={weight_decay}")


def _grad_addrs(grad, addr):
    return (0, addr) if grad.dtype == _t().bfloat16 else (addr, 0)


# ---------------------------------------------------------------- public API

MOMENTS_FP32, MOMENTS_BF16, MOMENTS_INT8 = 0, 1, 2   # moment formats (_adam's mfmt)
INT8_BLOCK, INT8_BLOCK_BYTES = 16, 20                 # int8 moments: 16 codes + one fp32 scale per block


def int8_moment_bytes(n: int) -> int:
    """Bytes of one int8 moment buffer for n elements: 20 per block of 16 (a short last block too)."""
    return -(-n // INT8_BLOCK) * INT8_BLOCK_BYTES


def _moment_span(mfmt, n):
    """(element size, elements) of a moment buffer of n parameters in format mfmt (for the overlap check)."""
    if mfmt == MOMENTS_INT8:
        return 1, int8_moment_bytes(n)
    return (2 if mfmt == MOMENTS_BF16 else 4), n


def _check_moment(name, t, dtypes, n, mfmt):
    """_check for a moment buffer: n elements (fp32, bf16) or an int8 buffer of int8_moment_bytes(n) bytes."""
    if mfmt != MOMENTS_INT8:
        return _check(name, t, dtypes, n)
    addr = _check(name, t, dtypes, None)
    want = int8_moment_bytes(n)
    if t.numel() != want:
        raise ValueError(f"{name} is an int8 moment buffer (torch.uint8) of {t.numel()} bytes; for a param of {n} "
                         f"elements it must be 20 * ceil({n} / 16) = {want} bytes (16 codes + one fp32 scale "
                         f"per block of 16)")
    return addr


def _step_addrs(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out, exp_avg_sq_out, param_bf16_out):
    """Validate the tensors of one step (or its copy ceiling); return n, their addresses (an output that is
    not given aliases its input: updated in place) and the moment format (MOMENTS_*)."""
    torch = _t()
    f32 = (torch.float32,)
    p = _check("param", param, f32, None)
    n = param.numel()
    g = _check("grad", grad, (torch.float32, torch.bfloat16), n)
    # the moments' format is exp_avg's: exp_avg_sq and the moment outputs must be in it too
    mfmt = {torch.bfloat16: MOMENTS_BF16, torch.uint8: MOMENTS_INT8}.get(getattr(exp_avg, "dtype", None),
                                                                        MOMENTS_FP32)
    m = _check_moment("exp_avg", exp_avg, (torch.float32, torch.bfloat16, torch.uint8), n, mfmt)
    moments = (exp_avg.dtype,)
    v = _check_moment("exp_avg_sq", exp_avg_sq, moments, n, mfmt)
    po = p if param_out is None else _check("param_out", param_out, f32, n)
    mo = m if exp_avg_out is None else _check_moment("exp_avg_out", exp_avg_out, moments, n, mfmt)
    vo = v if exp_avg_sq_out is None else _check_moment("exp_avg_sq_out", exp_avg_sq_out, moments, n, mfmt)
    p16 = 0 if param_bf16_out is None else _check("param_bf16_out", param_bf16_out, (torch.bfloat16,), n)
    return n, p, g, m, v, po, mo, vo, p16, mfmt


def _seed_ok(round_seed) -> int:
    if isinstance(round_seed, bool) or not isinstance(round_seed, int) or not 0 <= round_seed < 2**32:
        raise ValueError(f"round_seed must be an int in [0, 2**32) (the seed of the bf16 and int8 moments' "
                         f"stochastic rounding), got {round_seed!r}")
    return round_seed


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, decoupled: bool = True, grad_scale: float = 1.0,
              param_out=None, exp_avg_out=None, exp_avg_sq_out=None, param_bf16_out=None,
              round_seed: int = 0) -> tuple[float, bool]:
    """One Adam (decoupled=False: L2 weight decay) or AdamW (decoupled=True) step, torch's formula.

    grad is multiplied by grad_scale first (e.g. the clip coefficient). Each of param_out / exp_avg_out /
    exp_avg_sq_out, when given, receives the result and its input is only read (ping-pong state for
    exact rollback); otherwise that tensor is updated in place. param_bf16_out receives the updated param
    rounded to bf16 (RNE, bit-identical to .to(torch.bfloat16)). Bias correction uses `step` (1-based).

    Moments in bf16 (exp_avg and exp_avg_sq, and their outputs, all bf16): read exactly, computed in fp32, stored
    stochastically rounded with 16 random bits per element from a fixed hash of (round_seed, element index)
    (docs/kernel.md, "bf16 moments"); the same seed gives the same bits on every path and thread count.

    int8 moments (exp_avg and exp_avg_sq, and their outputs, all torch.uint8 buffers of 20 * ceil(n / 16) bytes,
    csrc/adam.h's block format): each block of 16 is decoded, stepped in fp32 and re-encoded with stochastic
    rounding from the same hash of (round_seed, element index); bit for bit socompile/runtime/int8_moments.py's
    decode / encode_moments around the fp32 step. The call's elements start a block (element 0).

    Returns (sum of squares of the scaled gradient, whether any scaled gradient element is non-finite).
    """
    n, p, g, m, v, po, mo, vo, p16, mfmt = _step_addrs(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out,
                                                       exp_avg_sq_out, param_bf16_out)
    _hparams_ok(step, lr, beta1, beta2, eps, weight_decay)
    seed = _seed_ok(round_seed)
    if n == 0:
        return 0.0, False
    _check_no_overlap(_step_spans("", n, grad.element_size(), p, g, m, v, po, mo, vo, p16, *_moment_span(mfmt, n)))
    g32, g16 = _grad_addrs(grad, g)
    return _adam.step(n, p, m, v, g32, g16, po, mo, vo, p16, int(step), float(lr), float(beta1), float(beta2),
                      float(eps), float(weight_decay), bool(decoupled), float(grad_scale), mfmt, seed)


def _step_spans(tag, n, gsz, p, g, m, v, po, mo, vo, p16, msz=4, mlen=None):
    """Byte spans of one step's buffers for _check_no_overlap; the moments' are mlen elements of msz bytes
    (default n: fp32 and bf16 moments; an int8 moment buffer is int8_moment_bytes(n) bytes)."""
    mlen = n if mlen is None else mlen
    return [(f"param{tag}", p, 4, po == p, n), (f"grad{tag}", g, gsz, False, n),
            (f"exp_avg{tag}", m, msz, mo == m, mlen), (f"exp_avg_sq{tag}", v, msz, vo == v, mlen),
            (f"param_out{tag}", po if po != p else 0, 4, True, n),
            (f"exp_avg_out{tag}", mo if mo != m else 0, msz, True, mlen),
            (f"exp_avg_sq_out{tag}", vo if vo != v else 0, msz, True, mlen), (f"param_bf16_out{tag}", p16, 2, True, n)]


def adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, decoupled: bool = True, grad_scale: float = 1.0,
                    params_out=None, exp_avgs_out=None, exp_avg_sqs_out=None,
                    params_bf16_out=None, round_seeds=None) -> tuple[float, bool]:
    """adam_step over lists of tensors with one set of hyper-parameters, in one call.

    Each tensor gets exactly the result adam_step would give it (bit for bit); the returned sum of squares
    adds the tensors' sums in list order. One parallel region for the whole list (one fork/join, the blocks
    of all tensors shared out among the threads) instead of one per tensor. The *_out lists, when given,
    hold one entry per tensor, each a tensor or None (None: that tensor is updated in place). round_seeds: one
    seed per tensor for bf16 moments (default 0 each; see adam_step)."""
    k = len(params)
    lists = [grads, exp_avgs, exp_avg_sqs] + [x for x in (params_out, exp_avgs_out, exp_avg_sqs_out, params_bf16_out)
                                              if x is not None]
    for x in lists:
        if len(x) != k:
            raise ValueError(f"adam_step_multi needs lists of equal length; got {k} params and a list of {len(x)}")
    _hparams_ok(step, lr, beta1, beta2, eps, weight_decay)
    seeds = [0] * k if round_seeds is None else [_seed_ok(x) for x in round_seeds]
    if len(seeds) != k:
        raise ValueError(f"adam_step_multi needs one round seed per tensor; got {k} params and {len(seeds)} seeds")
    none = [None] * k
    outs = [x if x is not None else none for x in (params_out, exp_avgs_out, exp_avg_sqs_out, params_bf16_out)]
    import array

    a = array.array("q")
    spans = []
    for j in range(k):
        n, p, g, m, v, po, mo, vo, p16, mfmt = _step_addrs(params[j], grads[j], exp_avgs[j], exp_avg_sqs[j],
                                                           outs[0][j], outs[1][j], outs[2][j], outs[3][j])
        if n == 0:
            continue
        spans += _step_spans(f"[{j}]", n, grads[j].element_size(), p, g, m, v, po, mo, vo, p16,
                             *_moment_span(mfmt, n))
        g32, g16 = _grad_addrs(grads[j], g)
        a.extend((n, p, m, v, g32, g16, po, mo, vo, p16, mfmt, seeds[j]))
    _check_no_overlap(spans)
    count = len(a) // _adam.ENTRIES
    if count == 0:
        return 0.0, False
    return _adam.step_multi(a, count, int(step), float(lr), float(beta1), float(beta2), float(eps),
                            float(weight_decay), bool(decoupled), float(grad_scale))


def adam_rollback(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, decoupled: bool = True, grad_scale: float = 1.0) -> None:
    """Undo an in-place adam_step algebraically, in place (memory-tight mode).

    Needs the same gradient, grad_scale, hyper-parameters and step count as the step it undoes. Computed
    in double with v clamped at >= 0; NOT bitwise (a few fp32 ulps, see docs/kernel.md), and a step taken
    with a non-finite gradient cannot be undone (use ping-pong state where that matters).
    """
    n, p, g, m, v, *_, mfmt = _step_addrs(param, grad, exp_avg, exp_avg_sq, None, None, None, None)
    _hparams_ok(step, lr, beta1, beta2, eps, weight_decay)
    if mfmt == MOMENTS_INT8:
        raise ValueError("adam_rollback cannot undo a step with int8 moments: they were quantised with stochastic "
                         "rounding, so no inverse gives them back; keep the previous state instead (ping-pong: pass "
                         "param_out/exp_avg_out/exp_avg_sq_out to adam_step)")
    if mfmt == MOMENTS_BF16:
        raise ValueError("adam_rollback cannot undo a step with bf16 moments: they were rounded stochastically, "
                         "so no inverse gives them back; keep the previous state instead (ping-pong: pass "
                         "param_out/exp_avg_out/exp_avg_sq_out to adam_step)")
    if beta1 == 0.0 or beta2 == 0.0 or (decoupled and lr * weight_decay == 1.0):
        raise ValueError("this step cannot be inverted (beta1 == 0, beta2 == 0 or lr*weight_decay == 1 erase "
                         "the previous state); use ping-pong state (param_out/exp_avg_out/exp_avg_sq_out)")
    if n == 0:
        return None
    _check_no_overlap([("param", p, 4, True), ("grad", g, grad.element_size(), False), ("exp_avg", m, 4, True),
                       ("exp_avg_sq", v, 4, True)], n)
    g32, g16 = _grad_addrs(grad, g)
    rc = _adam.rollback(n, p, m, v, g32, g16, int(step), float(lr), float(beta1), float(beta2), float(eps),
                        float(weight_decay), bool(decoupled), float(grad_scale))
    if rc != 0:
        raise ValueError("this step cannot be inverted in fp32 (a coefficient rounds to 0 or 1); use ping-pong state")
    return None


def grad_stats(grad) -> tuple[float, bool]:
    """(sum of squares in double, any element non-finite) of an fp32 or bf16 gradient; one read pass."""
    torch = _t()
    g = _check("grad", grad, (torch.float32, torch.bfloat16), None)
    n = grad.numel()
    if n == 0:
        return 0.0, False
    g32, g16 = _grad_addrs(grad, g)
    return _adam.grad_stats(n, g32, g16)


_POLICIES = {"auto": 0, "regular": 1, "streaming": 2}


def set_store_policy(policy: str = "auto", stream_threshold: int | None = None) -> None:
    """How the kernel writes its outputs (values are identical either way; only the memory traffic differs).

    "auto" (default): non-temporal (streaming) stores for outputs that are separate buffers (ping-pong state,
    the bf16 parameter copy) when the call touches at least `stream_threshold` elements (a multi-tensor call:
    all its tensors together; default: half the last-level cache at 28 bytes per element, at least 131072,
    so ~599K on a 32 MB L3), regular stores otherwise; "regular": never stream; "streaming": stream every
    output at any size, in-place ones too (for measurements). stream_threshold <= 0 restores the default.
    Process-wide."""
    if policy not in _POLICIES:
        raise ValueError(f"store policy must be one of {sorted(_POLICIES)}, got {policy!r}")
    if stream_threshold is not None and (isinstance(stream_threshold, bool) or not isinstance(stream_threshold, int)):
        raise ValueError(f"stream_threshold must be an int (elements; <= 0 restores the default), got {stream_threshold!r}")
    _adam.set_store_policy(_POLICIES[policy])
    if stream_threshold is not None:
        _adam.set_stream_threshold(stream_threshold)


def get_store_policy() -> tuple[str, int]:
    """(policy, stream threshold in elements)."""
    code = _adam.get_store_policy()
    return next(k for k, v in _POLICIES.items() if v == code), _adam.stream_threshold()


def store_choice(param, grad, exp_avg, exp_avg_sq, *, param_out=None, exp_avg_out=None, exp_avg_sq_out=None,
                 param_bf16_out=None, call_numel=None) -> dict:
    """The store choice adam_step would make for these tensors now (size, policy, ISA path, alignment):
    {"state": p/m/v outputs streamed, "bf16": bf16 copy streamed}. call_numel: the elements of the whole
    adam_step_multi call this tensor is part of (the choice depends on the call's size); default: this
    tensor's. Each block's unaligned head (up to the outputs' first 64-byte boundary) and tail use regular
    stores in any case."""
    n, p, g, m, v, po, mo, vo, p16, mfmt = _step_addrs(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out,
                                                       exp_avg_sq_out, param_bf16_out)
    g32, g16 = _grad_addrs(grad, g)
    bits = _adam.stream_choice(n, p, m, v, g32, g16, po, mo, vo, p16, int(call_numel or 0), mfmt)
    return {"state": bool(bits & 1), "bf16": bool(bits & 2)}


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
        "store_policy": get_store_policy(),
    }


# ---------------------------------------------------------------- settings

@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The kernel's settings. They live in the C library, one set per process (every thread and every model
    sees the same ones): read them with ``KernelSettings.current()``; change them for a block of code with
    ``kernel_settings(...)``, which puts them back afterwards."""
    threads: int              # OpenMP threads (set_num_threads)
    isa: str                  # SIMD path (isa(); SOCOMPILE_ISA chooses it at import)
    store_policy: str         # "auto" | "regular" | "streaming" (set_store_policy)
    stream_threshold: int     # elements from which "auto" streams
    prefetch: int             # software prefetch distance in elements (0: off; measurements only)
    dynamic_schedule: bool    # adam_step_multi's OpenMP schedule (measurements only)

    @classmethod
    def current(cls) -> KernelSettings:
        policy, threshold = get_store_policy()
        return cls(get_num_threads(), isa(), policy, threshold, _adam.get_prefetch(),
                   bool(_adam.get_dynamic_schedule()))

    def apply(self) -> None:
        """Make these the kernel's settings; only those that differ from the current ones are set."""
        now = KernelSettings.current()
        if self.threads != now.threads:
            set_num_threads(self.threads)
        if self.isa != now.isa:
            _force_isa(self.isa, "isa")
        if (self.store_policy, self.stream_threshold) != (now.store_policy, now.stream_threshold):
            set_store_policy(self.store_policy, self.stream_threshold)
        if self.prefetch != now.prefetch:
            _adam.set_prefetch(self.prefetch)
        if self.dynamic_schedule != now.dynamic_schedule:
            _adam.set_dynamic_schedule(self.dynamic_schedule)


@contextlib.contextmanager
def kernel_settings(**changes):
    """Run the block with ``changes`` (KernelSettings fields, e.g. ``threads=4, isa="avx2"``) applied; on the way
    out every setting is put back as it was on entry, those the block changed itself too. Yields the settings
    of the entry. The settings are process-wide: a caller whose kernel calls may overlap another thread's
    must serialize them (runtime/cpu_adam.py does)::

        with socompile_ext.kernel_settings(threads=2):
            socompile_ext.adam_step(...)
    """
    known = [f.name for f in dataclasses.fields(KernelSettings)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise TypeError(f"kernel_settings got unknown settings {unknown}; known: {known}")
    before = KernelSettings.current()
    try:
        dataclasses.replace(before, **changes).apply()
        yield before
    finally:
        before.apply()


def _copy_ceiling(param, grad, exp_avg, exp_avg_sq, param_out=None, exp_avg_out=None, exp_avg_sq_out=None,
                  param_bf16_out=None) -> None:
    """Benchmark only: the step's loads and stores with no arithmetic (the machine's ceiling for the step).
    Same store policy as adam_step (non-temporal stores for large separate outputs)."""
    n, p, g, m, v, po, mo, vo, p16, mfmt = _step_addrs(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out,
                                                       exp_avg_sq_out, param_bf16_out)
    if n == 0:
        return
    g32, g16 = _grad_addrs(grad, g)
    _adam.copy_ceiling(n, p, m, v, g32, g16, po, mo, vo, p16, mfmt)


def _copy_ceiling_multi(params, grads, exp_avgs, exp_avg_sqs, params_out=None, exp_avgs_out=None,
                        exp_avg_sqs_out=None, params_bf16_out=None) -> None:
    """Benchmark only: _copy_ceiling over lists in one parallel region, like adam_step_multi."""
    import array

    k = len(params)
    none = [None] * k
    outs = [x if x is not None else none for x in (params_out, exp_avgs_out, exp_avg_sqs_out, params_bf16_out)]
    a = array.array("q")
    for j in range(k):
        n, p, g, m, v, po, mo, vo, p16, mfmt = _step_addrs(params[j], grads[j], exp_avgs[j], exp_avg_sqs[j],
                                                           outs[0][j], outs[1][j], outs[2][j], outs[3][j])
        if n:
            g32, g16 = _grad_addrs(grads[j], g)
            a.extend((n, p, m, v, g32, g16, po, mo, vo, p16, mfmt, 0))
    if len(a):
        _adam.copy_ceiling_multi(a, len(a) // _adam.ENTRIES)
