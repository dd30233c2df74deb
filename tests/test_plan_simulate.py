import pytest

from test_plan_helpers import options, profile, traced
from socompile.plan.planner import plan_with_details
from socompile.plan.simulate import Task, replay, simulate


def test_lanes_run_in_issue_order_and_wait_for_dependencies():
    tasks = [Task("a", "gpu", 1.0, (), "compute"), Task("b", "d2h", 2.0, (0,), "transfer"),
             Task("c", "gpu", 1.0, (), "compute"), Task("d", "cpu0", 1.0, (1, 2), "adam")]
    start, end = replay(tasks)
    assert start == [0.0, 1.0, 1.0, 3.0] and end == [1.0, 3.0, 2.0, 4.0]


def _details():
    # A slow link and CPU make the schedules differ clearly on a tiny model.
    ir = traced(bf16=True)
    return plan_with_details(ir, profile(), options())


def test_zero_offload_is_slower_than_the_superoffload_plan_on_gh200():
    d = _details()
    assert d.zero_offload.step_time > d.simulation.step_time


def test_zero_infinity_is_no_faster_than_zero_offload():
    d = _details()
    inf = simulate(d.plan, d.costs, d.cost, "zero-infinity")
    assert inf.step_time >= d.zero_offload.step_time


def test_step_time_is_at_least_the_gpu_compute_and_utilisation_at_most_one():
    d = _details()
    sim = d.simulation
    assert sim.step_time >= d.costs.fw_time + d.costs.bw_time - 1e-12
    assert 0 < sim.gpu_utilisation <= 1.0 and 0 < sim.mfu <= 1.0


def test_every_cpu_bucket_is_stepped_once_in_the_replay():
    d = _details()
    cpu = [b.index for b in d.plan.buckets if b.optimizer_site == "cpu"]
    names = [t.name for t in d.simulation.tasks if t.kind == "adam"]
    assert sorted(int(n.rsplit("b", 1)[1]) for n in names) == sorted(b.index for b in d.plan.buckets)
    assert len(names) == len(d.plan.buckets) and len(cpu) <= len(names)


def test_unknown_schedule_is_rejected():
    d = _details()
    with pytest.raises(ValueError, match="schedule"):
        simulate(d.plan, d.costs, d.cost, "zero-7")
