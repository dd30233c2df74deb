"""The timeline of a simulated step: tasks on lanes, their event-driven replay, and the result with its
metrics. Separate from simulate.py, which decides what tasks a plan's step issues (and for the baseline
schedules); this part knows nothing of plans, only of tasks, lanes and dependencies.

A task runs on its lane's resources, or on another lane's (``runs_on``: on a CPU-only build the "device" is
the CPU, so compute, copies and the optimizer all take the same cores, one lane). Each in-order lane (compute,
CPU workers) runs its tasks in issue order, like a CUDA stream or a single-thread
executor; a task starts when its lane is free and all its dependencies have finished. Replaying tasks in issue
order is exact for in-order lanes because dependencies always point at earlier-issued tasks. Lanes ``h2d``,
``d2h`` and ``net:*`` serve transfers first-ready-first-served (several streams share one link).
"""
from __future__ import annotations

import dataclasses

from . import chrome_trace


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    lane: str
    duration: float
    deps: tuple[int, ...]
    kind: str          # "compute", "transfer", "adam", "cast"
    nbytes: float = 0.0
    runs_on: str = ""  # the lane whose resources it takes, when not its own (a CPU "device": every lane's work)

    @property
    def resource(self) -> str:
        return self.runs_on or self.lane


@dataclasses.dataclass
class SimResult:
    schedule: str
    step_time: float
    tasks: list[Task]
    start: list[float]
    end: list[float]
    lane_of: list[str]
    model_flops: float
    peak_flops: float
    forward_end: float
    backward_end: float
    cpu_lanes: int = 1
    comm_bytes: tuple = ()        # (kind, bytes per rank) of inter-GPU traffic: "ulysses", "zero"

    def busy(self, prefix: str) -> float:
        return sum(e - s for s, e, lane in zip(self.start, self.end, self.lane_of) if lane.startswith(prefix))

    @property
    def gpu_utilisation(self) -> float:
        busy = sum(e - s for s, e, lane in zip(self.start, self.end, self.lane_of) if lane == "gpu")
        return busy / self.step_time if self.step_time else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time / self.peak_flops if self.step_time else 0.0

    @property
    def tflops(self) -> float:
        return self.model_flops / self.step_time / 1e12 if self.step_time else 0.0

    @property
    def exposed_tail(self) -> float:
        """Seconds between the end of backward and the end of the step (optimizer work not hidden)."""
        return self.step_time - self.backward_end

    def summary(self) -> dict:
        return {"schedule": self.schedule, "step_time_s": round(self.step_time, 6),
                "forward_s": round(self.forward_end, 6), "backward_s": round(self.backward_end - self.forward_end, 6),
                "exposed_tail_s": round(self.exposed_tail, 6), "gpu_utilisation": round(self.gpu_utilisation, 4),
                "mfu": round(self.mfu, 4), "tflops": round(self.tflops, 2),
                "link_h2d_busy_s": round(self.busy("h2d"), 6), "link_d2h_busy_s": round(self.busy("d2h"), 6),
                "cpu_adam_busy_s": round(self.busy("cpu") / self.cpu_lanes, 6),
                "comm_busy_s": round(self.busy("net"), 6), "comm_exposed_s": round(self.exposed_comm, 6),
                **{f"comm_{k}_bytes": int(v) for k, v in self.comm_bytes}}

    @property
    def exposed_comm(self) -> float:
        """Seconds of collectives during which the GPU compute lane is idle (not hidden by compute)."""
        gpu = sorted((s, e) for s, e, lane in zip(self.start, self.end, self.lane_of) if lane == "gpu")
        net = sorted((s, e) for s, e, lane in zip(self.start, self.end, self.lane_of) if lane.startswith("net"))
        if not net:
            return 0.0
        merged: list[list[float]] = []
        for s, e in net:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        covered = 0.0
        j = 0
        for s, e in merged:
            while j < len(gpu) and gpu[j][1] <= s:
                j += 1
            k = j
            while k < len(gpu) and gpu[k][0] < e:
                covered += max(0.0, min(e, gpu[k][1]) - max(s, gpu[k][0]))
                k += 1
        return sum(e - s for s, e in merged) - covered

    def lanes(self) -> list[str]:
        """Lanes in display order: compute, its aux stream, the link, the CPU workers, the network."""
        order = ("gpu", "gpu_aux", "h2d", "d2h", "cpu", "net")
        return sorted(set(self.lane_of), key=lambda lane: (next((i for i, p in enumerate(order)
                                                                   if lane.startswith(p)), len(order)), lane))

    def chrome_trace(self, pid: int = chrome_trace.SIMULATED_PID) -> dict:
        """The step in the Chrome trace event format (Perfetto, chrome://tracing): one complete event per task
        on its lane's thread, times in microseconds from the step's start."""
        lanes = self.lanes()
        tid = {lane: i for i, lane in enumerate(lanes, start=1)}
        events = chrome_trace.metadata(pid, f"simulated step ({self.schedule})", lanes)
        for task, s, e in zip(self.tasks, self.start, self.end):
            args = {**({"bytes": task.nbytes} if task.nbytes else {}), **({"runs_on": task.runs_on} if task.runs_on
                                                                          else {})} or None
            events.append(chrome_trace.complete(task.name, task.kind, s, e, pid, tid[task.lane], args))
        return chrome_trace.trace(events)

    def bucket_times(self) -> dict[int, tuple[float, float]]:
        """bucket index -> (gradients ready or sent, optimizer step finished) in seconds from step start."""
        out: dict[int, list[float]] = {}
        for task, s, e in zip(self.tasks, self.start, self.end):
            if task.kind == "adam" or task.name.startswith("grads b"):
                idx = int(task.name.rsplit("b", 1)[1])
                slot = out.setdefault(idx, [s, e])
                slot[0] = min(slot[0], s)
                slot[1] = max(slot[1], e) if task.kind == "adam" else slot[1]
        return {k: (v[0], v[1]) for k, v in out.items()}


