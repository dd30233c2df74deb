"""Event-driven replay of one training step of a plan on a hardware profile.

A step is a DAG of tasks on lanes: ``gpu`` (the compute stream), ``gpu_aux`` (a second stream for casts of
uploaded weights), ``h2d`` and ``d2h`` (the link, one lane per direction), and ``cpu0..cpuK`` (CPU optimizer
workers; they share the CPU's memory bandwidth, so K lanes each get 1/K of it). Each lane runs its tasks in
issue order, like a CUDA stream or a single-thread executor; a task starts when its lane is free and all its
dependencies have finished. Replaying tasks in issue order is exact for in-order lanes because dependencies
always point at earlier-issued tasks.

The same builder replays three schedules on the same work (same graph times, same buckets):
- ``superoffload``: the plan as made (GPU-resident buckets, weight flow, speculative CPU steps as gradients
  arrive, casts where the plan put them);
- ``zero-offload``: every bucket on the CPU, all CPU steps after backward, bf16 over the link, casts on the CPU
  as separate passes, DeepSpeed CPU-Adam speed (58% vs GraceAdam's 74% of bandwidth, SuperOffload blog);
- ``zero-infinity``: as zero-offload, and every weight streamed from CPU memory before each use (distance 1).
"""
from __future__ import annotations

import dataclasses

from .analysis import GraphCosts
from .cost import CostModel
from .plan import Plan

# DeepSpeed CPU-Adam / GraceAdam bandwidth fractions from the SuperOffload blog's Adam table (58% vs 74%).
DEEPSPEED_ADAM_SCALE = 0.58 / 0.74


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    lane: str
    duration: float
    deps: tuple[int, ...]
    kind: str          # "compute", "transfer", "adam", "cast"
    nbytes: float = 0.0


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
                "cpu_adam_busy_s": round(self.busy("cpu") / self.cpu_lanes, 6)}

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


class _Builder:
    def __init__(self, cpu_lanes: int):
        self.tasks: list[Task] = []
        self.cpu_lanes = cpu_lanes
        self._next_cpu = 0

    def add(self, name, lane, duration, deps=(), kind="compute", nbytes=0.0) -> int:
        if lane == "cpu":
            lane = f"cpu{self._next_cpu}"
            self._next_cpu = (self._next_cpu + 1) % self.cpu_lanes
        self.tasks.append(Task(name, lane, float(duration), tuple(d for d in deps if d is not None), kind, nbytes))
        return len(self.tasks) - 1


def replay(tasks: list[Task]) -> tuple[list[float], list[float]]:
    free: dict[str, float] = {}
    start, end = [], []
    for task in tasks:
        t0 = max([free.get(task.lane, 0.0), *(end[d] for d in task.deps)])
        t1 = t0 + task.duration
        free[task.lane] = t1
        start.append(t0)
        end.append(t1)
    return start, end


def _segments(times: list[float], cuts: list[int]) -> list[tuple[int, int, float]]:
    """Split node times at positions ``cuts`` (a segment starts at each cut); (start, stop, seconds)."""
    points = sorted({0, *[c for c in cuts if 0 < c < len(times)], len(times)})
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    return [(a, b, prefix[b] - prefix[a]) for a, b in zip(points, points[1:])]


