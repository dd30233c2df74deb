"""torch's fused AdamW for device-stepped buckets (runtime/device_adam.py) computes what the socompile kernel
computes: on the CPU here (the fused kernel exists there too), on CUDA in tests/test_runtime_cuda.py.
Tolerance 1e-6 after 5 steps: the two differ only in sqrt rounding (see test_backend_training.py)."""
import copy

import pytest
import torch

from socompile.runtime.cpu_adam import step_bucket
from socompile.runtime.device_adam import fused_step
from socompile.runtime.flat_bucket import FlatBucket


def _bucket(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(100))]
    bucket = FlatBucket(0, params)
    bucket.group_of = [0, 1]
    return bucket


GROUPS = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled=True),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, decoupled=False)]


def test_fused_step_matches_the_socompile_kernel_over_several_steps_with_clipping():
    a, b = _bucket(), _bucket()
    for step in range(5):
        grads = [torch.randn(p.shape) for p in a.params]
        for bucket in (a, b):
            for i, g in enumerate(grads):
                bucket.view(bucket.grad, i).copy_(g)     # the padding between segments stays zero
            bucket.has_grad = [True, True]
        stats_a = step_bucket(a, GROUPS, grad_scale=0.5)
        stats_b = fused_step(b, GROUPS, grad_scale=0.5)
        for bucket in (a, b):
            bucket.steps = [s + 1 for s in bucket.steps]
        assert abs(stats_a[0] - stats_b[0]) <= 1e-6 * stats_a[0]
        assert stats_a[1] is False and stats_b[1] is False
    for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_fused_step_reports_non_finite_gradients():
    bucket = _bucket()
    bucket.grad[3] = float("inf")
    bucket.has_grad = [True, True]
    assert fused_step(bucket, GROUPS)[1] is True



# ------------------------------------------------------------- no host reads where nothing validates
def _count_host_reads(monkeypatch):
    """Counts reads of a tensor's value on the host (float(t), t.item()): on a GPU each one blocks the
    training thread until the device has caught up with everything queued before it."""
    reads = []
    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)

        def counted(t, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(t, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_a_device_step_reads_nothing_on_the_host_until_its_statistics_are_asked_for(monkeypatch):
    # The same code steps GPU-resident buckets on CUDA; here its buffers are host memory (the emulated device
    # steps its buckets with the socompile kernel, so this is where device_adam runs without a GPU).
    bucket = _bucket()
    for i, p in enumerate(bucket.params):
        bucket.view(bucket.grad, i).copy_(torch.randn(p.shape))
    bucket.has_grad = [True, True]
    reads = _count_host_reads(monkeypatch)
    stats = fused_step(bucket, GROUPS, grad_scale=0.5)
    assert reads == []            # was: float(total) and .item() of its finiteness, in every step
    expected = sum(float((bucket.grad[s:e] * 0.5).double().square().sum()) for s, e, _, _ in bucket.runs(bucket.group_of))
    reads.clear()
    assert stats[0] == expected and stats[1] is False   # asked: read once, the same float64 sum as before
    assert reads == ["__float__"]
    assert tuple(stats) == (expected, False) and reads == ["__float__"]   # read once, then kept
