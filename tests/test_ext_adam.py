"""socompile_ext: the CPU Adam/AdamW kernel (docs/kernel.md).

Specification tests. Numbers that matter:
- eps32 = 2**-24 is fp32's unit roundoff; every bound below is a small multiple of it times the size of the
  quantities involved, derived from the number of fp32 roundings on the path (see each helper).
- The kernel's fp32 operation order is spelled out in csrc/adam_internal.h (socx_adam_elem); a numpy fp32
  emulation of that order must therefore agree bit for bit (numpy's elementwise fp32 ops are correctly
  rounded and never fused).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import socompile_ext as se
from socompile_ext import _adam

EPS32 = 2.0 ** -24
X86_ISAS = [name for name, ok in _adam.isa_names() if ok]
# sizes around the vector widths (8, 16), the 16-lane accumulator, and the 16384-element block
SIZES = [0, 1, 7, 15, 16, 17, 33, 1000, 16384 + 5, 3 * 16384 + 17]
HP = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture
def settings_restored():
    """The kernel's process-wide settings (SIMD path, threads, store policy, schedule) as they were before."""
    with se.kernel_settings():
        yield


def make_state(n, seed=0, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return p, g, m, v


def step(p, g, m, v, **kw):
    """In-place step on clones; returns (p, m, v, stats)."""
    p, m, v = p.clone(), m.clone(), v.clone()
    stats = se.adam_step(p, g, m, v, **{**HP, **kw})
    return p, m, v, stats


def reference64(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True, grad_scale=1.0):
    """torch's Adam/AdamW formulas (torch/optim/adam.py, single-tensor path) in float64."""
    g = g.float() * grad_scale  # fp32 product, as torch's in-place clip g.mul_(coef)
    p, g, m, v = (x.double() for x in (p, g, m, v))
    g_raw, p0 = g, p
    if decoupled:
        p = p * (1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g + weight_decay * p
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    den = v.sqrt() / bc2 ** 0.5 + eps
    # magnitude of the terms summed into the effective gradient (Adam's g + wd*p can cancel)
    g_mag = g_raw.abs() + (0 if decoupled else weight_decay * p0.abs())
    return p - (lr / bc1) * m / den, m, v, g_mag, den


def assert_within_fp32_rounding(p0, g, m0, v0, p, m, v, **hp):
    """Bounds from counting roundings (G: |g| + wd|p| for Adam's L2 gradient, which can cancel): m is 3
    roundings of terms bounded by |m0| + G; v is 4 roundings of b2*v0 + (1-b2)*G^2 plus the fp32 rounding
    of the constant 1-b2 (0.001f is 0.8 eps32 off) and twice the effective gradient's rounding (squared);
    p is the decay product, the subtraction and the update (whose m-part error is amplified by
    step_size/den). The coefficients below are a 1.3x-2x margin over those counts."""
    P, M, V, G, den = reference64(p0, g, m0, v0, **hp)
    b1, b2 = hp["beta1"], hp["beta2"]
    ss = hp["lr"] / (1 - b1 ** hp["step"])
    err_m = 4 * EPS32 * (m0.double().abs() + G.abs())
    err_v = 6 * EPS32 * (b2 * v0.double() + (1 - b2) * G * G)
    upd = (ss * M / den).abs()
    err_p = 4 * EPS32 * (p0.double().abs() + P.abs()) + 8 * EPS32 * upd + ss * err_m / den
    assert ((m.double() - M).abs() <= err_m).all(), "exp_avg outside the fp32 rounding bound"
    assert ((v.double() - V).abs() <= err_v).all(), "exp_avg_sq outside the fp32 rounding bound"
    assert ((p.double() - P).abs() <= err_p).all(), "param outside the fp32 rounding bound"


def emulate_fp32(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True, grad_scale=1.0):
    """The kernel's exact fp32 operation order (csrc/adam_internal.h, socx_adam_elem) in numpy fp32."""
    f = np.float32
    p, m, v = (x.numpy().astype(f) for x in (p, m, v))
    g = g.float().numpy() * f(grad_scale)
    if not decoupled and weight_decay != 0:
        g = g + f(weight_decay) * p
    p = p * (f(1 - lr * weight_decay) if decoupled else f(1))
    w1 = f(1 - beta1)
    d = g - m
    m = m + w1 * d if abs(1 - beta1) < 0.5 else g - d * (f(1) - w1)
    v = v * f(beta2) + (f(1 - beta2) * g) * g
    den = np.sqrt(v) / f((1 - beta2 ** step) ** 0.5) + f(eps)
    p = p - (f(lr / (1 - beta1 ** step)) * m) / den
    return torch.from_numpy(p), torch.from_numpy(m), torch.from_numpy(v)


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_bitwise(a, b, what):
    assert torch.equal(bits(a), bits(b)), f"{what} differs bitwise"


# ---------------------------------------------------------------- numerics against references

@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_matches_float64_reference(isa, n, decoupled, grad_dtype, settings_restored):
    assert _adam.force_isa(isa)
    p0, g, m0, v0 = make_state(n, seed=n, grad_dtype=grad_dtype)
    hp = {**HP, "decoupled": decoupled, "grad_scale": 0.75}
    p, m, v, (sumsq, nonfinite) = step(p0, g, m0, v0, **hp)
    assert_within_fp32_rounding(p0, g, m0, v0, p, m, v, **hp)
    gs = (g.float() * 0.75).double()  # the scaled gradient is an fp32 product, as torch's g.mul_(coef)
    # sum of double squares of fp32 values: only the additions round (<= n * eps64 relative)
    assert sumsq == pytest.approx((gs * gs).sum().item(), rel=1e-12, abs=1e-300)
    assert nonfinite is False


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_matches_fp32_emulation_bitwise(isa, decoupled, grad_dtype, settings_restored):
    assert _adam.force_isa(isa)
    p0, g, m0, v0 = make_state(2 * 16384 + 29, seed=5, grad_dtype=grad_dtype)
    hp = {**HP, "decoupled": decoupled, "grad_scale": 0.5}
    p, m, v, _ = step(p0, g, m0, v0, **hp)
    P, M, V = emulate_fp32(p0, g, m0, v0, **hp)
    assert_bitwise(m, M, "exp_avg")
    assert_bitwise(v, V, "exp_avg_sq")
    assert_bitwise(p, P, "param")


def test_large_lerp_weight_uses_torch_second_form():
    # beta1 = 0.3 -> lerp weight 0.7 >= 0.5: torch computes g - (g - m) * (1 - w)
    p0, g, m0, v0 = make_state(1001, seed=3)
    hp = {**HP, "beta1": 0.3}
    p, m, v, _ = step(p0, g, m0, v0, **hp)
    P, M, V = emulate_fp32(p0, g, m0, v0, **hp)
    assert_bitwise(m, M, "exp_avg")
    assert_bitwise(p, P, "param")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), step_no=st.integers(1, 10_000), lr=st.floats(1e-6, 1e-1),
       beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999), wd=st.floats(0.0, 0.5),
       decoupled=st.booleans(), scale=st.floats(1e-3, 2.0), seed=st.integers(0, 2**16))
