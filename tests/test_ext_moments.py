"""socompile_ext with bf16 moments (docs/kernel.md, "bf16 moments").

The moments are read exactly (a bf16 value is its 16 bits shifted up), the step is the fp32 step of
socx_adam_elem, and each moment is stored stochastically rounded: 16 bits of a fixed integer hash of
(round_seed, element index) added below the kept bits, then truncated. A numpy emulation of exactly that (fp32
ops, which numpy rounds correctly and never fuses; the hash in uint32, which wraps as C's does) must therefore
agree bit for bit, on every path, thread count and store variant.
"""
import numpy as np
import pytest
import torch

import socompile_ext as se
from socompile_ext import _adam
from test_ext_adam import HP, X86_ISAS, assert_bitwise, emulate_fp32, make_state

SIZES = [1, 7, 15, 16, 17, 33, 1000, 16384 + 5, 3 * 16384 + 17]


def round_bits(seed: int, n: int) -> np.ndarray:
    """socx_round_bits(seed, i) for i in [0, n): the same hash in numpy uint32 (wrapping products)."""
    i = np.arange(n, dtype=np.uint32)
    x = np.uint32(seed) + i * np.uint32(0x9E3779B9)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def stochastic_bf16(x: torch.Tensor, r: np.ndarray) -> torch.Tensor:
    """socx_f32_to_bf16_sr: add the low 16 bits of r below the kept bits and truncate; NaN -> 0xFFFF."""
    a = x.numpy()
    u = a.view(np.uint32)
    t = ((u + (r & np.uint32(0xFFFF))) >> np.uint32(16)).astype(np.uint16)
    t[np.isnan(a)] = 0xFFFF
    return torch.from_numpy(t.view(np.int16)).view(torch.bfloat16)


def emulate_bf16_moments(p, g, m16, v16, seed, **hp):
    """The kernel's step with bf16 moments: fp32 arithmetic on the exact fp32 values of the moments, then the
    stochastic rounding of m (low 16 hash bits) and v (high 16)."""
    p1, m1, v1 = emulate_fp32(p, g, m16.float(), v16.float(), **hp)
    r = round_bits(seed, p.numel())
    return p1, stochastic_bf16(m1, r), stochastic_bf16(v1, r >> np.uint32(16))


def bf16_state(n, seed=0, grad_dtype=torch.float32):
    p, g, m, v = make_state(n, seed, grad_dtype)
    return p, g, m.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_bf16_moment_step_equals_its_emulation_bitwise(isa, n, grad_dtype, decoupled):
    with se.kernel_settings(isa=isa):
        p0, g, m0, v0 = bf16_state(n, seed=n, grad_dtype=grad_dtype)
        hp = {**HP, "decoupled": decoupled, "grad_scale": 0.75}
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        p16 = torch.empty(n, dtype=torch.bfloat16)
        se.adam_step(p, g, m, v, **hp, param_bf16_out=p16, round_seed=12345)
        ep, em, ev = emulate_bf16_moments(p0, g, m0, v0, 12345, **hp)
        assert_bitwise(p, ep, "param")
        assert_bitwise(m, em, "exp_avg")
        assert_bitwise(v, ev, "exp_avg_sq")
        assert_bitwise(p16, ep.bfloat16(), "bf16 copy")


@pytest.mark.parametrize("isa", X86_ISAS)
@pytest.mark.parametrize("n", [17, 16384 * 9 + 7])   # the last one streams its outputs (ping-pong)
def test_bf16_moment_ping_pong_equals_in_place_and_keeps_its_inputs(isa, n):
    with se.kernel_settings(isa=isa, store_policy="auto", stream_threshold=1 << 17):
        p0, g, m0, v0 = bf16_state(n, seed=3)
        keep = [t.clone() for t in (p0, m0, v0)]
        outs = [torch.empty_like(t) for t in (p0, m0, v0)]
        se.adam_step(p0, g, m0, v0, **HP, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2],
                     round_seed=9)
        for a, b, what in zip((p0, m0, v0), keep, ("param", "exp_avg", "exp_avg_sq")):
            assert_bitwise(a, b, f"{what} input (a ping-pong step only reads it)")
        p, m, v = (t.clone() for t in keep)
        se.adam_step(p, g, m, v, **HP, round_seed=9)
        for a, b, what in zip((p, m, v), outs, ("param", "exp_avg", "exp_avg_sq")):
            assert_bitwise(a, b, what)
        if n > 1 << 17:
            choice = se.store_choice(p0, g, m0, v0, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2])
            assert choice["state"] or se.isa() == "scalar"   # the streamed variant was the one compared


@pytest.mark.parametrize("isa", X86_ISAS)
def test_bf16_moments_give_the_same_bits_on_one_and_two_threads(isa):
    n = 5 * 16384 + 3
    p0, g, m0, v0 = bf16_state(n, seed=5)
    results = []
    for threads in (1, 2):
        with se.kernel_settings(isa=isa, threads=threads):
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            stats = se.adam_step(p, g, m, v, **HP, round_seed=77)
            results.append((p, m, v, stats))
    for a, b in zip(results[0][:3], results[1][:3]):
        assert_bitwise(a, b, "state")
    assert results[0][3] == results[1][3]


