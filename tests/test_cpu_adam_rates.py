"""The CPU Adam rates the planner and the ZeRO-Offload baseline use come from bench/adam.py's recorded
measurement (socompile/hardware/cpu_adam_measured.json), scaled by each profile's memory bandwidth, not from
a blog ratio (docs/planner.md, "CPU Adam rates")."""
from __future__ import annotations

import dataclasses
import json

import pytest

from test_plan_helpers import options, profile, traced
from socompile.hardware import PROFILES
from socompile.hardware import cpu_adam
from socompile.hardware.cpu_adam import MEASURED, load_measured
from training_helpers import bench_module


def _adam_bench():
    return bench_module("adam")


def test_every_shipped_profile_streams_the_measured_share_of_its_memory_bandwidth():
    for hw in PROFILES.values():
        assert hw.adam_bandwidth == pytest.approx(MEASURED.ours_of_ceiling * hw.host_bandwidth)
    # a profile that does not name its CPU Adam rate gets the same measured share
    assert profile(cpu_adam_bandwidth=0.0).adam_bandwidth == pytest.approx(MEASURED.ours_of_ceiling * 500e9)


def test_the_recorded_rates_say_how_and_when_they_were_measured():
    data = json.loads(cpu_adam.MEASURED_FILE.read_text())
    assert "bench/adam.py" in data["command"] and "--record" in data["command"]
    assert data["measured_at"] and data["machine"] and data["rounds"] >= 5
    assert "DeepSpeedCPUAdam" in data["baseline_kernel"] or "stand-in" in data["baseline_kernel"]
    assert MEASURED.baseline_of_ours == data["baseline_of_ours"]["median"]


def test_zero_offload_adam_runs_at_the_measured_share_of_ours(monkeypatch):
    """Halving the recorded baseline rate doubles the baseline's Adam tasks and leaves ours alone."""
    from socompile.perf import simulate as sim_module
    from socompile.plan.planner import plan_with_details
    d = plan_with_details(traced(bf16=True), profile(), options())

    def adam_seconds(schedule):
        res = sim_module.simulate(d.plan, d.costs, d.cost, schedule)
        return sum(e - s for t, s, e in zip(res.tasks, res.start, res.end) if t.kind == "adam")

    before = adam_seconds("zero-offload"), adam_seconds("superoffload")
    halved = dataclasses.replace(MEASURED, baseline_of_ours=MEASURED.baseline_of_ours / 2)
    monkeypatch.setattr(sim_module, "MEASURED_ADAM", halved)
    after = adam_seconds("zero-offload"), adam_seconds("superoffload")
    assert after[0] == pytest.approx(2 * before[0])
    assert after[1] == pytest.approx(before[1])


def test_a_missing_or_malformed_record_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(RuntimeError, match="bench/adam.py --record"):
        load_measured(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ours_of_ceiling": {"median": 0.9}}))
    with pytest.raises(RuntimeError, match="bench/adam.py --record"):
        load_measured(bad)


def test_bench_record_round_trips_and_caps_ours_at_the_ceiling(tmp_path):
    """bench/adam.py --record writes paired per-round medians; a kernel 'faster than its own loads and
    stores' (noise on a shared box) is read back as the ceiling itself."""
    bench = _adam_bench()
    k = (1 << 20, 1, "fp32")
    alltimes = {(k, "ours in-place"): [1.0, 1.0, 1.0], (k, "ceiling in-place"): [1.1, 1.2, 1.3],
                (k, "torch fused"): [1.25, 1.25, 1.25]}
    path = tmp_path / "rates.json"
    bench.record_rates(path, [k], alltimes, 0.0)
    data = json.loads(path.read_text())
    assert data["ours_of_ceiling"]["median"] == pytest.approx(1.2)
    assert data["baseline_of_ours"]["median"] == pytest.approx(0.8)   # torch fused, named as a stand-in
    assert "stand-in" in data["baseline_kernel"]
    measured = load_measured(path)
    assert measured.ours_of_ceiling == 1.0 and measured.baseline_of_ours == pytest.approx(0.8)