def test_random_hyperparameters_match_reference(n, step_no, lr, beta1, beta2, wd, decoupled, scale, seed):
    p0, g, m0, v0 = make_state(n, seed=seed)
    hp = dict(step=step_no, lr=lr, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=wd, decoupled=decoupled,
              grad_scale=scale)
    p, m, v, _ = step(p0, g, m0, v0, **hp)
    P, M, V = emulate_fp32(p0, g, m0, v0, **hp)
    assert_bitwise(p, P, "param")
    assert_bitwise(m, M, "exp_avg")
    assert_bitwise(v, V, "exp_avg_sq")


@pytest.mark.parametrize("decoupled", [True, False])
def test_three_steps_agree_with_torch_fused(decoupled):
    n = 4099
    p0, g0, _, _ = make_state(n, seed=11)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = p0.clone().requires_grad_()
    opt = cls([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, fused=True)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for k in range(1, 4):
        g = g0 * (1.0 + 0.1 * k)
        ref.grad = g.clone()
        opt.step()
        se.adam_step(p, g, m, v, step=k, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                     decoupled=decoupled)
    state = opt.state[ref]
    # torch's fused kernel uses FMA in lerp/addcmul and a different tail path: the results differ by a few
    # fp32 roundings per step, i.e. ~1e-7 relative to |p| ~ 1 after three steps.
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_bias_correction_is_stateless_across_buckets():
    # one tensor stepped whole == the same tensor stepped as two buckets with the same step count
    p0, g, m0, v0 = make_state(50_001, seed=2)
    p, m, v, _ = step(p0, g, m0, v0, step=7)
    cut = 20_000
    parts = [step(p0[a:b], g[a:b], m0[a:b], v0[a:b], step=7) for a, b in ((0, cut), (cut, 50_001))]
    assert_bitwise(p, torch.cat([parts[0][0], parts[1][0]]), "param")
    assert_bitwise(v, torch.cat([parts[0][2], parts[1][2]]), "exp_avg_sq")


def test_any_shape_is_accepted_when_contiguous():
    p0, g, m0, v0 = make_state(6 * 7, seed=1)
    flat = step(p0, g, m0, v0)
    shaped = step(p0.view(6, 7), g.view(6, 7), m0.view(6, 7), v0.view(6, 7))
    assert_bitwise(shaped[0].reshape(-1), flat[0], "param")


# ---------------------------------------------------------------- paths, threads, determinism

@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_every_isa_on_this_machine_gives_identical_bits(grad_dtype, settings_restored):
    p0, g, m0, v0 = make_state(5 * 16384 + 13, seed=9, grad_dtype=grad_dtype)
    results = {}
    for isa in X86_ISAS:
        assert _adam.force_isa(isa)
        out16 = torch.empty(p0.numel(), dtype=torch.bfloat16)
        p, m, v, stats = step(p0, g, m0, v0, param_bf16_out=out16)
        results[isa] = (p, m, v, out16, stats, se.grad_stats(g))
    base = results["scalar"]
    for isa, r in results.items():
        for a, b, what in zip(r[:4], base[:4], ("param", "exp_avg", "exp_avg_sq", "param_bf16_out")):
            assert_bitwise(a, b, f"{isa} {what}")
        assert r[4] == base[4] and r[5] == base[5], f"{isa}: gradient statistics differ"


@pytest.mark.parametrize("isa", X86_ISAS)
def test_one_and_two_threads_give_identical_bits(isa, settings_restored):
    assert _adam.force_isa(isa)
    p0, g, m0, v0 = make_state(7 * 16384 + 3, seed=4)
    out = {}
    for t in (1, 2):
        se.set_num_threads(t)
        assert se.get_num_threads() == t
        out[t] = step(p0, g, m0, v0) + (se.grad_stats(g),)
    for a, b in zip(out[1][:3], out[2][:3]):
        assert_bitwise(a, b, "state")
    assert out[1][3] == out[2][3] and out[1][4] == out[2][4]


def test_kernel_settings_apply_inside_the_block_and_restore_every_setting_after_it():
    before = se.KernelSettings.current()
    other_isa = next((name for name in X86_ISAS if name != before.isa), before.isa)
    want = dict(threads=before.threads + 1, isa=other_isa, store_policy="regular",
                stream_threshold=before.stream_threshold + 8, prefetch=64, dynamic_schedule=not before.dynamic_schedule)
    with pytest.raises(RuntimeError, match="inside"):
        with se.kernel_settings(**want) as entry:
            assert entry == before
            assert se.KernelSettings.current() == se.KernelSettings(**want)
            se.set_store_policy("streaming", 4096)   # changed inside the block: restored too
            raise RuntimeError("inside")
    assert se.KernelSettings.current() == before
    with pytest.raises(TypeError, match=r"unknown settings \['threds'\]; known: \['threads'"):
        with se.kernel_settings(threds=2):
            pass
    with pytest.raises(ValueError, match="isa='nonesuch' is not usable"):
        with se.kernel_settings(isa="nonesuch", threads=before.threads + 1):
            pass
    assert se.KernelSettings.current() == before


def test_isa_and_build_info_are_reported():
    info = se.build_info()
    assert se.isa() == info["isa"] and info["isa"] in info["available_isas"]
    assert "scalar" in info["available_isas"]
    assert "-fno-math-errno" in info["compile_flags"] and "-ffp-contract=off" in info["compile_flags"]
    assert info["num_threads"] >= 1 and info["openmp"] > 0
    if "avx512f" in open("/proc/cpuinfo").read() and not os.environ.get("SOCOMPILE_ISA"):
        assert se.isa() == "avx512"


def test_doctor_reports_the_kernel():
    from socompile import doctor

    text = doctor.report()
    assert f"CPU Adam kernel ISA: {se.isa()}" in text
    assert "OpenMP threads" in text and "-fno-math-errno" in text and "NUMA nodes" in text and "ulimit -l" in text


def test_socompile_isa_env_forces_a_lower_path_without_importing_torch():
    code = "import sys, socompile_ext as s; print(s.isa(), 'torch' in sys.modules)"
    env = {**os.environ, "SOCOMPILE_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["scalar", "False"]
    env["SOCOMPILE_ISA"] = "nonsense"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "SOCOMPILE_ISA" in bad.stderr


# ---------------------------------------------------------------- ping-pong and inverse rollback

@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", [1, 17, 16384 * 9 + 7])  # the last one is large enough for streaming stores
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_ping_pong_equals_in_place_bitwise_and_keeps_inputs(isa, n, grad_dtype, settings_restored):
    assert _adam.force_isa(isa)
    p0, g, m0, v0 = make_state(n, seed=n, grad_dtype=grad_dtype)
    hp = dict(decoupled=False, grad_scale=0.3)
    a16 = torch.empty(n, dtype=torch.bfloat16)
    p, m, v, stats = step(p0, g, m0, v0, param_bf16_out=a16, **hp)
    pa, ma, va = p0.clone(), m0.clone(), v0.clone()
    pb, mb, vb, b16 = torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
    stats_b = se.adam_step(pa, g, ma, va, **{**HP, **hp}, param_out=pb, exp_avg_out=mb, exp_avg_sq_out=vb,
                           param_bf16_out=b16)
    for x, y, what in ((pb, p, "param"), (mb, m, "exp_avg"), (vb, v, "exp_avg_sq"), (b16, a16, "bf16")):
        assert_bitwise(x, y, what)
    for x, y, what in ((pa, p0, "param"), (ma, m0, "exp_avg"), (va, v0, "exp_avg_sq")):
        assert_bitwise(x, y, f"input {what} (must stay untouched for rollback)")
    assert stats_b == stats


def test_ping_pong_undoes_a_non_finite_step():
    p0, g, m0, v0 = make_state(100, seed=8)
    g[5] = float("nan")
    outs = [torch.empty(100) for _ in range(3)]
    _, nonfinite = se.adam_step(p0, g, m0, v0, **HP, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2])
    assert nonfinite
    assert torch.isfinite(p0).all() and torch.isfinite(m0).all() and torch.isfinite(v0).all()


# ---------------------------------------------------------------- store policy (streaming stores)

DEFAULT_STREAM_MIN = se.get_store_policy()[1]  # half the last-level cache / 28 B, at least 128K elements


def at_offset(n, off, dtype=torch.float32):
    """An n-element view starting `off` elements after a 64-byte aligned address (torch aligns large CPU
    allocations to 64 bytes; checked), so the kernel has to peel an unaligned head before streaming."""
    base = torch.full((n + 64,), float("nan")).to(dtype) if dtype != torch.float32 else torch.full((n + 64,), float("nan"))
    assert base.data_ptr() % 64 == 0
    return base[off:off + n]


def in_place_regular(p0, g, m0, v0, hp):
    se.set_store_policy("regular")
    out16 = torch.empty(p0.numel(), dtype=torch.bfloat16)
    p, m, v, stats = step(p0, g, m0, v0, param_bf16_out=out16, **hp)
    se.set_store_policy("auto")
    return p, m, v, out16, stats


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n, threshold", [
    (DEFAULT_STREAM_MIN - 1, None), (DEFAULT_STREAM_MIN + 33, None),  # either side of the default threshold
    (3 * 16384 + 17, 4096), (16384 * 2, 4096), (40, 16), (16, 16),   # multi-block, exact blocks, tiny ranges
])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (5, 5), (15, 15), (3, 9)])  # (state outputs, bf16 copy)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_streaming_ping_pong_equals_regular_in_place_bitwise(isa, n, threshold, offsets, grad_dtype, settings_restored):
    """Non-temporal stores change no value: a ping-pong step with streaming stores (unaligned heads and tails
    through regular stores, the sum-of-squares lanes rotated past the head) gives exactly the bits of the
    in-place step with regular stores, for every ISA, at sizes across the threshold, with 1 and 2 threads."""
    assert _adam.force_isa(isa)
    p0, g, m0, v0 = make_state(n, seed=n + offsets[0], grad_dtype=grad_dtype)
    hp = dict(decoupled=offsets[0] % 2 == 0, grad_scale=0.7)
    ref = in_place_regular(p0, g, m0, v0, hp)
    se.set_store_policy("auto", threshold)
    for threads in (1, 2):
        se.set_num_threads(threads)
        po, mo, vo = (at_offset(n, offsets[0]) for _ in range(3))
        o16 = at_offset(n, offsets[1], torch.bfloat16)
        kw = dict(param_out=po, exp_avg_out=mo, exp_avg_sq_out=vo, param_bf16_out=o16)
        choice = se.store_choice(p0, g, m0, v0, **kw)
        big = n >= (threshold or DEFAULT_STREAM_MIN)
        vector = isa in ("avx2", "avx512")
        assert choice["state"] == (big and vector), choice
        # the bf16 copy streams too when its 64-byte boundary falls on the same element as the state's
        assert choice["bf16"] == (big and vector and offsets[1] == offsets[0]), choice
        pa, ma, va = p0.clone(), m0.clone(), v0.clone()
        stats = se.adam_step(pa, g, ma, va, **{**HP, **hp}, **kw)
        for x, y, what in zip((po, mo, vo, o16), ref[:4], ("param", "exp_avg", "exp_avg_sq", "bf16")):
            assert_bitwise(x, y, f"{what} ({threads} threads)")
        assert stats == ref[4], "gradient statistics differ (sum-of-squares lanes)"
        for x, y in ((pa, p0), (ma, m0), (va, v0)):
            assert_bitwise(x, y, "input (must stay untouched)")


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("off", [0, 7])
def test_streaming_in_place_and_bf16_only_streaming_equal_regular(isa, off, settings_restored):
    """policy 'streaming' streams in-place outputs too; an in-place step with a separate bf16 copy streams
    the copy alone (auto, above the threshold). Same bits as regular stores."""
    assert _adam.force_isa(isa)
    n = 2 * 16384 + 29
    p0, g, m0, v0 = make_state(n, seed=3, grad_dtype=torch.bfloat16)
    ref = in_place_regular(p0, g, m0, v0, {})
    for policy, threshold in (("streaming", None), ("auto", 1024)):
        se.set_store_policy(policy, threshold)
        p, m, v = (at_offset(n, off) for _ in range(3))
        p.copy_(p0), m.copy_(m0), v.copy_(v0)
        o16 = at_offset(n, off, torch.bfloat16)
        choice = se.store_choice(p, g, m, v, param_bf16_out=o16)
        vector = isa in ("avx2", "avx512")
        assert choice == {"state": vector and policy == "streaming", "bf16": vector}, choice
        stats = se.adam_step(p, g, m, v, **HP, param_bf16_out=o16)
        for x, y, what in zip((p, m, v, o16), ref[:4], ("param", "exp_avg", "exp_avg_sq", "bf16")):
            assert_bitwise(x, y, f"{policy}: {what}")
        assert stats == ref[4]


