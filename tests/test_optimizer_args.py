"""socompile.AdamW takes torch.optim.AdamW's arguments with torch's semantics and exception types:
tensor lr (with an LR scheduler), bad betas / lr / eps / weight_decay (also per param group),
copies (deepcopy, pickle), complex parameters and float64 parameters (float64 optimizer state).

Used eagerly: ``opt.step()`` takes the gradients from ``.grad``, through the same buckets and kernels as a
compiled backward. Reference: torch.optim.AdamW on an identical copy of the parameters.
"""
from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import socompile

# fp32: one rounding of the update per step, on weights of magnitude <= |p|max: our kernel and torch's
# for-loop AdamW form the same terms in the same order, but torch's division and sqrt go through other code
# paths, so each step may differ by a couple of ulps of the weight.
FP32_ULP = 2.0 ** -23
FP64_ULP = 2.0 ** -52


def _params(shape=(5, 7), dtype=torch.float32, seed=0, n=2):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g, dtype=dtype)) for _ in range(n)]


def _grads(params, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _train_pair(ours, ref, opt, ref_opt, steps, schedulers=()):
    """Same gradients into both optimizers, ``steps`` times."""
    for step in range(steps):
        for params in (ours, ref):
            for p, g in zip(params, _grads(ours, step)):
                p.grad = g.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for sched in schedulers:
            sched.step()


def _max_err(a, b) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ case 4: tensor lr
def test_a_tensor_lr_with_more_than_one_element_is_a_value_error_as_in_torch():
    with pytest.raises(ValueError):
        torch.optim.AdamW(_params(), lr=torch.tensor([1e-3, 2e-3]))   # torch's behaviour, for reference
    with pytest.raises(ValueError, match="lr as a Tensor must have 1 element"):
        socompile.AdamW(_params(), lr=torch.tensor([1e-3, 2e-3]))


def test_a_one_element_tensor_lr_follows_a_scheduler_that_changes_it_in_place():
    # torch's schedulers fill a tensor lr in place (fill_): the step must read it at step time, not at
    # construction. StepLR halves it every step here, so a stale lr would be 2x-8x off by step 4.
    ours, ref = _params(), _params()
    opt = socompile.AdamW(ours, lr=torch.tensor(0.01), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=torch.tensor(0.01), weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    _train_pair(ours, ref, opt, ref_opt, steps=4, schedulers=scheds)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01 * 0.5 ** 4)
    # 4 steps, each within 2 ulps of the weight (|p| < 5 for these randn weights): see FP32_ULP
    bound = 4 * 2 * FP32_ULP * max(p.abs().max().item() for p in ref)
    assert _max_err(ours, ref) <= bound


# ------------------------------------------------------------------ case 4/5: betas
def test_betas_none_is_a_type_error_naming_the_expected_pair():
    with pytest.raises(TypeError):
        torch.optim.AdamW(_params(), betas=None)
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\)"):
        socompile.AdamW(_params(), betas=None)


def test_betas_with_one_entry_is_an_index_error_as_in_torch_and_a_value_error():
    with pytest.raises(IndexError):
        torch.optim.AdamW(_params(), betas=(0.9,))
    for exc in (IndexError, ValueError):
        with pytest.raises(exc, match="betas must have exactly 2 entries"):
            socompile.AdamW(_params(), betas=(0.9,))


def test_betas_given_as_a_list_or_tensors_are_stored_as_a_float_pair():
    opt = socompile.AdamW(_params(), betas=[torch.tensor(0.8), torch.tensor(0.99)])   # a mix: refused, as torch does
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.8), pytest.approx(0.99))
    assert all(type(b) is float for b in opt.param_groups[0]["betas"])


# ------------------------------------------------------------------ case 5: NaN, strings, param groups
@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
def test_nan_lr_eps_or_weight_decay_is_a_value_error_as_in_torch(name):
    with pytest.raises(ValueError):
        torch.optim.AdamW(_params(), **{name: float("nan")})
    with pytest.raises(ValueError, match=f"nan \\({name} must be a finite number >= 0"):
        socompile.AdamW(_params(), **{name: float("nan")})


