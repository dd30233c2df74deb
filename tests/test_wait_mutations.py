"""Mutation tests of the waits between the streams and threads of the CUDA runtime: each wait is removed from a
copy of socompile's sources, one at a time, and the emulated training matrix (tests/test_emulated_training.py,
on the emulated CUDA device) must then fail. A wait whose removal leaves the matrix green is a wait no test
guards: either it is not needed, or the emulator cannot see what it orders.

Every mutant is a fresh interpreter over a temporary copy of the package (PYTHONPATH puts it before the
installed one; the C kernel, socompile_ext, stays the installed one) running one case of the matrix at 3 seeds
under a timeout, so a mutant that deadlocks fails instead of hanging the suite. The cases are the ones whose
plan shape exercises the wait.

Waits that order work across steps (a job the next forward needs) are caught with the streams' delays raised to
30 ms (``SOCOMPILE_EMULATION_MAX_DELAY_MS``): copies then land, and host threads woken by them resume, after
the training thread has moved on.

A side stream that fails to wait for compute is seen by the emulator's order after compute (its compute
stream runs on the graph's thread, so compute work is always done when a side stream is handed work; each side
stream counts instead how far into the graph thread's work its waits order it, and a copy of device memory
queued from the graph's thread must be ordered after all of it: runtime/emulated_cuda.py). A wait implied by
another on every path is listed in ``UNGUARDED`` with the wait that implies it, and the test asserts that its
mutant still passes, so the day it stops being implied the list has to change. ``NOT_SEEN_BY_TIMING`` lists
the waits whose mutants passed here for a reason of timing, with the reason; no test asserts either outcome for
them (docs/runtime.md, "Which waits a test guards").
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from socompile.runtime.emulated_cuda import MAX_DELAY_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 420          # one case at 3 seeds takes 20-60 s here, with its Inductor compile


@dataclasses.dataclass(frozen=True)
class Wait:
    name: str
    path: str          # under socompile/
    line: str          # the statement, stripped: must occur exactly once in the file
    cases: tuple       # test_emulated_training CASES that exercise it
    replacement: str = "pass"
    max_delay_ms: int = 3   # the emulated streams' delays; 30: copies land after the host's next step began


GUARDED = (
    Wait("the compute stream waits for a bucket's upload before the forward reads it (wait_upload)",
         "runtime/host_master.py", "self.runtime.wait_on_compute(self.upload_event)", ("stationary",),
         max_delay_ms=30),
    Wait("the compute stream waits for a bucket's gradient copy before the graph reuses the memory (grads_copied)",
         "runtime/host_master.py", "self.runtime.wait_on_compute(self.grad_event)", ("stationary",)),
    Wait("the CPU worker waits for a bucket's gradient copy to the host before stepping it",
         "runtime/host_master.py", 'self.host_blocks.event(self.grad_event, "gradient copy to the host")',
         ("stationary",)),
    Wait("the compute stream waits for a flow bucket's fetch before reading its weights",
         "runtime/offload.py", "self._inflight[key] = (dst, lambda: self.device.wait_on_compute(done))",
         ("flow_d1",), "self._inflight[key] = (dst, lambda: None)"),
    Wait("backward waits for a saved activation's copy back to the device before reading it",
         "runtime/activation_offload.py", "self.device.wait_on_compute(done)", ("activations_offload",)),
    Wait("the forward's first read of a bucket waits for its CPU job (step() returned before it ended)",
         "optim/adamw.py", 'self._jobs.wait(bucket, FIRST_READ)', ("stationary",),
         max_delay_ms=30),
    Wait("a side stream's copy waits for the compute stream's work so far (copy_async: activations, fetches)",
         "runtime/device.py", "stream.stream.wait_stream(self.api.current_stream())", ("activations_offload",)),
    Wait("the gradients' copy to the host waits for the compute stream's work so far (copy_many_async)",
         "runtime/device.py", "stream.stream.wait_stream(self.api.current_stream())   # once, for all the pairs",
         ("stationary",)),
)

UNGUARDED = (
    Wait("an upload waits for the gradient event, i.e. for the backward's last read of the weights it overwrites",
         "runtime/host_master.py", "h2d.wait_event(self.grad_event)", ("stationary",)),
)
# Why the upload's wait survives: the upload is queued by the CPU worker after it waited (host side) for the
# same gradient event before stepping the bucket, and copy_async then orders the upload after all the compute
# work issued so far on the default stream, which the graph runs on; the gradient event is what would still
# order it on a graph run under another stream than the worker's current one (the emulator has one compute
# stream, and does not check copies queued by the runtime's own threads).

# Waits whose mutants survived here by timing, not by construction (so no test asserts either outcome); why:
NOT_SEEN_BY_TIMING = (
    Wait("a host write of the master or the bf16 stage waits for the previous upload that reads it",
         "runtime/host_master.py", 'self.host_blocks.event(self.upload_event, "host write after an upload")',
         ("bf16_cast_cpu_accumulate2",), max_delay_ms=30),
    # implied on the paths the matrix runs: the kernel's next write follows the gradient copy of the next
    # backward, which follows the compute stream's wait for this upload (wait_upload); a rollback or redo in
    # step() writes without that chain, before the next forward, and the upload has landed by then
    Wait("step() waits for the CPU jobs of the buckets it settles (validation needs every norm partial)",
         "optim/adamw.py", 'self._jobs.wait(bucket, SETTLED)', ("clip_commits",),
         max_delay_ms=30),
    # step() waits for the same gradient copy itself (wait_grads) and the job after it takes microseconds on
    # the tiny model: the window in which validation would race the speculating job does not open
    Wait("a flow bucket's fetch waits for the bucket's CPU job (step() returned before it ended)",
         "runtime/offload.py",
         "self.before_host_read(flat)   # the host copy is final once the bucket's CPU job ended",
         ("flow_d1",), max_delay_ms=30),
    # the matrix's jobs end before the next forward fetches their bucket (a 1-layer model's steps take
    # microseconds); tests/test_step_overlap.py delays every CPU job by 100 ms and fails without this wait
    # (test_flowing_buckets_return_early_too_each_fetch_waiting_for_its_bucket_and_without_that_wait_old_weights)
)


def _copied_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    tree = tmp_path / "src"
    shutil.copytree(ROOT / "socompile", tree / "socompile", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _mutated_tree(tmp_path: pathlib.Path, wait: Wait) -> pathlib.Path:
    tree = _copied_tree(tmp_path)
    target = tree / "socompile" / wait.path
    lines = target.read_text().split("\n")
    hits = [i for i, text in enumerate(lines) if text.strip() == wait.line]
    assert len(hits) == 1, f"{wait.path}: {wait.line!r} found {len(hits)} times"
    indent = lines[hits[0]][:len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
    lines[hits[0]] = indent + wait.replacement
    target.write_text("\n".join(lines))
    return tree


# The interpreter of a mutant: the editable install's finder (which maps ``socompile`` to this checkout ahead of
# sys.path) is dropped, so the copy comes first; this checkout after it still provides socompile_ext.
BOOT = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                    and "editable" not in getattr(type(f), "__module__", "")]
sys.path[:0] = sys.argv[1:4]
import socompile
assert socompile.__file__.startswith(sys.argv[1]), socompile.__file__
import pytest
sys.exit(pytest.main(sys.argv[4:]))
"""