def test_outputs_with_different_alignment_fall_back_to_regular_stores(settings_restored):
    n = DEFAULT_STREAM_MIN + 5
    p0, g, m0, v0 = make_state(n, seed=2)
    se.set_store_policy("auto")
    outs = dict(param_out=at_offset(n, 0), exp_avg_out=at_offset(n, 3), exp_avg_sq_out=at_offset(n, 0))
    assert se.store_choice(p0, g, m0, v0, **outs) == {"state": False, "bf16": False}
    se.set_store_policy("regular")
    aligned = dict(param_out=torch.empty(n), exp_avg_out=torch.empty(n), exp_avg_sq_out=torch.empty(n))
    assert se.store_choice(p0, g, m0, v0, **aligned) == {"state": False, "bf16": False}
    se.set_store_policy("auto")
    assert se.store_choice(p0, g, m0, v0, **aligned)["state"] == (se.isa() in ("avx2", "avx512"))
    # a small tensor streams when the multi-tensor call it belongs to is large
    small = [t[:1000] for t in (p0, g, m0, v0)] + [dict(param_out=torch.empty(1000), exp_avg_out=torch.empty(1000),
                                                       exp_avg_sq_out=torch.empty(1000))]
    assert se.store_choice(*small[:4], **small[4])["state"] is False
    assert se.store_choice(*small[:4], **small[4], call_numel=n)["state"] == (se.isa() in ("avx2", "avx512"))
    ref = step(p0, g, m0, v0)
    se.adam_step(p0.clone(), g, m0.clone(), v0.clone(), **HP, **outs)
    for x, y in zip(outs.values(), ref[:3]):
        assert_bitwise(x, y, "state")


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("off", [0, 11])
def test_copy_ceiling_with_streaming_stores_copies_exactly(isa, off, settings_restored):
    assert _adam.force_isa(isa)
    n = 3 * 16384 + 9
    p, g, m, v = make_state(n, seed=5, grad_dtype=torch.bfloat16)
    for policy in ("auto", "streaming", "regular"):
        se.set_store_policy(policy, 1024)
        outs = [at_offset(n, off) for _ in range(3)]
        o16 = at_offset(n, off, torch.bfloat16)
        se._copy_ceiling(p, g, m, v, *outs, param_bf16_out=o16)
        for x, y in zip(outs, (p, m, v)):
            assert_bitwise(x, y, f"{policy}: ceiling copy")
        assert torch.equal(o16.view(torch.int16), (p.view(torch.int32) >> 16).to(torch.int16))


