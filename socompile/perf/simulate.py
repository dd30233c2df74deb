"""Event-driven replay of one training step of a plan on a hardware profile.

A step is a DAG of tasks on lanes: ``gpu`` (the compute stream), ``gpu_aux`` (a second stream for casts of
uploaded weights), ``h2d`` and ``d2h`` (the link, one lane per direction), and ``cpu0..cpuK`` (CPU optimizer
workers; they share the CPU's memory bandwidth, so K lanes each get 1/K of it). This module builds the tasks
from a plan; timeline.py replays them (how a lane runs its tasks) and holds the result (``SimResult``).

The same builder replays three schedules on the same work (same graph times, same buckets):
- ``superoffload``: the plan as made (GPU-resident buckets, weight flow, speculative CPU steps as gradients
  arrive, casts where the plan put them);
- ``zero-offload``: every bucket on the CPU, gradients cast to fp32 on the GPU and copied during backward (as
  DeepSpeed's stage 1/2 offload does), all CPU work after backward, as DeepSpeed's ``step`` does it: the fp32
  gradients unscaled/clipped in place (``unscale_and_clip_grads``: a ``mul_`` pass, always run), CPU Adam at
  DeepSpeed CPU-Adam speed (58% vs GraceAdam's 74% of bandwidth, SuperOffload blog), the updated weights cast to
  bf16 on the CPU as a separate pass (a cross-device ``copy_`` with a dtype change) and uploaded. Each of these is
  one OpenMP-parallel pass over all cores, so the baseline has one CPU lane at the whole bandwidth (the
  superoffload schedule's K worker lanes would leave bubbles between dependent passes on different lanes);
  bucket i's upload overlaps bucket i+1's CPU work (generous: ZeRO-2 with one parameter group uploads after the
  whole step);
- ``zero-infinity``: as zero-offload, and every weight streamed from CPU memory before each use (distance 1).

Activations (``Plan.activations``, the same in every schedule): a recomputed layer runs its forward again on
the GPU just before its backward (and, under Ulysses, its two all-to-alls); a selective one the same less its
attention kernels (their outputs were kept); a selective_offload one as selective, after its checkpoints (output
and attention outputs) came back like an offloaded layer's saved tensors; an offloaded layer's saved tensors
go device->host after its forward and come back host->device before its backward, through a window of two
layers (the forward of the layer two offloaded layers later waits for the copy; the fetch waits until the
buffer of the layer two places earlier in backward is free).

Several ranks (``dp_degree`` x ``sp_degree`` in ``Plan.predicted``): one rank is replayed; collectives run on
``net:intra`` (NVLink/PCIe inside a node) or ``net:inter`` (the NIC) by the group they span. Ulysses: an
all-to-all of q, k, v before each attention and of its output after it, in forward; dO before and dq, dk, dv
after it in backward; each moves (sp-1)/sp of the local tensor and the compute waits for it. ZeRO: each bucket's
gradients are reduce-scattered when ready, each rank steps its 1/W shard, and the updated weights are
all-gathered, on the net lane, overlapping compute.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from .analysis import GraphCosts
from .cost import CostModel
from .timeline import SimResult, Task, replay

if TYPE_CHECKING:   # annotations only: importing socompile.plan here would close the circle plan -> perf -> plan
    from ..plan.plan import Plan

# DeepSpeed CPU-Adam / GraceAdam bandwidth fractions from the SuperOffload blog's Adam table (58% vs 74%).
DEEPSPEED_ADAM_SCALE = 0.58 / 0.74


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


def _segments(times: list[float], cuts: list[int]) -> list[tuple[int, int, float]]:
    """Split node times at positions ``cuts`` (a segment starts at each cut); (start, stop, seconds)."""
    points = sorted({0, *[c for c in cuts if 0 < c < len(times)], len(times)})
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    return [(a, b, prefix[b] - prefix[a]) for a, b in zip(points, points[1:])]


def parallel_degrees(plan: Plan) -> tuple[int, int]:
    pred = dict(plan.predicted)
    return max(1, int(pred.get("dp_degree", 1))), max(1, int(pred.get("sp_degree", 1)))


def layer_choices(plan: Plan, costs: GraphCosts) -> dict[str, str]:
    """Layer -> 'keep' | 'recompute' | 'selective' | 'offload'; a plan that says recompute='layers' without per-layer
    choices (older plans) recomputes every repeated layer."""
    if plan.activations:
        return dict(plan.activations)
    if plan_recompute(plan):
        return {lc.name: "recompute" for lc in costs.layers}
    return {}


def ulysses_bytes(costs: GraphCosts, sp: int) -> list[float]:
    """Per forward attention: bytes one rank sends in its all-to-alls (q, k, v before; out after), each moving
    (sp-1)/sp of the rank's local tensor. Backward moves the same (dO before; dq, dk, dv after)."""
    if sp <= 1:
        return [0.0] * len(costs.fw_attention)
    return [b * (sp - 1) / sp for b in costs.attention_bytes]