def test_a_string_lr_is_a_type_error_that_shows_the_number_to_pass():
    with pytest.raises(TypeError):
        torch.optim.AdamW(_params(), lr="1e-3")
    with pytest.raises(TypeError, match=r"lr must be a float .* got str '1e-3'; pass lr=1e-3"):
        socompile.AdamW(_params(), lr="1e-3")


def test_a_param_groups_own_nan_lr_is_refused_at_construction_and_in_add_param_group():
    with pytest.raises(ValueError, match="param group 1: lr must be a finite number"):
        socompile.AdamW([{"params": _params(seed=1)}, {"params": _params(seed=2), "lr": float("nan")}])
    opt = socompile.AdamW(_params(seed=1))
    with pytest.raises(ValueError, match="param group 1: weight_decay must be a finite number"):
        opt.add_param_group({"params": _params(seed=2), "weight_decay": float("nan")})
    assert len(opt.param_groups) == 1   # nothing half-added


# ------------------------------------------------------------------ case 4: copies
def _public(opt) -> dict:
    return {k: v for k, v in vars(opt).items() if not k.startswith("_")}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_the_public_attributes_and_the_state_and_trains_on_alike(how):
    ours = _params()
    opt = socompile.AdamW(ours, lr=0.01, max_grad_norm=0.5, bucket_size="1MB", grad_accumulation_steps=1,
                          rollback="inverse", cpu_worker="inline")
    ref = _params()
    _train_pair(ours, ref, opt, torch.optim.AdamW(ref, lr=0.01), steps=2)   # some state to carry over
    dup = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert set(_public(dup)) == set(_public(opt))
    for name in ("max_grad_norm", "bucket_size", "grad_accumulation_steps", "host_master", "cpu_worker",
                 "rollback", "skip_nonfinite", "last_grad_norm", "last_step_clipped", "last_step_skipped"):
        assert getattr(dup, name) == getattr(opt, name), name
    assert {k: dup.defaults[k] for k in opt.defaults} == opt.defaults   # (torch's loader adds "differentiable")
    copied = [p for g in dup.param_groups for p in g["params"]]
    assert all(c is not p for c, p in zip(copied, ours))
    for c, p in zip(copied, ours):
        assert torch.equal(c, p)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(dup.state[c][key], opt.state[p][key]), key
    # The copy steps its own parameters exactly as the original steps its own (same kernel, same state).
    _train_pair(ours, copied, opt, dup, steps=2)
    assert _max_err(ours, copied) == 0.0


# ------------------------------------------------------------------ case 4: complex parameters
def _train_against_torch(dtypes, steps=3, clip=None, **kwargs):
    """socompile.AdamW and torch.optim.AdamW (+ clip_grad_norm_) over identical parameters of ``dtypes``."""
    g = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 7, generator=g, dtype=dt)) for dt in dtypes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = socompile.AdamW(ours, lr=0.01, weight_decay=0.1, max_grad_norm=clip, **kwargs)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    for step in range(steps):
        for a, b, grad in zip(ours, ref, _grads(ours, step)):
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        opt.zero_grad()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref, clip)
        ref_opt.step()
        ref_opt.zero_grad()
    return ours, ref, opt, ref_opt