MULTI_SIZES = [0, 1, 17, 16384 + 5, 3 * 16384 + 17, DEFAULT_STREAM_MIN + 33, 1000]


def multi_case(seed=0):
    """Tensors of mixed sizes, grad dtypes, in-place / ping-pong, with and without a bf16 copy, some unaligned."""
    cases = []
    for j, n in enumerate(MULTI_SIZES):
        p, g, m, v = make_state(n, seed=seed + j, grad_dtype=torch.bfloat16 if j % 2 else torch.float32)
        pp = j % 3 != 0
        outs = tuple(at_offset(n, j % 4) for _ in range(3)) if pp else (None, None, None)
        o16 = at_offset(n, j % 4, torch.bfloat16) if j % 2 == 0 else None
        cases.append((p, g, m, v, outs, o16))
    return cases


@pytest.mark.parametrize("isa", X86_ISAS)
def test_multi_tensor_step_equals_single_calls_bitwise(isa, settings_restored):
    assert _adam.force_isa(isa)
    hp = {**HP, "decoupled": False, "grad_scale": 0.5}
    ref = []
    for p, g, m, v, outs, o16 in multi_case():
        p, m, v = p.clone(), m.clone(), v.clone()
        po, mo, vo = (o.clone() if o is not None else None for o in outs)
        r16 = o16.clone() if o16 is not None else None
        st = se.adam_step(p, g, m, v, **hp, param_out=po, exp_avg_out=mo, exp_avg_sq_out=vo, param_bf16_out=r16)
        ref.append(((po if po is not None else p), (mo if mo is not None else m), (vo if vo is not None else v), r16, st))
    total = 0.0
    for r in ref:
        total += r[4][0]
    for threads, dynamic in ((1, True), (2, True), (2, False)):
        se.set_num_threads(threads)
        _adam.set_dynamic_schedule(dynamic)
        cases = multi_case()
        ps, ms, vs = [c[0].clone() for c in cases], [c[2].clone() for c in cases], [c[3].clone() for c in cases]
        st = se.adam_step_multi(ps, [c[1] for c in cases], ms, vs, **hp, params_out=[c[4][0] for c in cases],
                                exp_avgs_out=[c[4][1] for c in cases], exp_avg_sqs_out=[c[4][2] for c in cases],
                                params_bf16_out=[c[5] for c in cases])
        assert st == (total, False), (threads, dynamic)
        for j, (c, r) in enumerate(zip(cases, ref)):
            got = [c[4][0] if c[4][0] is not None else ps[j], c[4][1] if c[4][1] is not None else ms[j],
                   c[4][2] if c[4][2] is not None else vs[j], c[5]]
            for x, y, what in zip(got, r[:4], ("param", "exp_avg", "exp_avg_sq", "bf16")):
                if y is not None:
                    assert_bitwise(x, y, f"tensor {j} {what} ({threads} threads, dynamic={dynamic})")


