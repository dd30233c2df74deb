"""A training script's own gradient handling between ``backward()`` and ``step()`` is honoured exactly.

Scripts clip their own gradients (nanoGPT: ``clip_grad_norm_(model.parameters(), grad_clip)``; the HF Trainer:
``max_grad_norm``), unscale them (``GradScaler.unscale_``) or scale them by hand. With offloaded buckets the
compiled backward has already stepped (or speculated) each bucket by then, so socompile must notice the change
at ``step()`` and step again from the gradients as the script left them.

Reference: eager ``torch.optim.AdamW`` after the same call on the same model, seed and data.
Tolerance 1e-6 absolute on parameters (lr 1e-3, 6 steps): both sides run the same AdamW formula in fp32
on the same gradients; the kernel's fused multiply-adds and torch's separate ops round differently in the last
bit of each update (|update| <= lr), and torch's CPU sqrt of the norm is not correctly rounded, so per-step
differences are ~1 ulp of the parameter (~1e-7 for |p| ~ 1); six steps stay well under 1e-6. The same
argument as the module docstring of tests/test_backend_training.py.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import socompile
from socompile.models import build
from training_helpers import assert_same_params, batches, lm_loss


def _clip_norm(max_norm):
    return lambda params: torch.nn.utils.clip_grad_norm_(params, max_norm)


def _clip_value(limit):
    return lambda params: torch.nn.utils.clip_grad_value_(params, limit)


def _scale(factor):
    def scale(params):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
    return scale


SCRIPTS = {"clip_grad_norm_": _clip_norm(0.05), "clip_grad_value_": _clip_value(1e-3),
           "manual mul_": _scale(0.25)}


def _train(script, steps=6, lr=1e-3, max_grad_norm=None, options=None, n_layers=1, accumulate=1,
           opt_kwargs=None):
    torch.manual_seed(0)
    model = build("tiny", n_layers=n_layers)
    ref = build("tiny", n_layers=n_layers)
    ref.load_state_dict(model.state_dict())
    hyper = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=max_grad_norm, grad_accumulation_steps=accumulate,
                          **hyper, **(opt_kwargs or {}))
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(
        compute="eager", **{"bucket_size": "64KB", "gpu_buckets": 0, **(options or {})}))
    norms = []
    data = batches(steps * accumulate)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            lm_loss(cmodel(x), y).backward()
            lm_loss(ref(x), y).backward()
        ours_norm = script(list(model.parameters()))
        ref_norm = script(list(ref.parameters()))
        norms.append((ours_norm, ref_norm))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return model, ref, opt, norms


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_that_changes_gradients_after_backward_trains_as_torch(name):
    model, ref, opt, _ = _train(SCRIPTS[name])
    assert_same_params(model, ref)
    assert opt.stats["script_changed_steps"] == 6


def test_clip_grad_norm_returns_torchs_norm_of_the_offloaded_gradients():
    _, _, _, norms = _train(_clip_norm(0.05))
    for ours, ref in norms:
        # Same gradients, same torch function: the norms agree to fp32 rounding of the backward.
        assert math.isclose(float(ours), float(ref), rel_tol=1e-5), (float(ours), float(ref))
        assert float(ours) > 0


def test_a_script_clip_and_max_grad_norm_clip_once_and_the_warning_says_the_script_won():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ref, opt, _ = _train(_clip_norm(0.05), max_grad_norm=1.0)
    assert_same_params(model, ref)
    said = [str(w.message) for w in caught if "changed the gradients" in str(w.message)]
    assert len(said) == 1 and "max_grad_norm=1.0 is not applied" in said[0], said


def test_a_script_clip_with_accumulation_trains_as_torch():
    model, ref, opt, _ = _train(_clip_norm(0.05), accumulate=2, steps=4)
    assert_same_params(model, ref)


def test_without_a_script_change_nothing_is_redone():
    model, ref, opt, _ = _train(lambda params: None, steps=3)
    assert opt.stats["script_changed_steps"] == 0
    assert_same_params(model, ref)


@pytest.mark.parametrize("max_norm", [math.inf, 1e6], ids=["inf (the Trainer logging its norm)", "not reached"])
@pytest.mark.parametrize("options", [{}, dict(_emulated=True)], ids=["shared master", "separate master"])
def test_a_clip_that_changes_nothing_redoes_nothing_and_returns_torchs_norm(monkeypatch, max_norm, options):
    if options.pop("_emulated", False):
        _emulate(monkeypatch)
    model, ref, opt, norms = _train(_clip_norm(max_norm), steps=3)
    assert opt.stats["script_changed_steps"] == 0
    assert_same_params(model, ref, atol=5e-5)   # FP32_ATOL of tests/test_emulated_training.py: same argument
    for ours, theirs in norms:
        assert math.isclose(float(ours), float(theirs), rel_tol=1e-5), (float(ours), float(theirs))


def test_a_script_change_after_an_inplace_step_that_cannot_be_undone_is_refused_naming_the_fix():
    # Driven as a compiled backward drives it (one bucket, stepped in place: rollback="inverse").
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 16)), torch.nn.Parameter(torch.randn(300))]
    opt = socompile.AdamW(params, lr=1e-3, rollback="inverse", cpu_worker="inline")
    claim = opt.claim([params], early_step=[True], rollback=["inverse"])
    claim.on_grads(0, [0, 1], [torch.randn_like(p) for p in params])
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    with pytest.raises(RuntimeError, match="rollback='pingpong'"):
        opt.step()


# ---------------------------------------------------------------- separate host master (the CUDA path)
from socompile.runtime.emulated_cuda import emulated_device  # noqa: E402


def _emulate(monkeypatch):
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", "0")
    emulated_device(0).hazards.clear()


@pytest.mark.parametrize("name", ["clip_grad_norm_", "clip_grad_value_"])
@pytest.mark.parametrize("options", [dict(weight_mode="stationary"), dict(weight_mode="flow"),
                                     dict(weight_mode="stationary", gpu_buckets=2)],
                         ids=["stationary", "flow", "gpu_buckets"])
def test_on_the_cuda_path_a_script_clip_sees_and_changes_the_gradients_socompile_holds(monkeypatch, name, options):
    _emulate(monkeypatch)
    model, ref, opt, norms = _train(SCRIPTS[name], options=options)
    assert opt.host_master == "separate"
    assert_same_params(model, ref, atol=5e-5)   # FP32_ATOL of tests/test_emulated_training.py: same argument
    assert opt.stats["script_changed_steps"] == 6
    if name == "clip_grad_norm_":
        for ours, theirs in norms:
            assert math.isclose(float(ours), float(theirs), rel_tol=1e-5), (float(ours), float(theirs))


class _PausingSource(torch.Tensor):
    """A source tensor whose ``copy_`` into the gradient buffer holds the writer right after the copy, until
    ``resume`` is set (or 0.5 s): the moment between the CPU worker's ZeRO write and its re-read of the version
    counter."""
    copied: "threading.Event"
    resume: "threading.Event"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_:
            cls.copied.set()
            cls.resume.wait(0.5)
        return out


def test_the_workers_own_zero_write_is_never_taken_for_a_script_change():
    """ZeRO: the CPU worker writes the reduced shard into the gradient buffer (take_reduced_shard) while step()
    checks, on the training thread, whether the script changed the gradients (version counter). A check that
    falls between the write and its re-read of the counter must not see our own write as the script's (it made
    step() raise "the training script changed the gradients" on one rank, once in ~10 dp2 runs). Held at that
    moment, the check waits for the write to finish and says unchanged; a script's change is still seen."""
    import threading
    from socompile.runtime.flat_bucket import FlatBucket
    params = [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(32))]
    bucket = FlatBucket(0, params)
    for i, p in enumerate(params):
        bucket.receive(i, torch.randn_like(p), accumulate=False)
        p.grad = bucket.view(bucket.grad, i)
    bucket.note_gradients_delivered()
    _PausingSource.copied, _PausingSource.resume = threading.Event(), threading.Event()
    averaged = torch.randn(48).as_subclass(_PausingSource)
    writer = threading.Thread(target=bucket.take_reduced_shard, args=(0, averaged))
    writer.start()
    assert _PausingSource.copied.wait(5.0)
    seen = []
    checker = threading.Thread(target=lambda: seen.append(bucket.script_changed_gradients()))
    checker.start()
    checker.join(0.2)
    _PausingSource.resume.set()
    writer.join(5.0)
    checker.join(5.0)
    assert seen == [False]
    assert torch.equal(bucket.grad[:48], averaged.as_subclass(torch.Tensor))
    params[1].grad.mul_(0.5)        # the script's own change after ours is still seen
    assert bucket.script_changed_gradients()


def test_a_script_change_before_the_workers_zero_write_is_not_hidden_by_it():
    """The script clips after backward while the worker has not yet written the reduced shard: the worker's
    re-read of the version counter must not absorb the script's change (step() must still refuse it under ZeRO)."""
    from socompile.runtime.flat_bucket import FlatBucket
    params = [torch.nn.Parameter(torch.randn(64))]
    bucket = FlatBucket(0, params)
    bucket.receive(0, torch.randn(64), accumulate=False)
    params[0].grad = bucket.view(bucket.grad, 0)
    bucket.note_gradients_delivered()
    torch.nn.utils.clip_grad_norm_(params, 1e-3)
    bucket.take_reduced_shard(0, torch.randn(32))
    assert bucket.script_changed_gradients()