@pytest.mark.parametrize("host_master", ["auto", "separate"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_complex_parameters_train_like_torch_adamw_on_their_real_view(host_master, clip):
    steps = 3
    ours, ref, opt, ref_opt = _train_against_torch([torch.complex64, torch.float32], steps, clip,
                                                   host_master=host_master)
    assert ours[0].dtype == torch.complex64
    # fp32 real views: each step within 2 ulps of the weight (FP32_ULP); with clipping the coefficient is
    # formed from a norm summed in another order (torch: per tensor, complex |z|), a relative 1e-7 on the
    # gradients that Adam's m / sqrt(v) cancels to first order.
    bound = steps * 2 * FP32_ULP * max(p.abs().max().item() for p in ref)
    assert _max_err(ours, ref) <= bound
    state, ref_state = opt.state[ours[0]], ref_opt.state[ref[0]]
    assert state["exp_avg"].dtype == torch.complex64   # torch's layout: complex moments of the real view
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.allclose(state[key], ref_state[key], rtol=4 * steps * FP32_ULP, atol=0.0), key


# ------------------------------------------------------------------ case 5: float64 parameters
@pytest.mark.parametrize("host_master", ["auto", "separate"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_float64_parameters_keep_float64_state_and_equal_torch_float64_adamw(host_master, clip):
    steps = 3
    # Unclipped, one float32 parameter too: a mixed model gets one bucket per dtype (a flat buffer holds one
    # dtype). Not with clipping: torch's clip_grad_norm_ takes the float32 tensor's norm in float32, a
    # relative 1e-7 in the coefficient that a float64 comparison would see.
    dtypes = [torch.float64, torch.float64] + ([torch.float32] if clip is None else [])
    ours, ref, opt, ref_opt = _train_against_torch(dtypes, steps, clip, host_master=host_master)
    slot = opt.param_slots[id(ours[0])][0]
    assert slot.master.dtype == slot.exp_avg.dtype == torch.float64
    assert opt.state[ours[0]]["exp_avg_sq"].dtype == torch.float64
    # float64 buckets are stepped by torch's fused AdamW (the same formula as torch's for-loop, fused):
    # each step within 2 float64 ulps of the weight. The float32 master trained before was 6.4e-7 off.
    bound64 = steps * 2 * FP64_ULP * max(p.abs().max().item() for p in ref[:2])
    assert _max_err(ours[:2], ref[:2]) <= bound64
    if clip is None:
        bound32 = steps * 2 * FP32_ULP * ref[2].abs().max().item()
        assert _max_err(ours[2:], ref[2:]) <= bound32


def test_a_compiled_float64_model_equals_torch_float64_adamw():
    # Compiled: the backward graph hands the gradients over (the plan's "float32" link must not narrow
    # float64 gradients) and, with clipping, the CPU worker speculates into the ping-pong spare.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).double()
    ref = copy.deepcopy(model)
    opt = socompile.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend=socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0}))
    steps = 3
    for _ in range(steps):
        x = torch.randn(8, 16, dtype=torch.float64)
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt.stats["speculated"] > 0
    # the same float64 gradients (same aten ops, eager compute), then steps as in the eager test above
    bound = steps * 2 * FP64_ULP * max(p.abs().max().item() for p in ref.parameters())
    assert _max_err(list(model.parameters()), list(ref.parameters())) <= bound


def test_a_float64_bucket_steps_into_its_spare_and_rolls_back_with_the_inverse():
    from socompile.runtime.cpu_adam import rollback_inplace, step_bucket
    from socompile.runtime.flat_bucket import FlatBucket

    params = _params(dtype=torch.float64)
    bucket = FlatBucket(0, params)
    bucket.group_of = [0, 0]
    groups = [dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True)]
    for i, grad in enumerate(_grads(params, 0)):
        bucket.receive(i, grad, accumulate=False)
    gen = torch.Generator().manual_seed(2)
    for i, p in enumerate(params):   # a state as after some steps (segments only: the padding stays zero)
        # The master holds the weights (a bucket built without adopt() starts at zero, and an error bound
        # relative to a zero master measured the step's own rounding against nothing: it failed for a third
        # of the seeds of the unseeded moments below).
        bucket.view(bucket.master, i).copy_(p.detach())
        bucket.view(bucket.exp_avg, i).uniform_(-0.1, 0.1, generator=gen)
        bucket.view(bucket.exp_avg_sq, i).uniform_(0.0, 0.01, generator=gen)
    bucket.steps = [4, 4]
    before = [t.clone() for t in (bucket.master, bucket.exp_avg, bucket.exp_avg_sq)]
    step_bucket(bucket, groups, grad_scale=0.5, into_spare=True)
    assert all(torch.equal(t, b) for t, b in zip((bucket.master, bucket.exp_avg, bucket.exp_avg_sq), before))
    spare = [t.clone() for t in bucket.spare]
    step_bucket(bucket, groups, grad_scale=0.5)          # in place: bitwise what the spare got
    after = (bucket.master, bucket.exp_avg, bucket.exp_avg_sq)
    assert all(torch.equal(t, s) for t, s in zip(after, spare))
    assert not torch.equal(bucket.master, before[0])
    rollback_inplace(bucket, groups, grad_scale=0.5)
    # The inverse's ~5 float64 roundings plus the step's own (not undone) stay within 8 ulps of the largest
    # value each buffer held.
    for now, then in zip((bucket.master, bucket.exp_avg, bucket.exp_avg_sq), before):
        scale = max(now.abs().max().item(), then.abs().max().item())
        assert (now - then).abs().max().item() <= 8 * FP64_ULP * scale