def test_multi_tensor_step_flags_non_finite_and_checks_its_lists():
    ps, gs, ms, vs = zip(*(make_state(n, seed=n) for n in (10, 20)))
    gs[1][3] = float("inf")
    assert se.adam_step_multi(list(ps), list(gs), list(ms), list(vs), **HP)[1] is True
    with pytest.raises(ValueError, match="equal length"):
        se.adam_step_multi(list(ps), list(gs[:1]), list(ms), list(vs), **HP)
    with pytest.raises(ValueError, match="overlaps"):  # the same parameter twice: written twice
        se.adam_step_multi([ps[0], ps[0]], [gs[0], gs[0]], [ms[0], ms[0].clone()], [vs[0], vs[0].clone()], **HP)
    with pytest.raises(ValueError, match="overlaps"):  # tensor 0's output is tensor 1's input
        se.adam_step_multi(list(ps), list(gs), list(ms), list(vs), **HP, exp_avgs_out=[ms[1][:10], None])
    assert se.adam_step_multi([], [], [], [], **HP) == (0.0, False)


def test_one_gradient_may_feed_several_tensors():
    p0, g, m0, v0 = make_state(64, seed=1)
    p1, m1, v1 = p0.clone(), m0.clone(), v0.clone()
    se.adam_step_multi([p0, p1], [g, g], [m0, m1], [v0, v1], **HP)
    assert_bitwise(p0, p1, "param")