def simulate(plan: Plan, costs: GraphCosts, cost: CostModel, schedule: str = "superoffload",
             cpu_lanes: int | None = None, speculation: str = "on") -> SimResult:
    """Replay one step of ``plan`` (or the named baseline schedule on the plan's buckets).

    ``speculation`` (superoffload schedule): "on" - CPU steps start as gradients arrive and validation
    commits them; "off" - CPU steps wait for validation after backward; "redo" - speculated, then validation
    clips, so every speculated CPU step is taken again after backward (the worst case of a clipped step)."""
    if speculation not in ("on", "off", "redo"):
        raise ValueError(f"speculation must be 'on', 'off' or 'redo', got {speculation!r}")
    hw = cost.hw
    baseline = schedule != "superoffload"
    # DeepSpeed's CPU passes (unscale, Adam, cast) each use every core, one after the other: one lane.
    lanes = 1 if baseline else cpu_lanes or max(1, min(4, hw.host_cores // 16))
    infinity = schedule == "zero-infinity"
    if schedule not in ("superoffload", "zero-offload", "zero-infinity"):
        raise ValueError(f"unknown schedule {schedule!r}")
    dp, sp = parallel_degrees(plan)
    world = dp * sp
    b = _Builder(lanes)
    adam_scale = (DEEPSPEED_ADAM_SCALE if baseline else 1.0) / lanes
    buckets = plan.buckets
    grad_size = plan_grad_dtype_bytes(plan)
    flow = {bk.index for bk in buckets if (infinity or (not baseline and bk.weight_mode == "flow"))}
    distance = {bk.index: (1 if baseline else max(1, bk.prefetch_distance)) for bk in buckets}
    on_device = {bk.index for bk in buckets if not baseline and bk.optimizer_site == "device"}
    choices = layer_choices(plan, costs)
    layers = [lc for lc in costs.layers if choices.get(lc.name, "keep") != "keep"]
    sp_lane = "net:intra" if hw.group_bandwidth(sp) == hw.intra_node_bandwidth and hw.gpus_per_node > 1 \
        else "net:inter"
    dp_lane = "net:intra" if hw.group_bandwidth(world) == hw.intra_node_bandwidth and hw.gpus_per_node > 1 \
        else "net:inter"
    a2a = ulysses_bytes(costs, sp)
    comm = {"ulysses": 0.0, "zero": 0.0}

    def first_use(bk, uses):
        found = [uses[p][0] for p in bk.params if p in uses]
        return min(found) if found else None

    def all_to_all(name, nbytes, deps):
        comm["ulysses"] += nbytes
        return b.add(name, sp_lane, cost.all_to_all_time(nbytes, sp), deps, "comm", nbytes)

    # Hooks per phase: before[pos] -> callables(prev_segment) returning ids the segment at pos waits for;
    # after[stop] -> callables(segment) returning ids the next segment waits for.
    seg_end: dict[tuple[str, int], int] = {}
    layer_index = {lc.name: i for i, lc in enumerate(costs.layers)}
    offloaded = [lc for lc in layers if choices[lc.name] in ("offload", "selective_offload")]

    def sent(lc):   # bytes an offloaded layer moves each way: its saved tensors, or a selective one's checkpoints
        return lc.saved if choices[lc.name] == "offload" else lc.boundary + lc.attention_saved
    fetched: dict[str, int] = {}
    offload_out: dict[str, int] = {}
    fw_before: dict[int, list] = {}
    fw_after: dict[int, list] = {}
    bw_before: dict[int, list] = {}
    bw_after: dict[int, list] = {}
    fw_cuts: list[int] = []
    bw_cuts: list[int] = []
    if sp > 1:
        # Around each attention: q, k, v (3/4 of the bytes) turn from sequence to head shards before it and the
        # output (1/4) turns back after it; backward mirrors that (d_out before, dq/dk/dv after).
        phases = (("fw", zip(costs.fw_attention, a2a), fw_before, fw_after, fw_cuts, ("qkv", 0.75), ("out", 0.25)),
                  ("bw", zip(costs.bw_attention, reversed(a2a)), bw_before, bw_after, bw_cuts, ("dout", 0.25),
                   ("dqkv", 0.75)))
        for phase, by_pos, before, after, cuts, (pre, pre_share), (post, post_share) in phases:
            for pos, nbytes in dict(by_pos).items():
                cuts += [pos, pos + 1]
                before.setdefault(pos, []).append(
                    lambda prev, n=nbytes * pre_share, what=f"{phase} a2a {pre} @{pos}": [all_to_all(what, n, [prev])])
                after.setdefault(pos + 1, []).append(
                    lambda seg, n=nbytes * post_share, what=f"{phase} a2a {post} @{pos}": [all_to_all(what, n, [seg])])
    layer_a2a = {}
    if sp > 1:
        for lc in costs.layers:
            layer_a2a[lc.name] = sum(n for pos, n in zip(costs.fw_attention, a2a) if lc.fw_span[0] <= pos < lc.fw_span[1])
    for j, lc in enumerate(offloaded):
        fw_cuts += [lc.fw_span[0], lc.fw_span[1]]
        bw_cuts += [lc.bw_span[0], lc.bw_span[1]]

        def out(seg, lc=lc):
            offload_out[lc.name] = b.add(f"act out {lc.name}", "d2h", cost.transfer_time(sent(lc), "d2h"), [seg],
                                         "transfer", sent(lc))
            return []
        fw_after.setdefault(lc.fw_span[1], []).append(out)
        if j >= 2:   # two layers in flight: the layer two offloads later waits for this copy
            fw_before.setdefault(lc.fw_span[0], []).append(
                lambda prev, name=offloaded[j - 2].name: [offload_out.get(name)])

        def fetch(prev, j=j, lc=lc):
            gate = ("fw", -1) if j + 2 >= len(offloaded) else ("bw", offloaded[j + 2].bw_span[1])
            fetched[lc.name] = b.add(f"act in {lc.name}", "h2d", cost.transfer_time(sent(lc), "h2d"),
                                     [seg_end.get(gate), offload_out.get(lc.name)], "transfer", sent(lc))
            return [fetched[lc.name]]
        bw_before.setdefault(lc.bw_span[0], []).append(fetch)
    for lc in layers:
        if choices[lc.name] not in ("recompute", "selective", "selective_offload"):
            continue
        bw_cuts.append(lc.bw_span[0])

        def again(prev, lc=lc):
            redo = recompute_time(lc, choices[lc.name])
            # a selective_offload layer's recompute reads its fetched checkpoints (its fetch hook ran first)
            rec = b.add(f"recompute {lc.name}", "gpu", redo, [prev, fetched.get(lc.name)], "compute")
            if layer_a2a.get(lc.name):
                rec = all_to_all(f"recompute a2a {lc.name}", layer_a2a[lc.name], [rec])
            return [rec]
        hooks = bw_before.setdefault(lc.bw_span[0], [])
        if choices[lc.name] == "selective_offload":
            hooks.append(again)
        else:
            hooks.insert(0, again)
    del layer_index

    def phase(times, uses, extra_cuts, label, before, after):
        flow_uses = sorted((u, bk.index) for bk in buckets if bk.index in flow
                           for u in [first_use(bk, uses)] if u is not None)
        cuts = [u for u, _ in flow_uses] + extra_cuts
        segs = _segments(times, cuts)
        seg_at = {s[0]: i for i, s in enumerate(segs)}
        starts = [s[0] for s in segs]
        # Flow transfer j is issued at the first segment starting at or after its gate (the first use of the
        # flow bucket `distance` places earlier: its buffer is free then), in j order within a segment.
        issue_at: dict[int, list[tuple[int, int | None]]] = {}
        for j, (u, idx) in enumerate(flow_uses):
            gate = flow_uses[j - distance[idx]][0] if j - distance[idx] >= 0 else None
            at = 0 if gate is None else bisect.bisect_left(starts, gate)
            issue_at.setdefault(at, []).append((j, gate))
        used_at: dict[int, list[int]] = {}
        for j, (u, _) in enumerate(flow_uses):
            used_at.setdefault(u, []).append(j)
        seg_ids: list[int] = []
        transfer_ids: dict[int, int] = {}
        seg_task: dict[int, int] = {}
        carry: list[int] = []
        for i, (a, stop, secs) in enumerate(segs):
            for j, gate in issue_at.get(i, ()):
                idx = flow_uses[j][1]
                bk = buckets[idx]
                dep = seg_task.get(seg_at[gate] - 1) if gate is not None and seg_at.get(gate, 0) > 0 else None
                transfer_ids[j] = b.add(f"{label} prefetch b{idx}", "h2d",
                                        cost.transfer_time(bk.numel * 2, "h2d"), (dep,), "transfer", bk.numel * 2)
            needs = [transfer_ids[j] for j in used_at.get(a, ())]
            prev = seg_task[i - 1] if i else (forward_last_box[0] if label == "bw" else None)
            hooked: list[int] = []
            for hook in before.get(a, ()):
                hooked += [h for h in hook(prev) if h is not None]
            deps = needs + ([prev] if prev is not None else []) + carry + hooked
            seg_task[i] = b.add(f"{label} [{a}:{stop})", "gpu", secs, deps, "compute")
            seg_ids.append(seg_task[i])
            seg_end[(label, stop)] = seg_task[i]
            carry = []
            for hook in after.get(stop, ()):
                carry += [h for h in hook(seg_task[i]) if h is not None]
        if carry:   # a hook after the last segment (e.g. the last all-to-all): the phase ends with it
            seg_ids.append(b.add(f"{label} end", "gpu", 0.0, [seg_ids[-1], *carry], "compute"))
        return segs, seg_ids

    forward_last_box = [None]
    fw_segs, fw_ids = phase(costs.fw_times, costs.fw_uses, fw_cuts, "fw", fw_before, fw_after)
    forward_last = fw_ids[-1]
    forward_last_box[0] = forward_last
    seg_end[("fw", -1)] = forward_last
    ready_cuts = [bk.ready_position + 1 for bk in buckets]
    bw_segs, bw_ids = phase(costs.bw_times, costs.bw_uses, ready_cuts + bw_cuts, "bw", bw_before, bw_after)
    backward_last = bw_ids[-1]

    bw_starts = [a for a, _, _ in bw_segs]

    def seg_ending_after(pos):
        i = bisect.bisect_right(bw_starts, pos) - 1
        if 0 <= i < len(bw_segs) and bw_segs[i][0] <= pos < bw_segs[i][1]:
            return bw_ids[i]
        return backward_last

    def zero_collective(kind, bk, after):
        """A ZeRO ring collective of one bucket (each rank sends (world - 1) / world of it), after ``after``."""
        if world <= 1:
            return after
        nbytes = bk.numel * grad_size * (world - 1) / world
        comm["zero"] += nbytes
        return b.add(f"{kind} b{bk.index}", dp_lane, cost.ring_time(nbytes, world), [after], "comm", nbytes)

    def reduce_scatter(bk, ready):
        return zero_collective("reduce-scatter", bk, ready)

    def all_gather(bk, after):
        return zero_collective("all-gather", bk, after)

    native = grad_size
    for bk in buckets:
        if bk.index in on_device:
            continue
        shard = bk.numel / world
        ready = reduce_scatter(bk, seg_ending_after(bk.ready_position))
        # ZeRO-Offload (DeepSpeed stage 1/2 with offload_optimizer, async_inplace_copy_grad_to_fp32_buffer_
        # from_gpu): each gradient is cast to fp32 on the GPU and copied into the fp32 host buffer as soon as it
        # is reduced, during backward; the CPU Adam runs after backward.
        link_bytes = shard * (4 if baseline else _dtype_bytes(bk.link_dtype))
        deps = [ready]
        if link_bytes > shard * native:   # upcast on the GPU before the copy
            deps = [b.add(f"upcast g b{bk.index}", "gpu_aux", cost.gpu_cast_time(shard, native, 4), [ready],
                          "cast")]
        d2h = b.add(f"grads b{bk.index}", "d2h", cost.transfer_time(link_bytes, "d2h"), deps, "transfer", link_bytes)
        after = [d2h] + ([backward_last] if baseline or speculation == "off" else [])
        if baseline:   # unscale_and_clip_grads: fp32 gradients read and written once, before the step
            after = [b.add(f"unscale g b{bk.index}", "cpu", cost.cpu_cast_time(shard, 4, 4), after, "cast")]
        grad_bytes = 4 if baseline else _dtype_bytes(bk.link_dtype)
        writes_copy = (not baseline) and (bk.cast_site == "cpu" or bk.index in flow)
        adam = b.add(f"adam b{bk.index}", "cpu",
                     cost.cpu_adam_time(shard, grad_bytes, writes_copy, adam_scale), after, "adam")
        if not baseline and speculation == "redo":   # rolled back (free: ping-pong) and stepped again
            adam = b.add(f"redo adam b{bk.index}", "cpu",
                         cost.cpu_adam_time(shard, grad_bytes, writes_copy, adam_scale), [adam, backward_last],
                         "adam")
        if bk.index in flow:
            all_gather(bk, adam)   # every rank's host copy gets the other shards; next step streams it
            continue
        if baseline:
            cast = b.add(f"cast p b{bk.index}", "cpu", cost.cpu_cast_time(shard), [adam], "cast")
            up = b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(shard * 2, "h2d"), [cast], "transfer",
                       shard * 2)
        elif bk.cast_site == "cpu":
            up = b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(shard * 2, "h2d"), [adam], "transfer",
                       shard * 2)
        else:
            up = b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(shard * 4, "h2d"), [adam], "transfer",
                       shard * 4)
            up = b.add(f"cast p b{bk.index}", "gpu_aux", cost.gpu_cast_time(shard), [up], "cast")
        all_gather(bk, up)
    for bk in buckets:
        if bk.index in on_device:
            ready = reduce_scatter(bk, seg_ending_after(bk.ready_position))
            step = b.add(f"gpu adam b{bk.index}", "gpu", cost.gpu_adam_time(bk.numel / world), [backward_last, ready],
                         "adam")
            all_gather(bk, step)
    start, end = replay(b.tasks)
    return SimResult(schedule=schedule, step_time=max(end), tasks=b.tasks, start=start, end=end,
                     lane_of=[t.lane for t in b.tasks], model_flops=costs.fw_flops + costs.bw_flops,
                     peak_flops=hw.device_bf16_flops, forward_end=end[forward_last], backward_end=end[backward_last],
                     cpu_lanes=lanes, comm_bytes=tuple(sorted(comm.items())) if world > 1 else ())


def recompute_time(lc, choice: str) -> float:
    """Seconds of forward a layer runs again in backward: all of it ("recompute"), all but its attention
    kernels ("selective": their outputs were kept), nothing otherwise."""
    if choice == "recompute":
        return lc.fw_time
    if choice in ("selective", "selective_offload"):
        return max(0.0, lc.fw_time - lc.attention_time)
    return 0.0


def _dtype_bytes(name: str) -> int:
    return 2 if name in ("bfloat16", "float16") else 4


def plan_grad_dtype_bytes(plan: Plan) -> int:
    value = dict(plan.predicted).get("param_dtype_bytes")
    return int(value) if value else 2


def plan_recompute(plan: Plan) -> bool:
    return getattr(plan, "recompute", "none") != "none"
