"""Event-driven replay of one training step of a plan on a hardware profile.

A step is a DAG of tasks on lanes: ``gpu`` (the compute stream), ``gpu_aux`` (a second stream for casts of
uploaded weights), ``h2d`` and ``d2h`` (the link, one lane per direction), and ``cpu0`` (the CPU optimizer: the
runtime's one worker running the OpenMP kernel over every core, at the CPU's whole Adam bandwidth, one bucket
after the other, as runtime/worker.py does; docs/planner.md "CPU lanes" says why one lane beats several).
``cpu_lanes=K`` (experiments) replays K workers sharing that bandwidth, each at 1/K of it. This module builds the tasks
from a plan; timeline.py replays them (how a lane runs its tasks) and holds the result (``SimResult``).

The same builder replays three schedules on the same work (same graph times, same buckets):
- ``superoffload``: the plan as made (GPU-resident buckets, weight flow, speculative CPU steps as gradients
  arrive, casts where the plan put them);
- ``zero-offload``: every bucket on the CPU, gradients cast to fp32 on the GPU and copied during backward (as
  DeepSpeed's stage 1/2 offload does), all CPU work after backward, as DeepSpeed's ``step`` does it: the fp32
  gradients unscaled/clipped in place (``unscale_and_clip_grads``: a ``mul_`` pass, always run), CPU Adam at
  DeepSpeed CPU-Adam speed (measured against ours by bench/adam.py: hardware/cpu_adam.py), the updated weights cast to
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
import dataclasses
from typing import TYPE_CHECKING

from ..dtypes import dtype_bytes
from ..hardware.cpu_adam import MEASURED as MEASURED_ADAM
from ..options import OFFLOADED_CHOICES
from .analysis import GraphCosts
from .cost import CostModel
from .timeline import SimResult, Task, replay

if TYPE_CHECKING:   # annotations only: importing socompile.plan here would close the circle plan -> perf -> plan
    from ..plan.plan import Plan

class _Builder:
    def __init__(self, cpu_lanes: int, device_is_host: bool = False):
        self.tasks: list[Task] = []
        self.cpu_lanes = cpu_lanes
        self._next_cpu = 0
        # A CPU-only build (the "device" is this CPU): the compute, the copies (memcpy on stream threads) and
        # the optimizer (stepped inline, between backward nodes: AdamW cpu_worker="auto") share the same cores
        # and memory bandwidth, so every task takes the compute lane's resources, one after the other.
        self.runs_on = "gpu" if device_is_host else ""

    def add(self, name, lane, duration, deps=(), kind="compute", nbytes=0.0) -> int:
        if lane == "cpu":
            lane = f"cpu{self._next_cpu}"
            self._next_cpu = (self._next_cpu + 1) % self.cpu_lanes
        self.tasks.append(Task(name, lane, float(duration), tuple(d for d in deps if d is not None), kind, nbytes,
                               self.runs_on if lane != self.runs_on else ""))
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


@dataclasses.dataclass
class _PhaseHooks:
    """Work hung around one phase's compute segments: ``before[pos]`` -> callables(previous segment's task)
    returning task ids the segment starting at ``pos`` waits for; ``after[stop]`` -> callables(segment's task)
    returning ids the next segment waits for; ``cuts``: positions where a segment must start."""
    before: dict[int, list] = dataclasses.field(default_factory=dict)
    after: dict[int, list] = dataclasses.field(default_factory=dict)
    cuts: list[int] = dataclasses.field(default_factory=list)


def _net_lane(hw, group: int) -> str:
    """The lane a collective over ``group`` GPUs runs on: NVLink/PCIe inside a node, else the NIC."""
    return "net:intra" if hw.group_bandwidth(group) == hw.intra_node_bandwidth and hw.gpus_per_node > 1 \
        else "net:inter"


class _Step:
    """The tasks of one replayed step, built in issue order: the schedule's settings, the hooks that hang
    activation and Ulysses work around the compute segments, then forward, backward and the optimizer steps."""

    def __init__(self, plan: Plan, costs: GraphCosts, cost: CostModel, schedule: str, lanes: int,
                 speculation: str):
        self.costs, self.cost, self.speculation = costs, cost, speculation
        self.baseline = schedule != "superoffload"
        infinity = schedule == "zero-infinity"
        dp, self.sp = parallel_degrees(plan)
        self.world = dp * self.sp
        self.b = _Builder(lanes, cost.hw.device_is_host)
        # the baseline's CPU Adam (DeepSpeedCPUAdam) streams at the measured share of ours
        self.adam_scale = (MEASURED_ADAM.baseline_of_ours if self.baseline else 1.0) / lanes
        self.buckets = plan.buckets
        self.grad_size = plan_grad_dtype_bytes(plan)
        self.moment_bytes = plan_moment_bytes(plan)
        self.flow = {bk.index for bk in self.buckets
                     if infinity or (not self.baseline and bk.weight_mode == "flow")}
        self.distance = {bk.index: (1 if self.baseline else max(1, bk.prefetch_distance)) for bk in self.buckets}
        self.on_device = {bk.index for bk in self.buckets if not self.baseline and bk.optimizer_site == "device"}
        self.choices = layer_choices(plan, costs)
        self.layers = [lc for lc in costs.layers if self.choices.get(lc.name, "keep") != "keep"]
        self.sp_lane, self.dp_lane = _net_lane(cost.hw, self.sp), _net_lane(cost.hw, self.world)
        self.a2a = ulysses_bytes(costs, self.sp)
        self.comm = {"ulysses": 0.0, "zero": 0.0}
        self.hooks = {"fw": _PhaseHooks(), "bw": _PhaseHooks()}
        self.seg_end: dict[tuple[str, int], int] = {}   # (phase, stop) -> the task of the segment ending there
        self.fetched: dict[str, int] = {}       # layer -> the task bringing its saved tensors back
        # The bytes of every superoffload transfer, from the per-bucket list the runtime executes (one source)
        from ..plan.transfers import bucket_transfers   # here: socompile.plan imports this module
        self.transfers = {(t.bucket, t.purpose): t for t in bucket_transfers(plan, costs.param_numels or None,
                                                                              weight_bytes=self.grad_size,
                                                                              world=self.world)}
        self.offload_out: dict[str, int] = {}   # layer -> the task copying its saved tensors out

    def all_to_all(self, name: str, nbytes: float, deps) -> int:
        self.comm["ulysses"] += nbytes
        return self.b.add(name, self.sp_lane, self.cost.all_to_all_time(nbytes, self.sp), deps, "comm", nbytes)

    # -- hooks around the compute segments (added in this order: it is the order they run in) --

    def hook_ulysses(self) -> None:
        """Around each attention: q, k, v (3/4 of the bytes) turn from sequence to head shards before it and the
        output (1/4) turns back after it; backward mirrors that (d_out before, dq/dk/dv after)."""
        if self.sp <= 1:
            return
        costs, a2a = self.costs, self.a2a
        phases = (("fw", zip(costs.fw_attention, a2a), ("qkv", 0.75), ("out", 0.25)),
                  ("bw", zip(costs.bw_attention, reversed(a2a)), ("dout", 0.25), ("dqkv", 0.75)))
        for phase, by_pos, (pre, pre_share), (post, post_share) in phases:
            hooks = self.hooks[phase]
            for pos, nbytes in dict(by_pos).items():
                hooks.cuts += [pos, pos + 1]
                hooks.before.setdefault(pos, []).append(self._a2a_hook(f"{phase} a2a {pre} @{pos}", nbytes * pre_share))
                hooks.after.setdefault(pos + 1, []).append(
                    self._a2a_hook(f"{phase} a2a {post} @{pos}", nbytes * post_share))

    def _a2a_hook(self, what: str, nbytes: float):
        """A hook issuing one all-to-all after the task it is given."""
        return lambda dep: [self.all_to_all(what, nbytes, [dep])]

    def hook_offloads(self) -> None:
        """An offloaded layer's saved tensors (a selective_offload one's checkpoints) go out after its forward and
        come back before its backward, through a window of two layers."""
        fw, bw = self.hooks["fw"], self.hooks["bw"]
        offloaded = [lc for lc in self.layers if self.choices[lc.name] in OFFLOADED_CHOICES]
        for j, lc in enumerate(offloaded):
            fw.cuts += [lc.fw_span[0], lc.fw_span[1]]
            bw.cuts += [lc.bw_span[0], lc.bw_span[1]]
            fw.after.setdefault(lc.fw_span[1], []).append(lambda seg, lc=lc: self._copy_out(lc, seg))
            if j >= 2:   # two layers in flight: the layer two offloads later waits for this copy
                fw.before.setdefault(lc.fw_span[0], []).append(
                    lambda prev, name=offloaded[j - 2].name: [self.offload_out.get(name)])
            # the fetch waits until the buffer of the layer two places earlier in backward is free
            gate = ("fw", -1) if j + 2 >= len(offloaded) else ("bw", offloaded[j + 2].bw_span[1])
            bw.before.setdefault(lc.bw_span[0], []).append(lambda prev, lc=lc, gate=gate: self._fetch(lc, gate))

    def _sent(self, lc) -> float:
        """Bytes an offloaded layer moves each way (plan/transfers.py ``offloaded_bytes``, as its list counts)."""
        from ..plan.transfers import offloaded_bytes
        return offloaded_bytes(lc, self.choices[lc.name])

    def _transfer(self, bk, purpose: str):
        """The plan's transfer of ``purpose`` for bucket ``bk`` (plan/transfers.py)."""
        return self.transfers[(bk.index, purpose)]

    def _copy_time(self, lc, direction: str) -> float:
        """An offloaded layer's copy one way: its bytes over the link, and half the runtime's measured work per
        saved tensor (each tensor goes out and comes back on its own; 0 in the GPU profiles)."""
        per_tensor = self.cost.hw.activation_offload_overhead / 2
        tensors = lc.saved_tensors if self.choices[lc.name] == "offload" else 0
        return self.cost.transfer_time(self._sent(lc), direction) + tensors * per_tensor

    def _copy_out(self, lc, seg: int) -> list:
        self.offload_out[lc.name] = self.b.add(f"act out {lc.name}", "d2h", self._copy_time(lc, "d2h"), [seg],
                                               "transfer", self._sent(lc))
        return []

    def _fetch(self, lc, gate: tuple[str, int]) -> list:
        self.fetched[lc.name] = self.b.add(f"act in {lc.name}", "h2d", self._copy_time(lc, "h2d"),
                                           [self.seg_end.get(gate), self.offload_out.get(lc.name)], "transfer",
                                           self._sent(lc))
        return [self.fetched[lc.name]]

    def hook_recomputes(self) -> None:
        """A recomputed (selective) layer runs its forward (less its attention) again just before its backward;
        a selective_offload one after its checkpoints were fetched (its fetch hook runs first)."""
        layer_a2a = self._layer_a2a()
        bw = self.hooks["bw"]
        for lc in self.layers:
            if self.choices[lc.name] not in ("recompute", "selective", "selective_offload"):
                continue
            bw.cuts.append(lc.bw_span[0])
            hooks = bw.before.setdefault(lc.bw_span[0], [])
            again = lambda prev, lc=lc: self._recompute(lc, prev, layer_a2a.get(lc.name))  # noqa: E731
            if self.choices[lc.name] == "selective_offload":
                hooks.append(again)
            else:
                hooks.insert(0, again)

    def _layer_a2a(self) -> dict[str, float]:
        """Layer -> bytes of its forward all-to-alls (under Ulysses; a recompute runs them again)."""
        if self.sp <= 1:
            return {}
        costs = self.costs
        return {lc.name: sum(n for pos, n in zip(costs.fw_attention, self.a2a) if lc.fw_span[0] <= pos < lc.fw_span[1])
                for lc in costs.layers}

    def _recompute(self, lc, prev: int, a2a_bytes: float | None) -> list:
        redo = recompute_time(lc, self.choices[lc.name])
        # a selective_offload layer's recompute reads its fetched checkpoints (its fetch hook ran first)
        rec = self.b.add(f"recompute {lc.name}", "gpu", redo, [prev, self.fetched.get(lc.name)], "compute")
        if a2a_bytes:
            rec = self.all_to_all(f"recompute a2a {lc.name}", a2a_bytes, [rec])
        return [rec]

    # -- forward and backward --

    def phase(self, label: str, times: list[float], uses, extra_cuts: list[int], first_dep: int | None):
        """The compute segments of one phase, with the weight prefetches of flow buckets and the hooks; returns
        (segments, their task ids). Segments start at each flow bucket's first use and at every hook's cut."""
        hooks = self.hooks[label]
        flow_uses = self._flow_uses(uses)
        segs = _segments(times, [u for u, _ in flow_uses] + extra_cuts + hooks.cuts)
        seg_at = {s[0]: i for i, s in enumerate(segs)}
        issue_at = self._issue_points(flow_uses, [s[0] for s in segs])
        used_at: dict[int, list[int]] = {}
        for j, (u, _) in enumerate(flow_uses):
            used_at.setdefault(u, []).append(j)
        seg_ids: list[int] = []
        transfer_ids: dict[int, int] = {}
        seg_task: dict[int, int] = {}
        carry: list[int] = []
        for i, (a, stop, secs) in enumerate(segs):
            for j, gate in issue_at.get(i, ()):
                dep = seg_task.get(seg_at[gate] - 1) if gate is not None and seg_at.get(gate, 0) > 0 else None
                transfer_ids[j] = self._prefetch(label, flow_uses[j][1], dep)
            needs = [transfer_ids[j] for j in used_at.get(a, ())]
            prev = seg_task[i - 1] if i else first_dep
            hooked: list[int] = []
            for hook in hooks.before.get(a, ()):
                hooked += [h for h in hook(prev) if h is not None]
            deps = needs + ([prev] if prev is not None else []) + carry + hooked
            seg_task[i] = self.b.add(f"{label} [{a}:{stop})", "gpu", secs, deps, "compute")
            seg_ids.append(seg_task[i])
            self.seg_end[(label, stop)] = seg_task[i]
            carry = []
            for hook in hooks.after.get(stop, ()):
                carry += [h for h in hook(seg_task[i]) if h is not None]
        if carry:   # a hook after the last segment (e.g. the last all-to-all): the phase ends with it
            seg_ids.append(self.b.add(f"{label} end", "gpu", 0.0, [seg_ids[-1], *carry], "compute"))
        return segs, seg_ids

    def _flow_uses(self, uses) -> list[tuple[int, int]]:
        """(first use, bucket index) of each flow bucket used in the phase, in order of use."""
        def first_use(bk):
            found = [uses[p][0] for p in bk.params if p in uses]
            return min(found) if found else None
        return sorted((u, bk.index) for bk in self.buckets if bk.index in self.flow
                      for u in [first_use(bk)] if u is not None)

    def _issue_points(self, flow_uses, starts: list[int]) -> dict[int, list[tuple[int, int | None]]]:
        """Segment -> the flow transfers issued there, as (j, gate): transfer j is issued at the first segment
        starting at or after its gate (the first use of the flow bucket ``distance`` places earlier: its buffer is
        free then), in j order within a segment."""
        issue_at: dict[int, list[tuple[int, int | None]]] = {}
        for j, (u, idx) in enumerate(flow_uses):
            gate = flow_uses[j - self.distance[idx]][0] if j - self.distance[idx] >= 0 else None
            at = 0 if gate is None else bisect.bisect_left(starts, gate)
            issue_at.setdefault(at, []).append((j, gate))
        return issue_at

    def _prefetch(self, label: str, idx: int, dep: int | None) -> int:
        bk = self.buckets[idx]
        # zero-infinity streams bf16 copies of every bucket; superoffload what the plan's list says
        nbytes = bk.numel * 2 if self.baseline else self._transfer(bk, "flow fetch").nbytes
        # plus the runtime's work per fetch (prefetch, wait, release: 0 in the GPU profiles)
        seconds = self.cost.transfer_time(nbytes, "h2d") + self.cost.hw.weight_fetch_overhead
        return self.b.add(f"{label} prefetch b{idx}", "h2d", seconds, (dep,), "transfer", nbytes)

    # -- the optimizer steps, after each bucket's gradients are ready --

    def optimizer_steps(self, bw_segs, bw_ids: list[int], backward_last: int) -> None:
        """Every CPU-stepped bucket in order (its gradients down, Adam, weights up), then the GPU-resident ones."""
        bw_starts = [a for a, _, _ in bw_segs]

        def ready_after(pos):   # the backward segment that produces position ``pos``
            i = bisect.bisect_right(bw_starts, pos) - 1
            if 0 <= i < len(bw_segs) and bw_segs[i][0] <= pos < bw_segs[i][1]:
                return bw_ids[i]
            return backward_last
        for bk in self.buckets:
            if bk.index not in self.on_device:
                self._host_step(bk, ready_after(bk.ready_position), backward_last)
        for bk in self.buckets:
            if bk.index in self.on_device:
                ready = self._zero_collective("reduce-scatter", bk, ready_after(bk.ready_position))
                # the same runtime work per bucket and gradient tensor as a CPU step (0 in the GPU profiles)
                step = self.b.add(f"gpu adam b{bk.index}", "gpu", self.cost.gpu_adam_time(bk.numel / self.world)
                                  + self.cost.bucket_overhead(len(bk.params)), [backward_last, ready], "adam")
                self._zero_collective("all-gather", bk, step)

    def _zero_collective(self, kind: str, bk, after: int) -> int:
        """A ZeRO ring collective of one bucket (each rank sends (world - 1) / world of it), after ``after``."""
        world = self.world
        if world <= 1:
            return after
        nbytes = bk.numel * self.grad_size * (world - 1) / world
        self.comm["zero"] += nbytes
        return self.b.add(f"{kind} b{bk.index}", self.dp_lane, self.cost.ring_time(nbytes, world), [after], "comm",
                          nbytes)

    def _host_step(self, bk, produced: int, backward_last: int) -> None:
        """One CPU-stepped bucket: its gradient shard reduced and copied down, Adam on it, the weights back up
        (a flow bucket's host copy is streamed next step instead)."""
        shard = bk.numel / self.world
        down = self._grads_down(bk, shard, self._zero_collective("reduce-scatter", bk, produced))
        adam = self._cpu_adam(bk, shard, down, backward_last)
        if bk.index in self.flow:
            self._zero_collective("all-gather", bk, adam)   # every rank's host copy gets the other shards
            return
        self._zero_collective("all-gather", bk, self._weights_up(bk, shard, adam))

    def _grads_down(self, bk, shard: float, ready: int) -> int:
        """The gradient shard to host memory. ZeRO-Offload (DeepSpeed stage 1/2 with offload_optimizer,
        async_inplace_copy_grad_to_fp32_buffer_from_gpu): each gradient is cast to fp32 on the GPU and copied
        into the fp32 host buffer as soon as it is reduced, during backward; the CPU Adam runs after backward."""
        link_bytes = shard * 4 if self.baseline else self._transfer(bk, "gradients").nbytes   # one rank's
        deps = [ready]
        if link_bytes > shard * self.grad_size:   # upcast on the GPU before the copy
            deps = [self.b.add(f"upcast g b{bk.index}", "gpu_aux", self.cost.gpu_cast_time(shard, self.grad_size, 4),
                               [ready], "cast")]
        return self.b.add(f"grads b{bk.index}", "d2h", self.cost.transfer_time(link_bytes, "d2h"), deps, "transfer",
                          link_bytes)

    def _cpu_adam(self, bk, shard: float, down: int, backward_last: int) -> int:
        """Adam on the shard, as the gradients arrive (speculation on) or after backward; the baseline unscales
        first; speculation 'redo' steps again after backward."""
        b, cost, baseline = self.b, self.cost, self.baseline
        after = [down] + ([backward_last] if baseline or self.speculation == "off" else [])
        if baseline:   # unscale_and_clip_grads: fp32 gradients read and written once, before the step
            after = [b.add(f"unscale g b{bk.index}", "cpu", cost.cpu_cast_time(shard, 4, 4), after, "cast")]
        grad_bytes = 4 if baseline else dtype_bytes(bk.link_dtype)
        # here: socompile.plan imports this module
        from ..plan.host_work import adam_kernel_bytes, kernel_elements, kernel_writes_low_copy
        # the kernel's 2-byte weight copy, as the runtime writes it (fp32 weights have none to write)
        writes_copy = (not baseline) and kernel_writes_low_copy(bk, shared_master=False, weight_bytes=self.grad_size)
        # what the kernel steps: its runs, the padding between segments included (as the runtime's ledger books)
        numels = self.costs.param_numels
        elements = (kernel_elements([numels[p] for p in bk.params]) if numels else bk.numel) / self.world
        moment_bytes = 4 if baseline else self.moment_bytes   # ZeRO-Offload keeps fp32 moments
        streamed = sum(adam_kernel_bytes(elements, grad_bytes, writes_copy, moment_bytes))
        tensors = len(bk.params)   # the runtime receives each gradient tensor into the bucket (bucket_overhead)
        seconds = cost.cpu_adam_time(elements, grad_bytes, writes_copy, self.adam_scale, tensors, moment_bytes)
        adam = b.add(f"adam b{bk.index}", "cpu", seconds, after, "adam", streamed)
        if not baseline and self.speculation == "redo":   # rolled back (free: ping-pong) and stepped again
            adam = b.add(f"redo adam b{bk.index}", "cpu", seconds, [adam, backward_last], "adam", streamed)
        return adam

    def _weights_up(self, bk, shard: float, adam: int) -> int:
        """The updated weights back to the device: cast to bf16 on the CPU (baseline: a pass of its own) or on
        the GPU after an fp32 upload, where the plan put the cast."""
        b, cost = self.b, self.cost
        if self.baseline:
            cast = b.add(f"cast p b{bk.index}", "cpu", cost.cpu_cast_time(shard), [adam], "cast")
            return b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(shard * 2, "h2d"), [cast], "transfer",
                         shard * 2)
        upload = self._transfer(bk, "weight upload")
        nbytes = upload.nbytes   # one rank's (plan/transfers.py: a shard under ZeRO)
        up = b.add(f"upload b{bk.index}", "h2d", cost.transfer_time(nbytes, "h2d"), [adam], "transfer", nbytes)
        if dtype_bytes(upload.dtype) <= self.grad_size:   # crossed in the weights' dtype: nothing to cast
            return up
        return b.add(f"cast p b{bk.index}", "gpu_aux", cost.gpu_cast_time(shard), [up], "cast")