@pytest.mark.parametrize("dynamic", [True, False])
def test_copy_ceiling_multi_copies_exactly(dynamic, settings_restored):
    _adam.set_dynamic_schedule(dynamic)
    se.set_store_policy("auto", 1024)
    cases = multi_case(seed=3)
    outs = [tuple(at_offset(c[0].numel(), 1) for _ in range(3)) for c in cases]
    se._copy_ceiling_multi([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases],
                           [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs])
    for c, o in zip(cases, outs):
        for x, y in zip(o, (c[0], c[2], c[3])):
            assert_bitwise(x, y, "ceiling copy")


@pytest.mark.parametrize("isa", X86_ISAS)
def test_software_prefetch_changes_no_bits(isa, settings_restored):
    assert _adam.force_isa(isa)
    n = 3 * 16384 + 17
    p0, g, m0, v0 = make_state(n, seed=12)
    ref = in_place_regular(p0, g, m0, v0, {})
    with se.kernel_settings(prefetch=1000, store_policy="auto", stream_threshold=1024):
        assert _adam.get_prefetch() == 1008  # rounded up to whole vectors
        outs = [at_offset(n, 2) for _ in range(3)]
        stats = se.adam_step(p0.clone(), g, m0.clone(), v0.clone(), **HP, param_out=outs[0], exp_avg_out=outs[1],
                             exp_avg_sq_out=outs[2])
    for x, y in zip(outs, ref[:3]):
        assert_bitwise(x, y, "state with prefetch")
    assert stats == ref[4]


