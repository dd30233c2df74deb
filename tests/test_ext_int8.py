"""socompile_ext with int8 block-quantised moments (csrc/adam.h, csrc/adam_int8.h).

The kernel decodes each block of 16 (codes * scale; exp_avg_sq stored as its square root), runs the fp32 step
of socx_adam_elem and re-encodes with stochastic rounding from socx_round_bits. The reference is
socompile/runtime/int8_moments.py (decode / encode_moments in torch ops) around the numpy fp32 emulation of the
step (tests/test_ext_adam.py emulate_fp32): they must agree bit for bit on every path, thread count, store
variant and in-place / ping-pong.
"""
import math

import numpy as np
import pytest
import torch

import socompile_ext as se
from socompile.runtime.int8_moments import decode, encode_moments
from test_ext_adam import HP, X86_ISAS, assert_bitwise, emulate_fp32, make_state

SIZES = [1, 7, 15, 16, 17, 33, 1000, 16384 + 5, 3 * 16384 + 17]


def nbytes(n):
    return -(-n // 16) * 20


def int8_state(n, seed=0, grad_dtype=torch.float32, round_seed=5):
    p, g, m, v = make_state(n, seed, grad_dtype)
    m8, v8 = encode_ref(m, v, round_seed)
    return p, g, m8, v8


def encode_ref(m, v, seed):
    return encode_moments(m, v, seed)


def reference(p, g, m8, v8, seed, **hp):
    """decode -> the kernel's fp32 step -> encode (the reference's own conversions, with its correctly rounded sqrt)."""
    n = p.numel()
    p1, m1, v1 = emulate_fp32(p, g, decode(m8, n, True), decode(v8, n, False), **hp)
    em8, ev8 = encode_ref(m1, v1, seed)
    return p1, em8, ev8


def test_the_reference_square_root_is_correctly_rounded_as_the_kernels():
    """The kernel's w = sqrtf(v) is IEEE's (the root its step divides by); torch's vectorised fp32 sqrt is 1 ulp off
    for some inputs on some CPUs, so the reference takes the double root rounded to fp32, which is numpy's."""
    from socompile.runtime.int8_moments import _sqrt
    x = torch.rand(4096) * 0.01
    assert torch.equal(_sqrt(x).view(torch.int32), torch.from_numpy(np.sqrt(x.numpy())).view(torch.int32))


def assert_bytes(a, b, what):
    assert torch.equal(a, b), f"{what} differs: bytes {(a != b).nonzero().flatten()[:8].tolist()}"


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_int8_moment_step_equals_the_reference_bitwise(isa, n, grad_dtype, decoupled):
    hp = {**HP, "decoupled": decoupled, "grad_scale": 0.75}
    p0, g, m0, v0 = int8_state(n, seed=n, grad_dtype=grad_dtype)
    ep, em, ev = reference(p0, g, m0, v0, 4321, **hp)
    with se.kernel_settings(isa=isa):
        for out16 in (False, True):
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            p16 = torch.empty(n, dtype=torch.bfloat16) if out16 else None
            se.adam_step(p, g, m, v, **hp, param_bf16_out=p16, round_seed=4321)
            assert_bitwise(p, ep, "param")
            assert_bytes(m, em, "exp_avg")
            assert_bytes(v, ev, "exp_avg_sq")
            if out16:
                assert_bitwise(p16, ep.bfloat16(), "bf16 copy")


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", [17, 16384 * 9 + 7])
def test_int8_ping_pong_equals_in_place_and_keeps_its_inputs(isa, n):
    with se.kernel_settings(isa=isa, store_policy="auto", stream_threshold=1 << 17):
        p0, g, m0, v0 = int8_state(n, seed=3)
        keep = [t.clone() for t in (p0, m0, v0)]
        outs = [torch.empty_like(t) for t in (p0, m0, v0)]
        se.adam_step(p0, g, m0, v0, **HP, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2],
                     round_seed=9)
        for a, b, what in zip((p0, m0, v0), keep, ("param", "exp_avg", "exp_avg_sq")):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} input changed"
        p, m, v = (t.clone() for t in keep)
        se.adam_step(p, g, m, v, **HP, round_seed=9)
        assert_bitwise(p, outs[0], "param")
        assert_bytes(m, outs[1], "exp_avg")
        assert_bytes(v, outs[2], "exp_avg_sq")
        # int8 moments never stream (regular stores in the step and its ceiling alike)
        choice = se.store_choice(p0, g, m0, v0, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2])
        assert choice == {"state": False, "bf16": False}


@pytest.mark.parametrize("isa", X86_ISAS)
def test_int8_moments_give_the_same_bits_on_one_and_two_threads(isa):
    n = 5 * 16384 + 3
    p0, g, m0, v0 = int8_state(n, seed=5)
    results = []
    for threads in (1, 2):
        with se.kernel_settings(isa=isa, threads=threads):
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            stats = se.adam_step(p, g, m, v, **HP, round_seed=77)
            results.append((p, m, v, stats))
    assert_bitwise(results[0][0], results[1][0], "param")
    assert_bytes(results[0][1], results[1][1], "exp_avg")
    assert_bytes(results[0][2], results[1][2], "exp_avg_sq")
    assert results[0][3] == results[1][3]
    # and the sum of squares is the fp32-moment step's (the same scaled gradient, the same lanes)
    p, _, m, v = make_state(n, 5)
    assert se.adam_step(p, g, m, v, **HP) == results[0][3]


