"""A training loop of nanoGPT's shape, adopted by swapping the optimizer and compiling with our backend.

What the loop does as nanoGPT's train.py does: its own ``clip_grad_norm_`` between backward and step, a cosine
learning rate with warm-up written into ``param_groups`` every iteration, gradient accumulation by calling
backward several times (loss divided by the micro-steps), an evaluation under ``torch.no_grad()`` with the
compiled model, ``torch.save`` of ``model.state_dict()`` and ``optimizer.state_dict()`` and a resume from them.
The original is the same loop with ``torch.optim.AdamW`` on the eager model.

The diff that adopts socompile is three lines: ``socompile.AdamW`` instead of ``torch.optim.AdamW``
(``grad_accumulation_steps=`` added), and ``torch.compile(model, backend=...)``.

Tolerance: every loss within 1e-5 relative. Both sides compute the forward with the same aten ops on the same
weights (eager compute); the weights differ by the kernel's last-bit rounding of each AdamW update (see
tests/test_script_gradients.py), ~1e-7 after these few steps at lr 1e-3, which moves a cross-entropy of ~5
by far less than 1e-5 relative.
"""
from __future__ import annotations

import math

import pytest
import torch

import socompile
from socompile.models import build
from training_helpers import batches, lm_loss

LR, MIN_LR, WARMUP, ITERS, MICRO, CLIP = 1e-3, 1e-4, 2, 8, 2, 1.0


def _lr(it: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def _loop(model, optimizer, forward, data, start: int, stop: int, eval_batch):
    losses = []
    for it in range(start, stop):
        for group in optimizer.param_groups:
            group["lr"] = _lr(it)
        for micro in range(MICRO):
            x, y = data[it * MICRO + micro]
            loss = lm_loss(forward(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 4 == 3:
            with torch.no_grad():
                losses.append(lm_loss(forward(eval_batch[0]), eval_batch[1]).item())
    return losses


def _original(data, eval_batch, path):
    torch.manual_seed(0)
    model = build("tiny", n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    losses = _loop(model, opt, model, data, 0, ITERS // 2, eval_batch)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    model = build("tiny", n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return losses + _loop(model, opt, model, data, ITERS // 2, ITERS, eval_batch)


def _adopted(data, eval_batch, path, options):
    def fresh():
        model = build("tiny", n_layers=2)
        opt = socompile.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1,
                              grad_accumulation_steps=MICRO)
        return model, opt, torch.compile(model, backend=socompile.SuperOffload(compute="eager", **options))
    torch.manual_seed(0)
    model, opt, cmodel = fresh()
    losses = _loop(model, opt, cmodel, data, 0, ITERS // 2, eval_batch)
    with opt.materialized_weights():
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    model, opt, cmodel = fresh()
    saved = torch.load(path)
    with opt.materialized_weights(pull=True):
        model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return losses + _loop(model, opt, cmodel, data, ITERS // 2, ITERS, eval_batch)


@pytest.mark.parametrize("options", [dict(gpu_buckets=0, bucket_size="64KB"), dict()],
                         ids=["every_bucket_offloaded", "default_plan"])
def test_a_nanogpt_shaped_loop_trains_as_its_original(tmp_path, options):
    data = batches(ITERS * MICRO + 1, seed=3)
    eval_batch = data[-1]
    want = _original(data, eval_batch, tmp_path / "torch.pt")
    got = _adopted(data, eval_batch, tmp_path / "ours.pt", options)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert math.isclose(a, b, rel_tol=1e-5), (i, a, b)