def test_store_policy_is_validated_and_reported(settings_restored):
    with pytest.raises(ValueError, match="store policy"):
        se.set_store_policy("nontemporal")
    with pytest.raises(ValueError, match="stream_threshold"):
        se.set_store_policy("auto", 1.5)
    se.set_store_policy("streaming", 4096)
    assert se.get_store_policy() == ("streaming", 4096)
    assert se.build_info()["store_policy"] == ("streaming", 4096)
    se.set_store_policy("auto", 0)
    assert se.get_store_policy() == ("auto", DEFAULT_STREAM_MIN)
    assert DEFAULT_STREAM_MIN >= 1 << 17


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_no", [1, 5, 1000])
def test_inverse_rollback_error_is_bounded(decoupled, grad_dtype, step_no):
    n = 20_011
    p0, g, m0, v0 = make_state(n, seed=step_no, grad_dtype=grad_dtype)
    if step_no == 1:
        m0.zero_(), v0.zero_()  # the first step starts from zero moments
    hp = {**HP, "step": step_no, "decoupled": decoupled, "grad_scale": 0.9}
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    se.adam_step(p, g, m, v, **hp)
    p1, m1, v1 = p.clone(), m.clone(), v.clone()
    se.adam_rollback(p, g, m, v, **hp)
    # Error bound of the inverse. The inverse is exact to double precision, so what remains are the forward
    # step's fp32 roundings (each <= u = 2^-24 relative), divided by the factor the step multiplied the old
    # value with. With G = |g| (AdamW) or |g| + wd|p0| (Adam, whose fp32 g + wd*p0 is off by <= 2uG):
    #   m1 = fl(m0 + fl(w1 fl(g - m0)))           -> |m - m0| <= u (|m1| + 4 w1 (G + |m0|)) / b1
    #   v1 = fl(fl(b2 v0) + fl(fl(c g) g)), c=1-b2 -> |v - v0| <= u (2 v1 + 6 c G^2) / b2
    #   p1 = fl(fl(p0 d) - U), U within 5u          -> |p - p0| <= u (|p0| + |p1| + 5 |U|) / d
    # plus the final rounding to fp32 (u |x0|). The asserted bounds are these with a 2x margin.
    b1, b2 = hp["beta1"], hp["beta2"]
    G = (g.float() * 0.9).double().abs()
    if not decoupled:
        G = G + hp["weight_decay"] * p0.double().abs()
    decay = (1 - hp["lr"] * hp["weight_decay"]) if decoupled else 1.0
    U = (p1.double() - p0.double() * decay).abs()
    u = EPS32
    bound_m = 2 * u * (m1.double().abs() + 4 * (1 - b1) * (G + m0.double().abs())) / b1 + u * m0.double().abs()
    bound_v = 2 * u * (2 * v1.double() + 6 * (1 - b2) * G * G) / b2 + u * v0.double()
    bound_p = 2 * u * (p0.double().abs() + p1.double().abs() + 5 * U) / decay + u * p0.double().abs()
    assert ((m.double() - m0.double()).abs() <= bound_m).all()
    assert ((v.double() - v0.double()).abs() <= bound_v).all()
    assert ((p.double() - p0.double()).abs() <= bound_p).all()
    assert (v >= 0).all(), "v is clamped at 0"


def test_inverse_rollback_refuses_uninvertible_steps():
    p, g, m, v = make_state(4)
    with pytest.raises(ValueError, match="ping-pong"):
        se.adam_rollback(p, g, m, v, **{**HP, "beta1": 0.0})


# ---------------------------------------------------------------- bf16 in and out

F32_SPECIALS = np.array([
    0x00000000, 0x80000000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0x7F7FFFFF,
    0x7F7F8000, 0xFF7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0xFF800001, 0x7FFFFFFF, 0x7F80FFFF, 0x00008000, 0x00018000, 0x80000001, 0x007FFFFF, 0x00800000,
], dtype=np.uint32)


def torch_bf16_bits(x):
    return x.to(torch.bfloat16).view(torch.int16)


def bf16_through_kernel(pbits):
    """p with the given bit patterns through a step that leaves p unchanged (lr = 0, m = v = g = 0)."""
    n = len(pbits)
    p = torch.from_numpy(pbits.astype(np.uint32).view(np.float32).copy())
    out16 = torch.empty(n, dtype=torch.bfloat16)
    se.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0, param_bf16_out=out16)
    return p, out16


@pytest.mark.parametrize("isa", X86_ISAS)
def test_bf16_param_copy_is_bit_identical_to_torch_including_specials(isa, settings_restored):
    assert _adam.force_isa(isa)
    pattern = np.tile(F32_SPECIALS, 3)  # 72 elements: full vectors and a tail on every path
    p, out16 = bf16_through_kernel(pattern)
    nan = torch.isnan(p)
    assert nan.sum() == 3 * int(np.isnan(F32_SPECIALS.view(np.float32)).sum())
    # every NaN -> 0xFFFF: what torch's AVX2/AVX-512 conversion gives (its scalar fallback gives 0x7FC0;
    # both are NaN, the point is that no NaN turns into an Inf or -0 through the rounding add)
    assert (out16.view(torch.int16)[nan] == -1).all()
    assert torch.isnan(out16[nan].float()).all()
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert_bitwise(out16, p.to(torch.bfloat16), "bf16 copy")
    else:
        assert torch.equal(out16.view(torch.int16)[~nan], torch_bf16_bits(p)[~nan])
    # overflow rounds to +-Inf, the largest tie below it rounds to even (stays finite)
    by_bits = dict(zip(pattern[:24].tolist(), out16.view(torch.int16)[:24].tolist()))
    assert by_bits[0x7F7FFFFF] == 0x7F80 and by_bits[0x7F7F7FFF] == 0x7F7F


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
def test_bf16_rounding_matches_torch_on_random_bit_patterns(words):
    p, out16 = bf16_through_kernel(np.array(words, dtype=np.uint64))
    nan = torch.isnan(p)
    assert torch.equal(out16.view(torch.int16)[~nan], torch_bf16_bits(p)[~nan])
    assert (out16.view(torch.int16)[nan] == -1).all()