SHARED_LANES = ("h2d", "d2h", "net")


def replay(tasks: list[Task]) -> tuple[list[float], list[float]]:
    """Start and end of every task. In-order lanes (compute, CPU workers) run their tasks in issue order; a
    shared lane (the link directions, the network) runs whichever issued task is ready first (ties: issue
    order), like several streams feeding one DMA engine. Dependencies point at earlier-issued tasks."""
    import heapq
    n = len(tasks)
    start = [0.0] * n
    end = [0.0] * n
    shared = [t.resource.startswith(SHARED_LANES) for t in tasks]
    waiting = [len(t.deps) for t in tasks]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            users[d].append(i)
    # In-order lanes: a task also waits for its lane predecessor.
    lane_next: dict[int, int] = {}
    last_on: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if not shared[i]:
            prev = last_on.get(t.resource)
            if prev is not None:
                lane_next[prev] = i
                waiting[i] += 1
            last_on[t.resource] = i
    ready_at = [0.0] * n
    free: dict[str, float] = {}
    heap = [(0.0, i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(heap)
    done = 0
    while heap:
        key, i = heapq.heappop(heap)
        t0 = max(ready_at[i], free.get(tasks[i].resource, 0.0))
        if t0 > key:
            heapq.heappush(heap, (t0, i))
            continue
        t1 = t0 + tasks[i].duration
        start[i], end[i] = t0, t1
        free[tasks[i].resource] = t1
        done += 1
        for u in users[i] + ([lane_next[i]] if i in lane_next else []):
            ready_at[u] = max(ready_at[u], t1)
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(heap, (max(ready_at[u], free.get(tasks[u].resource, 0.0)), u))
    if done != n:
        raise ValueError("simulator: a task depends on a later one (cycle)")
    return start, end
