"""Speculation-then-validation: fault injection at the runtime level (fast, hundreds of cases) and end to end.

The runtime-level harness drives socompile.AdamW exactly as a compiled backward does (``GraphClaim.on_grads``
per bucket, in backward order) with gradients we choose, so NaN/Inf can land in any bucket at any step and
clipping can be made to trigger at any bucket.

Tolerances: speculative vs non-speculative runs of the same kernel must be **bitwise** equal (a ping-pong
rollback restores the exact bits; the norm is summed in the same order either way). Against eager torch
(clip_grad_norm_ + skip-on-non-finite + AdamW) parameters agree to 1e-6: torch sums the norm in fp32 and
its CPU sqrt is not correctly rounded, so values differ in the last bits.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import socompile
from socompile.models import build
from training_helpers import assert_same_params, batches, lm_loss

SHAPES = [(64, 16), (300,), (33, 7), (128,), (17, 17), (5,)]   # 6 parameters, sizes off the vector width
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Harness:
    """An optimizer whose buckets are fed as a compiled backward would feed them."""

    def __init__(self, speculate: bool, max_grad_norm, accumulate: int = 1, rollback: str = "pingpong",
                 predict: bool = False, cpu_worker: str = "thread"):
        gen = torch.Generator().manual_seed(1234)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        self.opt = socompile.AdamW(self.params, max_grad_norm=max_grad_norm, grad_accumulation_steps=accumulate,
                                   bucket_size="1KB", rollback=rollback, predict_clipping=predict,
                                   cpu_worker=cpu_worker, **HYPER)
        # Backward order: last parameters first, two per bucket.
        order = list(reversed(self.params))
        self.bucket_params = [order[i:i + 2] for i in range(0, len(order), 2)]
        self.claim = self.opt.claim(self.bucket_params, early_step=[speculate] * len(self.bucket_params))

    def backward(self, grads: dict[int, torch.Tensor]) -> None:
        for b, params in enumerate(self.bucket_params):
            self.claim.on_grads(b, list(range(len(params))), [grads[id(p)] for p in params])

    def snapshot(self):
        state = [self.opt.state[p] for p in self.params]
        return ([p.detach().clone() for p in self.params],
                [s.get("exp_avg", torch.zeros(0)).clone() for s in state],
                [s.get("exp_avg_sq", torch.zeros(0)).clone() for s in state],
                [float(s["step"]) if "step" in s else 0.0 for s in state])


def make_grads(h: Harness, seed: int, poison=None, scale: float = 1.0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = {id(p): torch.randn(p.shape, generator=gen) * scale for p in h.params}
    if poison is not None:
        bucket, value = poison
        target = h.bucket_params[bucket][0]
        grads[id(target)].view(-1)[seed % target.numel()] = value
    return grads


def run(h: Harness, plan: list[dict]) -> list[tuple[bool, bool]]:
    outcomes = []
    for step, spec in enumerate(plan):
        for micro in range(h.opt.grad_accumulation_steps):
            h.backward(make_grads(h, 100 * step + micro, spec.get("poison") if micro == 0 else None,
                                  spec.get("scale", 1.0)))
        h.opt.step()
        h.opt.zero_grad()
        outcomes.append((h.opt.last_step_skipped, h.opt.last_step_clipped))
    return outcomes


def assert_bitwise(a: Harness, b: Harness) -> None:
    for xs, ys in zip(a.snapshot(), b.snapshot()):
        for x, y in zip(xs, ys):
            if isinstance(x, float):
                assert x == y
            else:
                assert torch.equal(x, y) or (torch.isnan(x).any() and torch.equal(x.nan_to_num(), y.nan_to_num()))


step_plans = st.lists(st.fixed_dictionaries({
    "poison": st.one_of(st.none(), st.tuples(st.integers(0, 2), st.sampled_from([math.nan, math.inf, -math.inf]))),
    "scale": st.sampled_from([0.01, 0.5, 1.0, 3.0]),
}), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=step_plans, max_norm=st.sampled_from([None, 0.5, 5.0, 14.0, 40.0, 1e9]),
       accumulate=st.sampled_from([1, 4]), worker=st.sampled_from(["thread", "inline"]))
def test_speculation_is_bitwise_equal_to_no_speculation(plan, max_norm, accumulate, worker):
    spec = Harness(speculate=True, max_grad_norm=max_norm, accumulate=accumulate, cpu_worker=worker)
    plain = Harness(speculate=False, max_grad_norm=max_norm, accumulate=accumulate)
    assert run(spec, plan) == run(plain, plan)
    assert_bitwise(spec, plain)


def torch_reference(plan: list[dict], max_norm, accumulate: int = 1):
    """Eager reference: accumulate, clip_grad_norm_, skip if the norm is not finite, else AdamW.step()."""
    h = Harness(speculate=False, max_grad_norm=None)   # only for its parameters and gradient recipe
    params = [torch.nn.Parameter(p.detach().clone()) for p in h.params]
    opt = torch.optim.AdamW(params, **HYPER)
    for step, spec in enumerate(plan):
        for micro in range(accumulate):
            grads = make_grads(h, 100 * step + micro, spec.get("poison") if micro == 0 else None,
                               spec.get("scale", 1.0))
            for p, q in zip(params, h.params):
                g = grads[id(q)]
                p.grad = g.clone() if p.grad is None else p.grad + g
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm else torch.tensor(0.0)
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
    return params


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=step_plans, max_norm=st.sampled_from([0.5, 5.0, 14.0, 1e9]), accumulate=st.sampled_from([1, 4]))
def test_speculation_matches_eager_torch_clip_skip_adamw(plan, max_norm, accumulate):
    spec = Harness(speculate=True, max_grad_norm=max_norm, accumulate=accumulate)
    run(spec, plan)
    for ours, ref in zip(spec.params, torch_reference(plan, max_norm, accumulate)):
        torch.testing.assert_close(ours.detach(), ref.detach(), atol=1e-6, rtol=1e-6)


def cumulative_norms(h: Harness, seed: int) -> list[float]:
    grads = make_grads(h, seed)
    total, out = 0.0, []
    for params in h.bucket_params:
        total += sum(float(grads[id(p)].double().pow(2).sum()) for p in params)
        out.append(math.sqrt(total))
    return out


@pytest.mark.parametrize("crossing", [0, 1, 2], ids=["first-bucket", "middle-bucket", "last-bucket"])
def test_clipping_that_triggers_at_a_given_bucket_stops_speculation_there(crossing):
    probe = Harness(speculate=True, max_grad_norm=None)
    norms = cumulative_norms(probe, seed=0)
    below = norms[crossing - 1] if crossing else 0.0
    max_norm = (below + norms[crossing]) / 2   # the running norm passes it at bucket `crossing`
    spec = Harness(speculate=True, max_grad_norm=max_norm)
    plain = Harness(speculate=False, max_grad_norm=max_norm)
    run(spec, [{}])
    run(plain, [{}])
    stats = spec.opt.stats
    assert spec.opt.last_step_clipped
    assert stats["speculated"] == crossing + 1        # up to and including the bucket that crossed
    assert stats["held"] == len(spec.bucket_params) - crossing - 1
    assert stats["rolled_back"] == stats["redone"] == crossing + 1
    assert_bitwise(spec, plain)


@pytest.mark.parametrize("where", ["below", "at", "above"])
def test_norm_just_below_at_and_above_the_threshold(where):
    probe = Harness(speculate=True, max_grad_norm=None)
    norm = cumulative_norms(probe, seed=0)[-1]
    # torch clips iff max_norm / (norm + 1e-6) < 1.
    max_norm = {"below": norm * (1 + 1e-4), "at": norm, "above": norm * (1 - 1e-4)}[where]
    spec = Harness(speculate=True, max_grad_norm=max_norm)
    plain = Harness(speculate=False, max_grad_norm=max_norm)
    run(spec, [{}])
    run(plain, [{}])
    assert spec.opt.last_step_clipped == (where != "below")
    assert spec.opt.stats["committed"] == (len(spec.bucket_params) if where == "below" else 0)
    assert_bitwise(spec, plain)


def test_non_finite_gradient_skips_the_step_and_changes_nothing():
    h = Harness(speculate=True, max_grad_norm=1e9)
    run(h, [{}])
    before = h.snapshot()
    outcome = run(h, [{"poison": (2, math.nan)}])
    assert outcome == [(True, False)]
    for xs, ys in zip(before, h.snapshot()):
        for x, y in zip(xs, ys):
            assert x == y if isinstance(x, float) else torch.equal(x, y)


def test_each_validated_step_logs_its_outcome_and_the_speculation_counters(caplog):
    import logging
    h = Harness(speculate=True, max_grad_norm=0.5)
    with caplog.at_level(logging.DEBUG, logger="socompile"):
        run(h, [{}, {"poison": (0, math.nan)}])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("socompile step")]
    assert len(lines) == 2 and "clipped" in lines[0] and "skipped" in lines[1]
    assert "'rolled_back'" in lines[1]


def test_inverse_rollback_stays_within_its_error_bound():
    # The algebraic inverse recomputes the previous state in double and rounds it to fp32; after undoing and
    # redoing, values can be off by a few ulp (v is clamped at 0). Bound: 1e-6 absolute on O(1) weights.
    spec = Harness(speculate=True, max_grad_norm=5.0, rollback="inverse")
    plain = Harness(speculate=False, max_grad_norm=5.0)
    plan = [{"scale": 3.0}, {}, {"poison": (1, math.inf)}, {"scale": 3.0}]
    assert run(spec, plan) == run(plain, plan)
    assert spec.opt.stats["rolled_back"] > 0
    for xs, ys in zip(spec.snapshot()[:3], plain.snapshot()[:3]):
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_predicted_clipping_holds_speculation_after_clipped_steps():
    h = Harness(speculate=True, max_grad_norm=0.5, predict=True)
    run(h, [{}, {}, {}])
    assert h.opt.stats["clipped_steps"] == 3
    # Step 1 speculated one bucket (then clipping was certain); steps 2 and 3 were predicted and held.
    assert h.opt.stats["speculated"] == 1
    assert h.opt.stats["held"] == 3 * len(h.bucket_params) - 1


def test_speculation_overlaps_backward_with_clipping_on():
    torch.manual_seed(0)
    model = build("tiny", n_layers=4)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=1e6, cpu_worker="thread", **HYPER)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", bucket_size="256KB",
                                                                 gpu_buckets=0))
    for x, y in batches(2):
        opt.events.clear()
        lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    events = opt.events.events()
    last = max(e.bucket for e in events if e.kind == "grads_ready")
    assert last >= 2
    first_step = next(e.t_ns for e in events if e.kind == "step_start" and e.bucket == 0)
    last_grads = next(e.t_ns for e in events if e.kind == "grads_ready" and e.bucket == last)
    assert first_step < last_grads   # bucket 0 was being stepped while backward still ran
    assert opt.stats["committed"] == 2 * (last + 1) and opt.stats["rolled_back"] == 0


def test_end_to_end_clipping_and_injected_overflow_match_torch():
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    ref = build("tiny", n_layers=1)
    ref.load_state_dict(model.state_dict())
    hyper = {**HYPER, "lr": 1e-3}   # the tolerance argument of training_helpers assumes lr 1e-3
    opt = socompile.AdamW(model.parameters(), max_grad_norm=0.5, **hyper)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", bucket_size="64KB",
                                                                 gpu_buckets=0))
    for step, (x, y) in enumerate(batches(6)):
        poison = torch.tensor(math.inf if step == 3 else 1.0)   # step 3 overflows
        (lm_loss(cmodel(x), y) * poison).backward()
        (lm_loss(ref(x), y) * poison).backward()
        opt.step()
        opt.zero_grad()
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)):
            ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_step_skipped == (step == 3)
    assert opt.stats["skipped_steps"] == 1 and opt.stats["clipped_steps"] >= 1
    assert_same_params(model, ref)


@pytest.mark.parametrize("max_grad_norm", [None, 1e-3, 1e6], ids=["no validation", "clipping", "not clipping"])
def test_stats_count_every_step_validated_or_not(max_grad_norm):
    # Without validation the counters used to stay 0 (only validation ended a step in the statistics).
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 16)), torch.nn.Parameter(torch.randn(300))]
    opt = socompile.AdamW(params, lr=1e-3, max_grad_norm=max_grad_norm)
    for _ in range(8):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    assert opt.stats["steps"] == 8
    assert opt.stats["clipped_steps"] == (8 if max_grad_norm == 1e-3 else 0)
    assert opt.stats["skipped_steps"] == 0