def simulate(plan: Plan, costs: GraphCosts, cost: CostModel, schedule: str = "superoffload",
             cpu_lanes: int | None = None, speculation: str = "on") -> SimResult:
    """Replay one step of ``plan`` (or the named baseline schedule on the plan's buckets).

    ``speculation`` (superoffload schedule): "on" - CPU steps start as gradients arrive and validation
    commits them; "off" - CPU steps wait for validation after backward; "redo" - speculated, then validation
    clips, so every speculated CPU step is taken again after backward (the worst case of a clipped step)."""
    if speculation not in ("on", "off", "redo"):
        raise ValueError(f"speculation must be 'on', 'off' or 'redo', got {speculation!r}")
    hw = cost.hw
    lanes = cpu_lanes or max(1, min(4, hw.host_cores // 16))
    baseline = schedule != "superoffload"
    infinity = schedule == "zero-infinity"
    if schedule not in ("superoffload", "zero-offload", "zero-infinity"):
        raise ValueError(f"unknown schedule {schedule!r}")
    b = _Builder(lanes)
    adam_scale = (DEEPSPEED_ADAM_SCALE if baseline else 1.0) / lanes
    buckets = plan.buckets
    grad_size = plan_grad_dtype_bytes(plan)
    flow = {bk.index for bk in buckets if (infinity or (not baseline and bk.weight_mode == "flow"))}
    distance = {bk.index: (1 if baseline else max(1, bk.prefetch_distance)) for bk in buckets}
    on_device = {bk.index for bk in buckets if not baseline and bk.optimizer_site == "device"}
    recompute = 1.0 + (costs.layer_fw_time / costs.bw_time if plan_recompute(plan) and costs.bw_time else 0.0)

    def first_use(bk, uses):
        found = [uses[p][0] for p in bk.params if p in uses]
        return min(found) if found else None

    # ---- forward: flow buckets streamed in, in order of first use
    def phase(times, uses, ready_cuts, scale, label):
        flow_uses = sorted((u, bk.index) for bk in buckets if bk.index in flow
                           for u in [first_use(bk, uses)] if u is not None)
        cuts = [u for u, _ in flow_uses] + ready_cuts
        segs = _segments(times, cuts)
        seg_at = {s[0]: i for i, s in enumerate(segs)}
        seg_ids: list[int] = []
        # Issue transfers first (they sit on their own lane), each gated by buffer reuse.
        pending = []
        for j, (u, idx) in enumerate(flow_uses):
            pending.append((j, u, idx))
        transfer_ids: dict[int, int] = {}
        seg_task: dict[int, int] = {}
        order = []
        for i, (a, stop, secs) in enumerate(segs):
            # transfers whose buffer frees when this segment starts go out first
            for j, u, idx in pending:
                if j in transfer_ids:
                    continue
                gate = flow_uses[j - distance[idx]][0] if j - distance[idx] >= 0 else None
                if gate is None or gate <= a:
                    bk = buckets[idx]
                    dep = seg_task.get(seg_at[gate] - 1) if gate is not None and seg_at[gate] > 0 else None
                    transfer_ids[j] = b.add(f"{label} prefetch b{idx}", "h2d",
                                            cost.transfer_time(bk.numel * 2, "h2d"), (dep,), "transfer", bk.numel * 2)
            needs = [transfer_ids[j] for j, u, _ in pending if u == a]
            deps = needs + ([seg_task[i - 1]] if i else [])
            seg_task[i] = b.add(f"{label} [{a}:{stop})", "gpu", secs * scale, deps, "compute")
            seg_ids.append(seg_task[i])
            order.append((a, stop))
        return segs, seg_ids

    fw_segs, fw_ids = phase(costs.fw_times, costs.fw_uses, [], 1.0, "fw")
    forward_last = fw_ids[-1]
    ready_cuts = [bk.ready_position + 1 for bk in buckets]
    bw_segs, bw_ids = phase(costs.bw_times, costs.bw_uses, ready_cuts, recompute, "bw")
    # first backward segment waits for the forward
    b.tasks[bw_ids[0]] = dataclasses.replace(b.tasks[bw_ids[0]], deps=b.tasks[bw_ids[0]].deps + (forward_last,))
    backward_last = bw_ids[-1]

    def seg_ending_after(pos):
        for (a, stop, _), tid in zip(bw_segs, bw_ids):
            if a <= pos < stop:
                return tid
        return backward_last

    native = grad_size
    for bk in buckets:
        if bk.index in on_device:
            continue
        ready = seg_ending_after(bk.ready_position)
        link_bytes = bk.numel * (native if baseline else _dtype_bytes(bk.link_dtype))
        deps = [ready]
        if not baseline and link_bytes > bk.numel * native:   # upcast on the GPU before the copy
            deps = [b.add(f"upcast g b{bk.index}", "gpu_aux", cost.gpu_cast_time(bk.numel, native, 4), [ready],
                          "cast")]
        d2h = b.add(f"grads b{bk.index}", "d2h", cost.transfer_time(link_bytes, "d2h"), deps, "transfer", link_bytes)
        after = [d2h] + ([backward_last] if baseline or speculation == "off" else [])
        if baseline:   # DeepSpeed's CPU Adam needs fp32 gradients: a separate cast pass first
            after = [b.add(f"cast g b{bk.index}", "cpu", cost.cpu_cast_time(bk.numel, native, 4) * lanes, after,
                           "cast")]
        grad_bytes = 4 if baseline else _dtype_bytes(bk.link_dtype)
        writes_copy = (not baseline) and (bk.cast_site == "cpu" or bk.index in flow)
        adam = b.add(f"adam b{bk.index}", "cpu",
                     cost.cpu_adam_time(bk.numel, grad_bytes, writes_copy, adam_scale), after, "adam")
        if not baseline and speculation == "redo":   # rolled back (free: ping-pong) and stepped again
            adam = b.add(f"redo adam b{bk.index}", "cpu",
                         cost.cpu_adam_time(bk.numel, grad_bytes, writes_copy, adam_scale), [adam, backward_last],
                         "adam")
        if bk.index in flow:
            continue   # weights stay in host memory; next step streams the fresh bf16 copy
        if baseline:
            cast = b.add(f"cast p b{bk.index}", "cpu", cost.cpu_cast_time(bk.numel) * lanes, [adam], "cast")
            b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(bk.numel * 2, "h2d"), [cast], "transfer",
                  bk.numel * 2)
        elif bk.cast_site == "cpu":
            b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(bk.numel * 2, "h2d"), [adam], "transfer",
                  bk.numel * 2)
        else:
            up = b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(bk.numel * 4, "h2d"), [adam], "transfer",
                       bk.numel * 4)
            b.add(f"cast p b{bk.index}", "gpu_aux", cost.gpu_cast_time(bk.numel), [up], "cast")
    for bk in buckets:
        if bk.index in on_device:
            b.add(f"gpu adam b{bk.index}", "gpu", cost.gpu_adam_time(bk.numel), [backward_last], "adam")
    start, end = replay(b.tasks)
    return SimResult(schedule=schedule, step_time=max(end), tasks=b.tasks, start=start, end=end,
                     lane_of=[t.lane for t in b.tasks], model_flops=costs.fw_flops + costs.bw_flops,
                     peak_flops=hw.device_bf16_flops, forward_end=end[forward_last], backward_end=end[backward_last],
                     cpu_lanes=lanes)


def _dtype_bytes(name: str) -> int:
    return 2 if name in ("bfloat16", "float16") else 4


def plan_grad_dtype_bytes(plan: Plan) -> int:
    value = dict(plan.predicted).get("param_dtype_bytes")
    return int(value) if value else 2


def plan_recompute(plan: Plan) -> bool:
    return getattr(plan, "recompute", "none") != "none"
