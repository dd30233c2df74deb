"""``opt.step()`` returns before the CPU steps it need not wait for, and the next forward overlaps them.

Without validation (no ``max_grad_norm``, no ``skip_nonfinite``), a CPU-stepped bucket's step is final as its
job runs (the ping-pong spare, swapped in by the job, which then uploads). ``step()`` steps the GPU-resident
buckets and returns; each CPU bucket's first reader in the next forward (``socompile::wait_upload``) waits for
that bucket's job only. So the first layers (GPU-stepped: their gradients come last) run their forward while the
later layers' CPU steps finish: the overlap SuperOffload's schedule is built on.

The emulated device (the CUDA treatment on the CPU: separate host master, worker thread) runs it; every CPU job
sleeps first (``slow_jobs``), so that each job is surely still queued or running when ``step()`` returns.
The reference is the same run with ``step()`` waiting for every job (``_may_return_before`` -> nothing): the
same kernel on the same inputs in the same order, so equal to the bit. That run is held to torch's AdamW by
tests/test_emulated_training.py.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import socompile
from socompile.models import build
from socompile.optim import adamw as adamw_module
from socompile.optim import validation as validation_module
from socompile.runtime.emulated_cuda import emulated_device
from training_helpers import batches, lm_loss

HYP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
JOB_DELAY_S = 0.05   # 10x step()'s own work after backward here (a few ms), so overlap is certain


def slow_jobs(monkeypatch, fail_at_step: int | None = None):
    """Every bucket step run on the CPU worker sleeps JOB_DELAY_S first; with ``fail_at_step`` the worker's
    steps of that training step raise instead (a kernel error)."""
    real = validation_module.step_bucket
    calls = {"step": 0}

    def delayed(bucket, groups, *args, **kwargs):
        if threading.current_thread().name.startswith("socompile-cpu-optimizer"):
            time.sleep(JOB_DELAY_S)
            if fail_at_step is not None and calls["step"] == fail_at_step:
                raise ValueError("kernel refused the bucket (injected)")
        return real(bucket, groups, *args, **kwargs)
    monkeypatch.setattr(validation_module, "step_bucket", delayed)
    return calls


def run(monkeypatch, steps=3, wait_every_job=False, calls=None, weight_mode="stationary", bucket_size="256KB"):
    """Train a 4-layer model with its first bucket stepped on the (emulated) GPU and an LR schedule that changes
    every step; returns (losses, model, opt, backend). ``weight_mode="flow"``: the CPU buckets' weights are
    fetched per use instead of uploaded. 256 KB buckets: ~10 of them, so the delayed jobs add ~0.5 s per step."""
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", "0")
    emulated_device(0).hazards.clear()
    if wait_every_job:
        monkeypatch.setattr(adamw_module.AdamW, "_may_return_before", lambda self, buckets, changed: set())
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("tiny", n_layers=4)
    opt = socompile.AdamW(model.parameters(), **HYP)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    flow = {"prefetch_distance": 1} if weight_mode == "flow" else {}
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 1, "bucket_size": bucket_size,
                                      "weight_mode": weight_mode, **flow})
    cmodel = torch.compile(model, backend=backend)
    losses = []
    for k, (x, y) in enumerate(batches(steps)):
        if calls is not None:
            calls["step"] = k
        loss = lm_loss(cmodel(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        schedule.step()   # the next step's lr: a CPU job still queued must not see it
        opt.zero_grad()
    return losses, model, opt, backend


def test_step_returns_before_the_cpu_steps_and_the_next_forward_runs_beside_them(monkeypatch):
    slow_jobs(monkeypatch)
    _, _, opt, _ = run(monkeypatch)
    cpu = [b.index for b in opt.buckets if b.site == "cpu"]
    assert [b for b in opt.buckets if b.site == "device"] and len(cpu) >= 2   # the shape this test is about
    events = opt.events.events()
    returns = [i for i, e in enumerate(events) if e.kind == "step_return"]
    assert len(returns) == 3
    # The second step: from its step() return to the third step's.
    window = events[returns[1]:returns[2]]
    # the second step's CPU steps that end after its step() returned (before their bucket's next gradients)
    late = [i for i, e in enumerate(window) if e.kind == "step_end" and e.bucket in cpu
            and not any(f.kind == "grads_ready" and f.bucket == e.bucket for f in window[:i])]
    forward = next(i for i, e in enumerate(window) if e.kind == "forward")
    assert late, "no CPU bucket step ended after step() returned: step() waited for them"
    assert forward < late[-1], "the next forward began only after every CPU step had ended"
    # ... and each CPU bucket's first read waited for that bucket's own step: none of its steps ends between
    # that read and the bucket's next gradients
    for b in cpu:
        waited = next(i for i, e in enumerate(window) if e.kind == "fw_wait_upload" and e.bucket == b)
        grads = next(i for i, e in enumerate(window) if e.kind == "grads_ready" and e.bucket == b)
        assert waited < grads and not [e for e in window[waited:grads] if e.kind == "step_end" and e.bucket == b], b


def test_returning_early_trains_to_the_bit_as_waiting_for_every_job(monkeypatch):
    slow_jobs(monkeypatch)
    ours, model, opt, _ = run(monkeypatch)
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    traffic = opt.traffic()
    with opt.materialized_weights():
        weights = [p.detach().clone() for p in model.parameters()]
    ref, ref_model, ref_opt, _ = run(monkeypatch, wait_every_job=True)
    assert ours == ref
    with ref_opt.materialized_weights():
        for p, q in zip(weights, ref_model.parameters()):
            assert torch.equal(p, q)
    for i, p in enumerate(ref_model.parameters()):   # opt.state right after step(): final, as in torch
        for k, v in ref_opt.state[p].items():
            assert torch.equal(state[i][k], v), (i, k)
    assert traffic == ref_opt.traffic()   # an upload queued after step() returned is booked in its own step


def test_without_the_forwards_wait_for_its_bucket_the_next_forward_reads_old_weights(monkeypatch):
    """The wait of ``socompile::wait_upload`` for the bucket's CPU job, removed: the run is not the reference."""
    slow_jobs(monkeypatch)
    with monkeypatch.context() as removed:
        removed.setattr(adamw_module.AdamW, "wait_bucket", lambda self, bucket: None)
        ours, _, _, _ = run(monkeypatch)
    ref, _, _, _ = run(monkeypatch, wait_every_job=True)
    assert ours[0] == ref[0] and ours[1:] != ref[1:]


