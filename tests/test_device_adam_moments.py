"""bf16 and int8 moments stepped by torch ops (runtime/device_adam.py ``fused_step``): how a device-stepped bucket
on a CUDA GPU steps them. The emulated device's buckets are host tensors, which the CPU kernel steps, so this
file runs the torch-ops path on host tensors, as a GPU would run it.

Two references. (1) The same operations, written out: torch's fused AdamW on the decoded fp32 moments, then the
stochastic rounding with the bits the CPU kernel draws for the same (bucket, step, element): equal bit for bit,
which pins the seeds and the element offsets of each run. (2) The CPU kernel's step of the same bucket: the two
compute the fp32 step in different operation orders, so they agree within derived bounds (in each test).
"""
from __future__ import annotations

import pytest
import torch

from socompile.runtime.device_adam import fused_step
from socompile.runtime.flat_bucket import FlatBucket
from socompile.runtime.int8_moments import decode, encode_moments, round_bits, round_seed, stochastic_bf16

pytest.importorskip("socompile_ext")

GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
SHAPES = [(37, 5), (3,), (16,), (129,)]   # segments of odd sizes: runs and blocks that end mid-block


def _bucket(moment_dtype, seed=0, skip=None):
    """A bucket of SHAPES with gradients (parameter ``skip`` without one: two runs) and a first step's moments."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    bucket = FlatBucket(3, params, moment_dtype=moment_dtype)
    bucket.adopt({})
    for i, p in enumerate(params):
        if i != skip:
            bucket.view(bucket.grad, i).copy_(torch.randn(p.shape, generator=gen))
            bucket.has_grad[i] = True
    return bucket


def _step(bucket, how):
    if how == "torch":
        fused_step(bucket, [GROUP])
    else:
        from socompile.runtime.cpu_adam import step_bucket
        step_bucket(bucket, [GROUP])
    for i, present in enumerate(bucket.has_grad):
        bucket.steps[i] += present


def _written_out(bucket, moment_dtype):
    """Reference (1): the master and the moment buffers after the step, computed run by run here."""
    master, m_buf, v_buf = bucket.master.clone(), bucket.exp_avg.clone(), bucket.exp_avg_sq.clone()
    for start, end, _, step in bucket.runs(bucket.group_of):
        n = end - start
        m_part, v_part = bucket.moment_range(m_buf, slice(start, end)), bucket.moment_range(v_buf, slice(start, end))
        if moment_dtype == "int8":
            m, v = decode(m_part, n, signed=True), decode(v_part, n, signed=False)
        else:
            m, v = m_part.float(), v_part.float()
        torch._fused_adamw_([master[start:end]], [bucket.grad[start:end]], [m], [v], [], [torch.tensor(float(step))],
                            amsgrad=False, lr=GROUP["lr"], beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
                            maximize=False)
        seed = round_seed(bucket.index, step, start)
        if moment_dtype == "int8":
            codes_m, codes_v = encode_moments(m, v, seed)
        else:
            bits = round_bits(seed, 0, n)
            codes_m, codes_v = stochastic_bf16(m, bits), stochastic_bf16(v, bits >> 16)
        m_part.copy_(codes_m)
        v_part.copy_(codes_v)
    return master, m_buf, v_buf


def _raw(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, "int8"])
@pytest.mark.parametrize("skip", [None, 1])
def test_torch_ops_round_moments_with_the_kernels_bits_run_by_run(moment_dtype, skip):
    fmt = "int8" if moment_dtype == "int8" else "bfloat16"
    bucket = _bucket(moment_dtype, skip=skip)
    _step(bucket, "torch")   # a first step: non-zero moments in the buffers
    expected = _written_out(bucket, fmt)
    _step(bucket, "torch")
    assert len(bucket.runs(bucket.group_of)) == (1 if skip is None else 2)
    for got, want in zip((bucket.master, bucket.exp_avg, bucket.exp_avg_sq), expected):
        assert torch.equal(_raw(got), _raw(want))


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, "int8"])
def test_torch_ops_and_the_cpu_kernel_take_the_same_step_within_their_roundings(moment_dtype):
    """One step from the same state (a first kernel step on both: bitwise equal inputs). The fp32 step rounds
    fewer than 8 operations per element on each side, in other orders: the new m and v differ by < 8 ulps
    relative, the weights by 1 ulp of p each side plus < 8 ulps of the update u (measured: the change of p
    beyond its decay). Rounding draws the same bits on both sides, so a stored value differs only where the two
    fp32 values straddle a threshold: by one bf16 ulp (<= 2^-7 of the value), or one int8 code step of the block's
    scale (m: max |m| / 127; v: its square root's, max sqrt(v) / 255; the scales differ by the maxima's < 8 ulps,
    1e-4 covers it)."""
    ours, kernel = _bucket(moment_dtype), _bucket(moment_dtype)
    _step(ours, "kernel")
    _step(kernel, "kernel")
    assert torch.equal(_raw(ours.exp_avg), _raw(kernel.exp_avg))
    before = kernel.master.clone()
    _step(ours, "torch")
    _step(kernel, "kernel")
    update = (kernel.master - before * (1 - GROUP["lr"] * GROUP["weight_decay"])).abs()
    assert torch.all((ours.master - kernel.master).abs() <= 2 ** -23 * (2 * before.abs() + 8 * update))
    for i in range(len(SHAPES)):
        (m_a, v_a), (m_b, v_b) = ours.moment_values(i), kernel.moment_values(i)
        if moment_dtype == "int8":
            assert torch.all((m_a - m_b).abs() <= m_b.abs().max() / 127 * (1 + 1e-4))
            assert torch.all((v_a.sqrt() - v_b.sqrt()).abs() <= v_b.sqrt().max() / 255 * (1 + 1e-4))
        else:
            assert torch.all((m_a - m_b).abs() <= m_b.abs() * 2 ** -7)
            assert torch.all((v_a - v_b).abs() <= v_b.abs() * 2 ** -7)
        assert not torch.equal(m_a, torch.zeros_like(m_a))