def test_bf16_gradients_are_read_exactly():
    p0, g16, m0, v0 = make_state(333, seed=6, grad_dtype=torch.bfloat16)
    a = step(p0, g16, m0, v0)
    b = step(p0, g16.float(), m0, v0)
    for x, y in zip(a[:3], b[:3]):
        assert_bitwise(x, y, "state")
    assert a[3] == b[3]


# ---------------------------------------------------------------- NaN / Inf and gradient statistics

@pytest.mark.parametrize("decoupled", [True, False])
def test_non_finite_values_propagate_like_torch_and_are_flagged(decoupled):
    n = 64
    p0, g, _, _ = make_state(n, seed=12)
    g[3], g[17], g[40] = float("nan"), float("inf"), float("-inf")
    p0[50] = float("inf")
    ref = p0.clone().requires_grad_()
    ref.grad = g.clone()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    cls([ref], lr=1e-3, weight_decay=0.1, foreach=False).step()
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    sumsq, nonfinite = se.adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.1, decoupled=decoupled)
    for mine, theirs in ((p, ref.detach()), (m, torch.zeros(0)), (v, torch.zeros(0))):
        if theirs.numel():
            assert torch.equal(torch.isnan(mine), torch.isnan(theirs))
            assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
            assert torch.equal(mine[torch.isfinite(mine)] > 0, theirs[torch.isfinite(theirs)] > 0)
    assert nonfinite and not np.isfinite(sumsq)


def test_scaled_gradient_overflow_is_flagged():
    g = torch.full((10,), 3e38)
    p, m, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    assert se.adam_step(p, g, m, v, **HP, grad_scale=10.0)[1] is True
    assert se.adam_step(torch.zeros(10), g, torch.zeros(10), torch.zeros(10), **HP)[1] is False


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 17, 16384 * 3 + 1])
def test_grad_stats(grad_dtype, n):
    g = make_state(n, seed=n, grad_dtype=grad_dtype)[1]
    sumsq, nonfinite = se.grad_stats(g)
    assert sumsq == pytest.approx((g.double() ** 2).sum().item(), rel=1e-12, abs=0.0)
    assert nonfinite is False
    if n:
        g[n // 2] = float("nan")
        assert se.grad_stats(g)[1] is True
        g[n // 2] = float("inf")
        assert se.grad_stats(g) == (float("inf"), True)


def test_step_reports_the_same_statistics_as_grad_stats():
    p0, g, m0, v0 = make_state(10_000, seed=1)
    assert step(p0, g, m0, v0)[3] == se.grad_stats(g)


# ---------------------------------------------------------------- bad input

def good(n=8):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize("case, exc, msg", [
    ("non_contiguous_param", ValueError, "contiguous"),
    ("numel_mismatch", ValueError, "same numel"),
    ("fp64_param", TypeError, "float32"),
    ("fp16_grad", TypeError, "bfloat16"),
    ("meta_device", ValueError, "CPU"),
    ("not_a_tensor", TypeError, "torch.Tensor"),
    ("out_overlaps_input", ValueError, "overlaps"),
    ("state_aliases_param", ValueError, "overlaps"),
    ("bad_step", ValueError, "step"),
    ("fp32_bf16_out", TypeError, "bfloat16"),
])
def test_bad_input_is_rejected_with_a_clear_message(case, exc, msg):
    p, g, m, v = good()
    kw = {}
    if case == "non_contiguous_param":
        p = torch.zeros(16)[::2]
    elif case == "numel_mismatch":
        m = torch.zeros(9)
    elif case == "fp64_param":
        p = p.double()
    elif case == "fp16_grad":
        g = g.half()
    elif case == "meta_device":
        v = torch.zeros(8, device="meta")
    elif case == "not_a_tensor":
        g = np.zeros(8, dtype=np.float32)
    elif case == "out_overlaps_input":
        big = torch.zeros(16)
        p, kw["param_out"] = big[:8], big[4:12]
    elif case == "state_aliases_param":
        m = p
    elif case == "bad_step":
        kw["step"] = 0
    elif case == "fp32_bf16_out":
        kw["param_bf16_out"] = torch.zeros(8)
    before = p.clone() if p.device.type == "cpu" and p.dtype == torch.float32 else None
    with pytest.raises(exc, match=msg):
        se.adam_step(p, g, m, v, **{**HP, **kw})
    if before is not None:
        assert_bitwise(p, before, "param after a rejected call")


def test_set_num_threads_rejects_nonsense():
    with pytest.raises(ValueError):
        se.set_num_threads(0)


def test_empty_tensors_are_a_no_op():
    assert se.adam_step(*good(0), **HP) == (0.0, False)
    assert se.grad_stats(torch.zeros(0, dtype=torch.bfloat16)) == (0.0, False)
