"""Plans are byte-identical to the ones recorded before the code was reshaped (one pipeline, the
performance model and hardware profiles in packages of their own). A difference here is a behaviour change:
record anew (tests/golden_plans/record.py) only when a planner change means it, and say so in the commit."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden_plans"
sys.path.insert(0, str(GOLDEN))
from record import CASES, plan_json  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_is_byte_identical_to_the_recorded_one(case):
    recorded = (GOLDEN / f"{case}.json").read_text()
    assert plan_json(case) + "\n" == recorded


@pytest.mark.slow
def test_paper_table_is_byte_identical_to_the_recorded_one():
    root = GOLDEN.parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "paper.py")], cwd=root, capture_output=True,
                         text=True, check=True, timeout=600).stdout
    assert out == (GOLDEN / "paper.txt").read_text()
