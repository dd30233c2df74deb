"""bench/sim_vs_real.py's machinery: a case compiles, trains, is simulated on the calibrated profile of this
machine and prints its ratio row and the summary line (no timing is asserted: the bench reports the ratios)."""
from __future__ import annotations

import pathlib
import re

from training_helpers import bench_module


def _bench():
    return bench_module("sim_vs_real")


def test_one_tiny_case_prints_its_simulated_and_measured_step_and_the_ratio_lines(capsys):
    bench = _bench()
    assert bench.main(["--presets", "tiny", "--cases", "flow", "--steps", "2", "--warmup", "1", "--batch", "2",
                       "--seq", "32", "--layers", "1", "--compute", "eager"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    row = next(line for line in lines if line.startswith("tiny") and " flow " in line)
    sim_ms, fast_ms, median_ms = (float(row.split()[i]) for i in (2, 3, 4))
    by_median, ratio = float(row.split()[-2]), float(row.split()[-1])
    # printed to 2 decimals from unrounded times: 0.01 for the rounding, and relative 1% for the ms columns'
    assert sim_ms > 0 and 0 < fast_ms <= median_ms and abs(ratio - sim_ms / fast_ms) < 0.01 + 0.01 * ratio
    assert abs(by_median - sim_ms / median_ms) < 0.01 + 0.01 * by_median
    medians = re.fullmatch(r"# sim/median step: min ([0-9.]+) max ([0-9.]+)", lines[-2])
    assert medians and float(medians.group(1)) == float(medians.group(2)) == by_median
    summary = re.fullmatch(r"sim/real: min ([0-9.]+) max ([0-9.]+)", lines[-1])
    assert summary and float(summary.group(1)) == float(summary.group(2)) == ratio
    assert any(line.startswith("# profile:") and "per flow fetch" in line for line in lines)   # per-case calibration


def test_the_loss_is_compiled_into_the_graph_the_simulator_replays():
    """WithLMLoss: the compiled graph returns the scalar loss (the simulator charges its nodes)."""
    import torch
    bench = _bench()
    from socompile.hardware.profiles import PROFILES, save_profile
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        target = str(save_profile(PROFILES["gh200"], pathlib.Path(tmp) / "gh200.json"))
        cmodel, opt, backend = bench.compile_case(bench.CASES[0], "tiny", target, "eager", layers=1)
        x = torch.randint(0, 256, (2, 16))
        loss = cmodel(x, x)
        assert loss.dim() == 0
        loss.backward()
        fw = backend.compiled[0].forward_graph
        assert any("nll_loss" in str(n.target) for n in fw.graph.nodes)
    torch._dynamo.reset()


def test_the_per_op_tool_times_each_op_of_one_step_against_the_simulators_nodes(capsys, tmp_path):
    """bench/sim_vs_real_ops.py: one step's aten ops, timed per op class, beside the simulator's nodes. Every
    matmul of the step is a node of the compiled graphs (the optimizer's kernel is not aten), so the measured
    and simulated matmul counts are equal; the last line gives the step, the ops' share and the simulation."""
    from socompile.hardware.profiles import PROFILES, save_profile
    tool = bench_module("sim_vs_real_ops")
    import dataclasses
    # no calibration (a fast smoke test), but CPU-like rates: a step of milliseconds, as the tool prints them
    cpu_like = dataclasses.replace(PROFILES["gh200"], device_is_host=True, device_op_latency=5e-6,
                                   device_bf16_flops=1e11, device_bandwidth=3e10)
    target = str(save_profile(cpu_like, tmp_path / "cpu-like.json"))
    assert tool.main(["--batch", "2", "--seq", "32", "--layers", "1", "--warmup", "1", "--target", target]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    mm = next(line.split() for line in lines if line.startswith("aten.mm "))
    assert int(mm[1]) == int(mm[3]) > 0 and float(mm[2]) > 0
    total = re.fullmatch(r"# step ([0-9.]+) ms on the thread clock, of which ops ([0-9.]+) ms \(\d+ calls\); "
                         r"simulated nodes [0-9.]+ ms, simulated step ([0-9.]+) ms", lines[-1])
    assert total and 0 < float(total.group(2)) <= float(total.group(1)) and float(total.group(3)) > 0