def test_the_inverse_of_a_float64_step_with_beta1_zero_is_refused_naming_pingpong():
    from socompile.runtime.cpu_adam import rollback_inplace, step_bucket
    from socompile.runtime.flat_bucket import FlatBucket

    params = _params(dtype=torch.float64, n=1)
    bucket = FlatBucket(0, params)
    bucket.group_of = [0]
    groups = [dict(lr=0.01, betas=(0.0, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True)]
    bucket.receive(0, _grads(params, 0)[0], accumulate=False)
    step_bucket(bucket, groups)
    before = bucket.master.clone()
    with pytest.raises(RuntimeError, match="rollback='inverse' cannot undo.*use rollback='pingpong'"):
        rollback_inplace(bucket, groups, grad_scale=1.0)
    assert torch.equal(bucket.master, before)   # nothing half-undone


# torch's own words first: torch's optimizer tests (and scripts) match torch.optim.AdamW's messages.
TORCH_BAD_ARGS = [dict(lr=-1.0), dict(lr=float("nan")), dict(lr=torch.tensor([1e-3, 1e-3])), dict(eps=-1.0),
                  dict(weight_decay=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                  dict(betas=(0.9, torch.tensor(0.99))), dict(betas=(torch.tensor(0.9), 0.99))]


@pytest.mark.parametrize("kwargs", TORCH_BAD_ARGS, ids=[repr(k) for k in TORCH_BAD_ARGS])
def test_a_bad_argument_raises_torchs_type_and_begins_with_torchs_words(kwargs):
    with pytest.raises(Exception) as theirs:
        torch.optim.AdamW(_params(), **kwargs)
    with pytest.raises(Exception) as ours:
        socompile.AdamW(_params(), **kwargs)
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))
    assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
    assert len(str(ours.value)) > len(str(theirs.value))   # then ours: what is wrong and what to pass


def test_betas_none_is_a_type_error_as_in_torch_naming_what_to_pass():
    with pytest.raises(TypeError):
        torch.optim.AdamW(_params(), betas=None)
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\)"):
        socompile.AdamW(_params(), betas=None)


# ------------------------------------------------------------------ gradients are the caller's
@pytest.mark.parametrize("kwargs", [{}, {"max_grad_norm": 1.0}, {"max_grad_norm": 1e-3},
                                    {"weight_decay": 0.1}, {"host_master": "separate"}])
def test_step_never_replaces_or_changes_a_gradient_as_in_torch(kwargs):
    # torch's optimizer suite (test_grads_are_never_inplaced_into) holds every optimizer to this: after any
    # number of steps ``p.grad`` is the very tensor the script set, its version counter unchanged. Clipping
    # scales our copy in the landing buffer, never the script's tensor.
    p = nn.Parameter(torch.randn(5, 1))
    opt = socompile.AdamW([p], **kwargs)
    p.grad = torch.rand_like(p)
    grad, version, values = p.grad, p.grad._version, p.grad.clone()
    for _ in range(5):
        opt.step(lambda: torch.tensor([1.0]))
    assert p.grad is grad
    assert p.grad._version == version
    assert torch.equal(p.grad, values)