def _run_matrix(tree: pathlib.Path, cases: tuple, max_delay_ms: int) -> subprocess.CompletedProcess:
    tests = [f"{ROOT / 'tests' / 'test_emulated_training.py'}::test_emulated_training_matches_eager_adamw_at_3_seeds"
             f"[{case}]" for case in cases]
    return subprocess.run([sys.executable, "-c", BOOT, str(tree), str(ROOT / "tests"), str(ROOT),
                           "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                          cwd=tree.parent, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, MAX_DELAY_ENV: str(max_delay_ms)})


@pytest.mark.parametrize("wait", GUARDED + UNGUARDED + NOT_SEEN_BY_TIMING, ids=lambda w: w.name[:60])
def test_every_listed_wait_is_still_in_the_sources(wait):
    """The lists follow the code: a wait moved or reworded must be moved here too (default suite, no run); each
    names one statement (the mutant removes exactly that one)."""
    text = (ROOT / "socompile" / wait.path).read_text().split("\n")
    hits = sum(line.strip() == wait.line for line in text)
    assert hits == 1, (wait.path, wait.line, hits)


@pytest.mark.slow
@pytest.mark.parametrize("wait", GUARDED, ids=[w.name[:60] for w in GUARDED])
def test_removing_a_guarded_wait_makes_the_emulated_matrix_fail(tmp_path, wait):
    try:
        out = _run_matrix(_mutated_tree(tmp_path, wait), wait.cases, wait.max_delay_ms)
    except subprocess.TimeoutExpired:
        return   # the mutant hung (a deadlock is a failure too): caught
    # exit 1: a test failed (not 2-5: an error of collection or usage, which would say nothing of the wait)
    assert out.returncode == 1 and "failed" in out.stdout, \
        f"removing {wait.name!r}: pytest exit {out.returncode}\n{out.stdout[-3000:]}{out.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("wait", UNGUARDED, ids=[w.name[:60] for w in UNGUARDED])
def test_the_implied_waits_still_survive_their_removal(tmp_path, wait):
    out = _run_matrix(_mutated_tree(tmp_path, wait), wait.cases, wait.max_delay_ms)
    assert out.returncode == 0, (f"removing {wait.name!r} now fails the matrix: move it to GUARDED\n"
                                 f"{out.stdout[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("cases,max_delay_ms", sorted({(w.cases, w.max_delay_ms) for w in GUARDED}))
def test_without_a_mutation_the_same_runs_pass(tmp_path, cases, max_delay_ms):
    """The control: the unchanged sources pass each run a mutant fails (at its longer delays too), so what fails
    a mutant is the wait it removed."""
    out = _run_matrix(_copied_tree(tmp_path), cases, max_delay_ms)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
