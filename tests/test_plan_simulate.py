import pytest

from test_plan_helpers import options, profile, traced
from socompile.plan.planner import plan_with_details
from socompile.hardware.cpu_adam import MEASURED
from socompile.perf.simulate import Task, replay, simulate


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


def test_zero_offload_runs_deepspeeds_cpu_passes_back_to_back_after_backward():
    """DeepSpeed's step (stage 1/2, offload_optimizer=cpu): unscale_and_clip_grads (a mul_ over the fp32
    gradients), CPU Adam, the cast of the updated weights in the cross-device copy_, each one OpenMP pass over
    all cores: one CPU lane at the whole bandwidth, no idle time between the passes (the K worker lanes of the
    superoffload schedule left the lanes idle between passes that depend on each other); the uploads end it."""
    d = _details()
    z = d.zero_offload
    cpu = [(t, s, e) for t, s, e in zip(z.tasks, z.start, z.end) if t.lane.startswith("cpu")]
    assert {t.lane for t, _, _ in cpu} == {"cpu0"} and z.cpu_lanes == 1
    kinds = [t.name.split(" b")[0] for t, _, _ in cpu]
    n = sum(1 for b in d.plan.buckets)
    assert kinds == ["unscale g", "adam", "cast p"] * n
    assert cpu[0][1] >= z.backward_end
    grads_in = {int(t.name.rsplit("b", 1)[1]): e for t, _, e in zip(z.tasks, z.start, z.end)
                if t.name.startswith("grads b")}
    for (_, _, prev_e), (t, s, _) in zip(cpu, cpu[1:]):   # back to back, unless a gradient is still crossing
        wait = grads_in[int(t.name.rsplit("b", 1)[1])] if t.name.startswith("unscale") else 0.0
        assert s == pytest.approx(max(prev_e, wait), abs=1e-12)
    busy = sum(e - s for _, s, e in cpu)
    assert busy == pytest.approx(sum(d.cost.cpu_cast_time(b.numel, 4, 4) + d.cost.cpu_cast_time(b.numel)
                                     + d.cost.cpu_adam_time(b.numel, 4, False, MEASURED.baseline_of_ours)
                                     for b in d.plan.buckets))
    last_upload = max(e for t, _, e in zip(z.tasks, z.start, z.end) if t.name.startswith("upload"))
    assert z.step_time == last_upload > cpu[-1][2]


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


def test_the_simulated_transfers_move_the_bytes_of_the_plans_transfer_list():
    """One list for the simulator and the runtime (plan/transfers.py): the simulated step's gradient copies,
    uploads, flow fetches and activation copies move, per purpose, what per_step_traffic says a step moves
    (the runtime's opt.traffic() is tested equal to the same sums in tests/test_emulated_training.py)."""
    from socompile.plan.transfers import per_step_traffic
    ir = traced(bf16=True)
    # every kind of bucket in one plan: flow, stationary cast on the device, GPU-stepped; offloaded activations
    d = plan_with_details(ir, profile(), options(gpu_buckets=1, weight_mode="flow:0,2", prefetch_distance=1,
                                                 cast_site="device", activations="offload"))
    assert {(b.weight_mode, b.optimizer_site) for b in d.plan.buckets} >= {("flow", "cpu"), ("stationary", "cpu")}
    purpose = {"grads": "gradients", "upload": "weight upload", "prefetch": "flow fetch", "act out":
               "activation offload", "act in": "activation fetch"}
    simulated: dict[str, float] = {}
    for t in d.simulation.tasks:
        if t.kind == "transfer":
            name = next(p for n, p in purpose.items() if t.name.startswith(n) or f" {n} " in t.name)
            simulated[name] = simulated.get(name, 0) + t.nbytes
    planned: dict[str, int] = {}
    for (_, _, name), nbytes in per_step_traffic(d.plan, ir, layers=d.costs.layers).items():
        planned[name] = planned.get(name, 0) + nbytes
    assert simulated == pytest.approx(planned, rel=1e-12) and "gradients" in planned
    assert ("weight upload" in planned) == any(b.weight_mode == "stationary" and b.optimizer_site == "cpu"
                                               for b in d.plan.buckets)