def test_five_chained_steps_stay_equal_to_the_chained_reference():
    n = 16384 + 37
    p, g, m, v = int8_state(n, seed=11)
    ep, em, ev = p.clone(), m.clone(), v.clone()
    for step in range(1, 6):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 0.1
        hp = {**HP, "step": step}
        se.adam_step(p, g, m, v, **hp, round_seed=1000 + step)
        ep, em, ev = reference(ep, g, em, ev, 1000 + step, **hp)
        assert_bitwise(p, ep, f"param after step {step}")
        assert_bytes(m, em, f"exp_avg after step {step}")
        assert_bytes(v, ev, f"exp_avg_sq after step {step}")


def test_multi_tensor_int8_step_equals_single_calls_with_their_seeds():
    cases = [int8_state(n, seed=n) for n in (5, 16384 + 9, 300)]
    seeds = [11, 22, 33]
    single = []
    for (p, g, m, v), seed in zip(cases, seeds):
        p, m, v = p.clone(), m.clone(), v.clone()
        se.adam_step(p, g, m, v, **HP, round_seed=seed)
        single.append((p, m, v))
    ps, ms, vs = ([c[k].clone() for c in cases] for k in (0, 2, 3))
    se.adam_step_multi(ps, [c[1] for c in cases], ms, vs, **HP, round_seeds=seeds)
    for j, (p, m, v) in enumerate(single):
        assert_bitwise(ps[j], p, f"param {j}")
        assert_bytes(ms[j], m, f"exp_avg {j}")
        assert_bytes(vs[j], v, f"exp_avg_sq {j}")


def test_zero_gradient_blocks_with_zero_moments_encode_zero_codes_and_scales():
    n = 70
    p = torch.randn(n)
    g = torch.randn(n)
    g[16:48] = 0.0   # blocks 1 and 2
    m, v = encode_ref(torch.zeros(n), torch.zeros(n), 0)
    se.adam_step(p, g, m, v, **HP, round_seed=3)
    rows_m, rows_v = m.view(-1, 20), v.view(-1, 20)
    for j in (1, 2):
        assert rows_m[j].eq(0).all() and rows_v[j].eq(0).all(), f"block {j}: codes and scale all 0"
    # the blocks with a gradient: every v > 0 keeps a code >= 1, and the short last block's padding is 0
    assert rows_v[0, :16].ge(1).all() and rows_v[3, :16].ge(1).all()
    assert rows_m[4, n % 16:16].eq(0).all() and rows_v[4, n % 16:16].eq(0).all()
    assert decode(v, n, False)[16:48].eq(0).all()


def test_a_nan_gradient_makes_its_blocks_moments_non_finite():
    n = 40
    p, g, m, v = int8_state(n, seed=2)
    g[20] = float("nan")
    sumsq, nonfinite = se.adam_step(p, g, m, v, **HP, round_seed=1)
    assert nonfinite and math.isnan(sumsq)
    dm, dv = decode(m, n, True), decode(v, n, False)
    assert not torch.isfinite(dm[16:32]).any() and not torch.isfinite(dv[16:32]).any()
    assert torch.isfinite(dm[:16]).all() and torch.isfinite(dv[32:]).all()


def test_int8_moments_refuse_the_inverse_wrong_sizes_and_mixed_formats():
    n = 33
    p, g, m, v = int8_state(n)
    with pytest.raises(ValueError, match="int8 moments.*ping-pong"):
        se.adam_rollback(p, g, m, v, **HP)
    with pytest.raises(ValueError, match=r"exp_avg is an int8 moment buffer .* of 59 bytes.*= 60 bytes"):
        se.adam_step(p, g, m[:59], v, **HP)
    with pytest.raises(ValueError, match=r"exp_avg_sq_out is an int8 moment buffer .*= 60 bytes"):
        se.adam_step(p, g, m, v, **HP, exp_avg_sq_out=torch.empty(n, dtype=torch.uint8))
    with pytest.raises(TypeError, match="exp_avg_sq has dtype torch.float32; expected torch.uint8"):
        se.adam_step(p, g, m, torch.zeros(n), **HP)
    with pytest.raises(TypeError, match="exp_avg_out has dtype torch.bfloat16; expected torch.uint8"):
        se.adam_step(p, g, m, v, **HP, exp_avg_out=torch.empty(n, dtype=torch.bfloat16))


def test_overlap_checks_count_the_int8_buffers_bytes():
    n = 64
    p, g, _, _ = int8_state(n)
    buf = torch.zeros(3 * nbytes(n), dtype=torch.uint8)
    m, v = buf[:nbytes(n)], buf[nbytes(n):2 * nbytes(n)]
    se.adam_step(p, g, m, v, **HP)   # adjacent buffers: fine
    with pytest.raises(ValueError, match="overlaps"):
        se.adam_step(p, g, m, v, **HP, exp_avg_out=buf[nbytes(n) - 1:2 * nbytes(n) - 1])


@pytest.mark.parametrize("isa", X86_ISAS)
def test_copy_ceiling_with_int8_moments_copies_exactly(isa):
    with se.kernel_settings(isa=isa, store_policy="streaming"):
        n = 16384 * 3 + 11
        p, g, m, v = int8_state(n, seed=4)
        outs = [torch.empty_like(t) for t in (p, m, v)]
        p16 = torch.empty(n, dtype=torch.bfloat16)
        se._copy_ceiling(p, g, m, v, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2],
                         param_bf16_out=p16)
        assert_bitwise(outs[0], p, "param copy")
        assert_bytes(outs[1], m, "exp_avg copy")
        assert_bytes(outs[2], v, "exp_avg_sq copy")
        assert torch.equal(p16.view(torch.int16), (p.view(torch.int32) >> 16).to(torch.int16))
        ms, vs = [torch.zeros_like(m)], [torch.zeros_like(v)]
        se._copy_ceiling_multi([p], [g], [m], [v], [outs[0]], ms, vs)
        assert_bytes(ms[0], m, "exp_avg copy (multi)")
        assert_bytes(vs[0], v, "exp_avg_sq copy (multi)")
