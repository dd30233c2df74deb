"""bench/sim_vs_real.py's machinery: a case compiles, trains, is simulated on the calibrated profile of this
machine and prints its ratio row and the summary line (no timing is asserted: the bench reports the ratios)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys


def _bench():
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "sim_vs_real.py"
    spec = importlib.util.spec_from_file_location("bench_sim_vs_real", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench   # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_one_tiny_case_prints_its_simulated_and_measured_step_and_the_ratio_line(capsys):
    bench = _bench()
    assert bench.main(["--presets", "tiny", "--cases", "flow", "--steps", "2", "--warmup", "1", "--batch", "2",
                       "--seq", "32", "--layers", "1", "--compute", "eager"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    row = next(line for line in lines if line.startswith("tiny") and " flow " in line)
    sim_ms, real_ms, ratio = (float(row.split()[i]) for i in (2, 3, -1))
    assert sim_ms > 0 and real_ms > 0 and abs(ratio - sim_ms / real_ms) < 0.01 + 0.01 * ratio
    summary = re.fullmatch(r"sim/real: min ([0-9.]+) max ([0-9.]+)", lines[-1])
    assert summary and float(summary.group(1)) == float(summary.group(2)) == float(row.split()[-1])