def test_stochastic_rounding_lets_a_bf16_second_moment_decay_as_fp32_does():
    """With beta2 = 0.999 each step changes v by 0.1%, below half an ulp of bf16 (2^-9 relative): rounded to
    nearest, v would never move. Stochastically rounded it decays in expectation: after 100 steps with zero
    gradients the mean over 65536 elements is 0.999^100. Bound: each step adds an independent rounding error of
    at most one ulp (2^-8 below 1, std <= 2^-9), so after 100 steps one element's error has std <= 10 * 2^-9 =
    0.02 and the mean's std is <= 0.02 / 256 = 8e-5; 1e-3 is 12 standard deviations, while staying at 1.0 (what
    round-to-nearest does) is 0.095 off."""
    n = 65536
    p = torch.ones(n)
    g = torch.zeros(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, 101):
        se.adam_step(p, g, m, v, step=step, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                     round_seed=step)
    assert abs(v.float().mean().item() - 0.999 ** 100) < 1e-3
    # the same update rounded to nearest stays where it started (why the kernel does not round to nearest)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(100):
        nearest = (nearest.float() * 0.999).bfloat16()
    assert nearest.float().mean().item() == 1.0


def test_the_seed_changes_the_rounding_and_only_the_rounding():
    p0, g, m0, v0 = bf16_state(4096, seed=1)
    out = []
    for seed in (1, 2):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        se.adam_step(p, g, m, v, **HP, round_seed=seed)
        out.append((p, m, v))
    assert_bitwise(out[0][0], out[1][0], "param (its arithmetic does not depend on the seed)")
    assert not torch.equal(out[0][1].view(torch.int16), out[1][1].view(torch.int16))
    # and they differ by at most one bf16 ulp: rounding up or down
    ulps = (out[0][1].view(torch.int16).int() - out[1][1].view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1


def test_multi_tensor_bf16_moment_step_equals_single_calls_with_their_seeds():
    cases = [bf16_state(n, seed=n) for n in (5, 16384 + 9, 300)]
    seeds = [11, 22, 33]
    single = []
    for (p, g, m, v), seed in zip(cases, seeds):
        p, m, v = p.clone(), m.clone(), v.clone()
        se.adam_step(p, g, m, v, **HP, round_seed=seed)
        single.append((p, m, v))
    ps, ms, vs = ([c[k].clone() for c in cases] for k in (0, 2, 3))
    se.adam_step_multi(ps, [c[1] for c in cases], ms, vs, **HP, round_seeds=seeds)
    for j, (p, m, v) in enumerate(single):
        for a, b in ((ps[j], p), (ms[j], m), (vs[j], v)):
            assert_bitwise(a, b, f"tensor {j}")


def test_bf16_moments_refuse_the_algebraic_inverse_and_mixed_formats():
    p, g, m, v = bf16_state(64)
    with pytest.raises(ValueError, match="bf16 moments.*ping-pong"):
        se.adam_rollback(p, g, m, v, **HP)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype torch.float32; expected torch.bfloat16"):
        se.adam_step(p, g, m, v.float(), **HP)
    with pytest.raises(TypeError, match="exp_avg_out has dtype torch.float32"):
        se.adam_step(p, g, m, v, **HP, exp_avg_out=torch.empty(64))
    with pytest.raises(ValueError, match="round_seed must be an int"):
        se.adam_step(p, g, m, v, **HP, round_seed=-1)


@pytest.mark.parametrize("isa", X86_ISAS)
def test_copy_ceiling_with_bf16_moments_copies_exactly(isa):
    with se.kernel_settings(isa=isa, store_policy="streaming"):
        n = 16384 * 3 + 11
        p, g, m, v = bf16_state(n, seed=4)
        outs = [torch.empty_like(t) for t in (p, m, v)]
        se._copy_ceiling(p, g, m, v, param_out=outs[0], exp_avg_out=outs[1], exp_avg_sq_out=outs[2])
        for a, b in zip(outs, (p, m, v)):
            assert_bitwise(a, b, "ceiling copy")


def test_the_kernel_reads_and_writes_the_bytes_the_ledger_counts_for_bf16_moments():
    """adam_kernel_bytes with 2-byte moments: p 4 + g 4 + m 2 + v 2 read, p 4 + m 2 + v 2 written = 20 B per
    element with fp32 gradients (the ceiling bench/adam.py compares the step with moves exactly these)."""
    from socompile.hardware.cpu_adam import adam_kernel_bytes
    assert sum(adam_kernel_bytes(1, 4, False, moment_bytes=2)) == 20
    assert sum(adam_kernel_bytes(1, 2, True, moment_bytes=2)) == 20
    assert _adam.ENTRIES == 12
