import dataclasses

import pytest

from test_plan_helpers import options, profile, traced
from socompile.plan.planner import plan_with_details
from socompile.plan.verify import PlanInvariantError, check, verify


@pytest.fixture(scope="module")
def made():
    ir = traced()
    return ir, plan_with_details(ir, profile(), options(gpu_buckets=0))


def _with_buckets(p, buckets):
    return dataclasses.replace(p, buckets=tuple(buckets))


def test_the_planners_own_plan_passes(made):
    ir, d = made
    verify(d.plan, ir, profile(), d.costs, d.cost)


def test_a_bucket_listed_twice_is_rejected(made):
    ir, d = made
    p = _with_buckets(d.plan, [*d.plan.buckets, d.plan.buckets[0]])
    with pytest.raises(PlanInvariantError, match="bucket 0 appears more than once"):
        verify(p, ir)


def test_a_gradient_in_no_bucket_is_rejected(made):
    ir, d = made
    first = d.plan.buckets[0]
    dropped = first.params[0]
    shrunk = dataclasses.replace(first, params=first.params[1:] or first.params,
                                 numel=first.numel - ir.params[dropped].numel)
    problems = check(_with_buckets(d.plan, [shrunk, *d.plan.buckets[1:]]), ir)
    assert any(f"gradient of {dropped} is in no bucket" in m for m in problems) or len(first.params) == 1


def test_a_gradient_in_two_buckets_is_rejected(made):
    ir, d = made
    a, b = d.plan.buckets[0], d.plan.buckets[1]
    doubled = dataclasses.replace(b, params=b.params + (a.params[0],), numel=b.numel + ir.params[a.params[0]].numel)
    with pytest.raises(PlanInvariantError, match=f"gradient of {a.params[0]} is in buckets 0 and 1"):
        verify(_with_buckets(d.plan, [a, doubled, *d.plan.buckets[2:]]), ir)


def test_stepping_a_bucket_before_its_gradient_exists_is_rejected(made):
    ir, d = made
    b = d.plan.buckets[-1]
    early = dataclasses.replace(b, ready_position=0, ready_after=ir.bw_order[0])
    with pytest.raises(PlanInvariantError, match=f"bucket {b.index} is stepped at backward node 0 before"):
        verify(_with_buckets(d.plan, [*d.plan.buckets[:-1], early]), ir)


def test_an_unknown_optimizer_site_is_rejected_as_never_stepped(made):
    ir, d = made
    bad = dataclasses.replace(d.plan.buckets[0], optimizer_site="tpu")
    with pytest.raises(PlanInvariantError, match="never be stepped"):
        verify(_with_buckets(d.plan, [bad, *d.plan.buckets[1:]]), ir)


def test_a_flow_bucket_without_prefetch_is_rejected(made):
    ir, d = made
    # Distance 0 is valid (fetched at its first use, the transfer exposed); a negative one is not.
    bad = dataclasses.replace(d.plan.buckets[0], weight_mode="flow", prefetch_distance=-1)
    with pytest.raises(PlanInvariantError, match="would not be present at first use"):
        verify(_with_buckets(d.plan, [bad, *d.plan.buckets[1:]]), ir)


def test_a_flow_bucket_used_at_both_ends_of_the_forward_stays_fetched_in_between(made):
    ir, d = made
    # One streamed bucket holds a first-layer and a last-layer weight. The runtime gives every fetch its own
    # buffer (no ring to overrun), so the plan is valid and the schedule keeps that bucket live throughout.
    from socompile.plan.flow_schedule import flow_schedule
    buckets = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1) for b in d.plan.buckets]
    first, last = buckets[-2], buckets[2]
    merged = dataclasses.replace(first, params=first.params + last.params, numel=first.numel + last.numel)
    kept = [b for b in buckets if b not in (first, last)] + [merged]
    kept = [dataclasses.replace(b, index=i) for i, b in enumerate(kept)]
    plan = _with_buckets(d.plan, kept)
    assert not [m for m in check(plan, ir) if "flow" in m or "prefetch" in m]
    fw = flow_schedule(plan, ir)["fw"]
    merged_index = kept[-1].index
    fetched = next(i for i, a in enumerate(fw) if a.kind == "wait" and a.bucket == merged_index)
    released = next(i for i, a in enumerate(fw) if a.kind == "release" and a.bucket == merged_index)
    assert sum(a.kind == "prefetch" for a in fw[fetched:released]) >= 2   # others come and go meanwhile


def test_a_predicted_peak_over_budget_is_rejected(made):
    ir, d = made
    pred = dict(d.plan.predicted)
    pred["device_peak_bytes"] = pred["device_budget_bytes"] + 1
    with pytest.raises(PlanInvariantError, match="exceeds the budget"):
        verify(dataclasses.replace(d.plan, predicted=tuple(pred.items())), ir)
