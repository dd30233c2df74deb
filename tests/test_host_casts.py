"""No host-side fp32 -> bf16 pass beside the kernel's: the kernel writes the bf16 copy of the master in the same
pass on every path (in place, into the ping-pong spare, speculative, the redo after a clip, the commit).

A separate host master with bf16 weights and the cast on the host (the CUDA path, emulated) needs the bf16 copy
of each bucket's new master for the upload (stationary) or the next fetch (flow). The CPU Adam kernel can write
it in the pass that updates the master (2 B/param written); a separate torch copy reads the fp32 master again
(4 B/param) and writes 2 more, every step, the pass the simulator does not charge. Here every Python-level cast of
a whole bucket's fp32 master into bf16 is counted while training (``Tensor.copy_`` / ``Tensor.to`` from any
thread: the runtime's casts are Python calls; the compiled graph's own ops are not counted, and have none of a
bucket's size). The first step makes each bf16 stage (one cast each, by design); after it, none.
"""
from __future__ import annotations

import pytest
import torch

import socompile
from socompile.models import build
from socompile.runtime.emulated_cuda import emulated_device
from training_helpers import batches, lm_loss

HYP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class BucketCasts:
    """Counts host casts of a tensor of a bucket's size from fp32 into bf16 (``copy_`` and ``to``)."""

    def __init__(self, monkeypatch, sizes: set[int]):
        self.count, self.sizes = 0, sizes
        copy, to = torch.Tensor.copy_, torch.Tensor.to

        def counted_copy(dst, src, non_blocking=False):
            if dst.dtype == torch.bfloat16 and src.dtype == torch.float32 and src.numel() in self.sizes:
                self.count += 1
            return copy(dst, src, non_blocking=non_blocking)

        def counted_to(t, *args, **kwargs):
            out = to(t, *args, **kwargs)
            if t.dtype == torch.float32 and out.dtype == torch.bfloat16 and t.numel() in self.sizes:
                self.count += 1
            return out
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        monkeypatch.setattr(torch.Tensor, "to", counted_to)


CASES = {
    "stationary": dict(options=dict(weight_mode="stationary")),
    "flow": dict(options=dict(weight_mode="flow", prefetch_distance=1)),
    "clipped (redo)": dict(options=dict(weight_mode="stationary"), max_grad_norm=1e-3),
    "clip not reached (commit)": dict(options=dict(weight_mode="stationary"), max_grad_norm=1e6),
    "flow clipped (redo)": dict(options=dict(weight_mode="flow", prefetch_distance=1), max_grad_norm=1e-3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bf16_step_has_no_host_cast_pass_beside_the_kernels(monkeypatch, case):
    spec = CASES[case]
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", "0")
    emulated_device(0).hazards.clear()
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(torch.bfloat16)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=spec.get("max_grad_norm"), **HYP)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(
        {"compute": "eager", "gpu_buckets": 0, "bucket_size": "64KB", "cast_site": "cpu", **spec["options"]}))
    data = batches(4)

    def step(x, y):
        lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    step(*data[0])                       # the first step makes the bf16 stages
    opt.wait_uploads()                   # its CPU jobs included (step() may return before they end)
    buckets = [b for b in opt.buckets if b.site == "cpu"]
    assert buckets and all(b.weights is not None and b.weights.dtype == torch.bfloat16 for b in buckets)
    casts = BucketCasts(monkeypatch, {b.numel for b in buckets})
    for x, y in data[1:]:
        step(x, y)
    assert casts.count == 0, f"{casts.count} host casts of a bucket's master beside the kernel's in 3 steps"
    if spec.get("max_grad_norm") == 1e-3:
        assert opt.stats["redone"] > 0   # the redo path ran (its clip is reached on every step)
    opt.wait_uploads()   # step() may return before the last CPU jobs (their first reader waits): read after them
    for b in buckets:   # what crosses (the upload's or the fetch's source) is the bf16 stage, equal to the master
        crossing = b.link_source(torch.bfloat16)
        assert crossing.dtype == torch.bfloat16, b.index
        assert torch.equal(crossing, b.master.to(torch.bfloat16)), b.index
