"""The Chrome trace event format (what Perfetto and chrome://tracing open), for simulated and measured steps.

A trace is ``{"traceEvents": [...], "displayTimeUnit": "ms"}``. Each lane is a thread (``tid``) of a process
(``pid``) named by metadata events (ph "M"); work is a complete event (ph "X": ``ts`` and ``dur`` in
microseconds); a moment is an instant event (ph "i", thread-scoped). The simulated step is one process, a
measured step another, so ``merge`` lays them side by side in one file.
"""
from __future__ import annotations

import json
import os

SIMULATED_PID = 1      # ``socompile simulate --trace`` numbers its schedules 1, 2, 3
MEASURED_PID = 10


def metadata(pid: int, process: str, lanes: list[str]) -> list[dict]:
    """Name the process and its lanes; lane i is thread i + 1, in the order given (the viewer sorts by it)."""
    out = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}]
    for tid, lane in enumerate(lanes, start=1):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def complete(name: str, cat: str, start_s: float, end_s: float, pid: int, tid: int, args: dict | None = None) -> dict:
    """A piece of work from ``start_s`` to ``end_s`` (seconds) on lane ``tid``."""
    event = {"name": name, "cat": cat, "ph": "X", "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6,
             "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def instant(name: str, cat: str, at_s: float, pid: int, tid: int, args: dict | None = None) -> dict:
    event = {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": at_s * 1e6, "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def trace(events: list[dict]) -> dict:
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def merge(*traces: dict) -> dict:
    """Several traces (each with its own pid) in one file."""
    return trace([e for t in traces for e in t["traceEvents"]])


def write(data: dict, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