def test_without_the_hyperparameter_snapshot_a_queued_job_takes_the_next_steps_lr(monkeypatch):
    """A job queued in backward may start after ``step()`` returned and the scheduler moved on: it steps with
    the lr of its own step only because it was given the param groups' values when it was queued."""
    slow_jobs(monkeypatch)
    ref, _, _, _ = run(monkeypatch)
    monkeypatch.setattr(adamw_module, "hyper_snapshot", lambda groups: groups)
    ours, _, _, _ = run(monkeypatch)
    assert ours[0] == ref[0] and ours[1:] != ref[1:]


def test_a_failed_cpu_job_is_raised_at_the_next_read_of_its_bucket_naming_it(monkeypatch):
    calls = slow_jobs(monkeypatch, fail_at_step=1)
    with pytest.raises(ValueError, match="kernel refused the bucket") as raised:
        run(monkeypatch, calls=calls)
    assert any("CPU optimizer job of bucket" in note for note in getattr(raised.value, "__notes__", [])), \
        getattr(raised.value, "__notes__", None)


def test_flowing_buckets_return_early_too_each_fetch_waiting_for_its_bucket_and_without_that_wait_old_weights(
        monkeypatch):
    """Flowing weights have no upload: the next forward's fetch of a CPU bucket (runtime/offload.py prefetch)
    reads its host copy, so the fetch waits for that bucket's job, and ``step()`` returns before the jobs as for
    stationary buckets. The run equals the one that waits for every job to the bit; with the fetch's wait
    removed it reads weights the job has not written yet."""
    slow_jobs(monkeypatch)
    flow = dict(weight_mode="flow")
    ours, model, opt, _ = run(monkeypatch, **flow)
    cpu = [b.index for b in opt.buckets if b.site == "cpu"]
    assert len(cpu) >= 2 and all(b.flow for b in opt.buckets if b.site == "cpu")
    events = opt.events.events()
    returns = [i for i, e in enumerate(events) if e.kind == "step_return"]
    window = events[returns[1]:returns[2]]
    late = [i for i, e in enumerate(window) if e.kind == "step_end" and e.bucket in cpu
            and not any(f.kind == "grads_ready" and f.bucket == e.bucket for f in window[:i])]
    forward = next(i for i, e in enumerate(window) if e.kind == "forward")
    assert late and forward < late[-1], "step() waited for every CPU step, or the forward began after them"
    for b in cpu:   # the bucket's step of the last step ended before its forward fetch
        fetched = next(i for i, e in enumerate(window) if e.kind == "fw_prefetch" and e.bucket == b)
        assert not [e for e in window[fetched:] if e.kind == "step_end" and e.bucket == b
                    and not any(f.kind == "grads_ready" and f.bucket == b for f in window[fetched:])], b
    waits = {site: n["calls"] for (thread, kind, site), n in opt.host_blocks().items()
             if thread == "training" and kind == "CPU worker job"}
    assert waits == {"forward: the bucket's first read": len(cpu)}
    with opt.materialized_weights():
        weights = [p.detach().clone() for p in model.parameters()]
    with monkeypatch.context() as removed:
        removed.setattr(adamw_module.AdamW, "wait_bucket", lambda self, bucket: None)
        unwaited, _, _, _ = run(monkeypatch, **flow)
    ref, ref_model, ref_opt, _ = run(monkeypatch, wait_every_job=True, **flow)   # patches for good: last
    assert ours == ref
    with ref_opt.materialized_weights():
        assert all(torch.equal(p, q) for p, q in zip(weights, ref_model.parameters()))
    assert unwaited[0] == ref[0] and unwaited[1:] != ref[1:]