def simulate(plan: Plan, costs: GraphCosts, cost: CostModel, schedule: str = "superoffload",
             cpu_lanes: int | None = None, speculation: str = "on") -> SimResult:
    """Replay one step of ``plan`` (or the named baseline schedule on the plan's buckets).

    ``speculation`` (superoffload schedule): "on" - CPU steps start as gradients arrive and validation
    commits them; "off" - CPU steps wait for validation after backward; "redo" - speculated, then validation
    clips, so every speculated CPU step is taken again after backward (the worst case of a clipped step)."""
    if speculation not in ("on", "off", "redo"):
        raise ValueError(f"speculation must be 'on', 'off' or 'redo', got {speculation!r}")
    hw = cost.hw
    # One CPU lane, what the runtime runs (runtime/worker.py) and the faster choice for a bandwidth-bound kernel
    # (docs/planner.md, "CPU lanes"); DeepSpeed's CPU passes (unscale, Adam, cast) likewise use every core in turn.
    lanes = 1 if schedule != "superoffload" else cpu_lanes or 1
    if schedule not in ("superoffload", "zero-offload", "zero-infinity"):
        raise ValueError(f"unknown schedule {schedule!r}")
    step = _Step(plan, costs, cost, schedule, lanes, speculation)
    step.hook_ulysses()
    step.hook_offloads()
    step.hook_recomputes()
    _, fw_ids = step.phase("fw", costs.fw_times, costs.fw_uses, [], None)
    forward_last = fw_ids[-1]
    step.seg_end[("fw", -1)] = forward_last
    ready_cuts = [bk.ready_position + 1 for bk in plan.buckets]
    bw_segs, bw_ids = step.phase("bw", costs.bw_times, costs.bw_uses, ready_cuts, forward_last)
    backward_last = bw_ids[-1]
    step.optimizer_steps(bw_segs, bw_ids, backward_last)
    start, end = replay(step.b.tasks)
    return SimResult(schedule=schedule, step_time=max(end), tasks=step.b.tasks, start=start, end=end,
                     lane_of=[t.lane for t in step.b.tasks], model_flops=costs.fw_flops + costs.bw_flops,
                     peak_flops=hw.device_bf16_flops, forward_end=end[forward_last], backward_end=end[backward_last],
                     cpu_lanes=lanes, comm_bytes=tuple(sorted(step.comm.items())) if step.world > 1 else ())


def recompute_time(lc, choice: str) -> float:
    """Seconds of forward a layer runs again in backward: all of it ("recompute"), all but its attention
    kernels ("selective": their outputs were kept), nothing otherwise."""
    if choice == "recompute":
        return lc.fw_time
    if choice in ("selective", "selective_offload"):
        return max(0.0, lc.fw_time - lc.attention_time)
    return 0.0


def plan_moment_bytes(plan: Plan) -> float:
    """Bytes per Adam moment element of the plan's CPU buckets: 2 for bf16 moments, 1.25 for int8 blocks (with
    their scales), else 4."""
    return dict(plan.predicted).get("moment_bytes", 4)


def plan_grad_dtype_bytes(plan: Plan) -> int:
    value = dict(plan.predicted).get("param_dtype_bytes")
    return int(value) if value else 2


def plan_recompute(plan: Plan) -> bool:
    return getattr(plan, "recompute", "none") != "none"
