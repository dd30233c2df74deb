"""What a step holds on the device beside its activations and resident weights, node by node: the weight-flow
buffers (live from prefetch to release, plan/flow_schedule.py) and the backward's gradient tensors (live from the
node that makes one until the graph lets its bucket's gradients go). Their peaks fall at different places (a
dominant embedding's flow buffer in the forward, its gradient at the end of the backward), so the floor of a plan
is the peak of their sum over the step, not the sum of their peaks.

Where the graph lets a bucket's gradients go (passes/insert_optimizer_steps.py): its ``bucket_grads_ready`` sits
after the plan's ``ready_after`` node; where gradients cross to the host asynchronously (CUDA, the emulated
runtime) they are kept until ``grads_copied``, placed right after the next bucket's ``bucket_grads_ready`` in
graph order (before the output for the last). A plan serves every runtime, so this counts the longer of the two
(on the CPU runtime a bucket's gradients go one bucket earlier).
"""
from __future__ import annotations

import dataclasses

from ..capture.ir import IR
from ..dtypes import dtype_bytes
from .bucketize import ALIGN, chunk_elements, padded_numel
from .flow_schedule import PHASES, bucket_flow_schedule

# Order of events at one node: fetches and waits before it, the tensor it makes, releases after it.
BEFORE, MADE, AFTER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """The peak of flow buffers + gradient tensors over the step, and what is live there."""
    total: int                      # bytes at the joint peak
    flow_peak: int                  # the flow buffers' own peak (what the runtime's ledger books, anywhere)
    phase: str = ""                 # "forward" / "backward" at the joint peak ("" when nothing is held)
    node: str = ""                  # the IR node at the joint peak
    fetched: tuple = ()             # (bucket index, bytes) of flow buffers live there
    gradients: tuple = ()           # (bucket index, bytes) of gradient tensors live there


def ready_sequence(buckets) -> list:
    """Buckets in the graph order of their ``bucket_grads_ready`` calls: by ready position; calls sharing an
    anchor are each inserted right after it, so the later bucket comes first."""
    return sorted(buckets, key=lambda b: (b.ready_position, -b.index))


def gradient_release(buckets) -> dict[int, int | None]:
    """Bucket index -> backward position after which its gradient tensors are gone (None: at the output)."""
    sequence = ready_sequence(buckets)
    return {b.index: (nxt.ready_position if nxt is not None else None)
            for b, nxt in zip(sequence, [*sequence[1:], None])}


def gradient_element_bytes(bucket, weight_bytes: int) -> int:
    """Bytes per element of a bucket's gradient tensors in the graph: the weights' dtype, or the wider link
    dtype a CPU bucket's gradients are cast to on the device before they cross."""
    if bucket.optimizer_site == "cpu":
        return max(weight_bytes, dtype_bytes(bucket.link_dtype))
    return weight_bytes


def _made_at(ir: IR, param: str) -> int:
    """Backward position of the node that allocates ``param``'s gradient (a Linear's is t(mm(...)): the mm)."""
    g = ir.graph
    key = ir.grad_node[param]
    while g.nodes[key]["is_view"]:
        preds = [p for p in g.predecessors(key) if p.startswith("bw:")]
        if not preds:
            break
        key = preds[0]
    return g.nodes[key]["order"]


def _events(buckets, ir: IR, weight_bytes: int, flow_bytes: dict[int, int], spans_cache: dict | None,
            partials=()):
    """{phase: [(position, sub-order, delta, kind, bucket)]} of the flow buffers and gradient tensors (partial
    gradients too: GraphCosts.partial_gradients, booked to their parameter's bucket)."""
    out = {phase: [] for phase, _ in PHASES}
    for phase, actions in bucket_flow_schedule(buckets, ir, spans_cache).items():
        for a in actions:
            if a.kind == "wait":
                continue
            pos = ir.graph.nodes[a.anchor]["order"]
            delta = flow_bytes[a.bucket] if a.kind == "prefetch" else -flow_bytes[a.bucket]
            out[phase].append((pos, BEFORE if a.where == "before" else AFTER, delta, "fetched", a.bucket))
    end = len(ir.bw_order)
    release = gradient_release(buckets)
    for b in buckets:
        elt = gradient_element_bytes(b, weight_bytes)
        nbytes = 0
        for p in b.params:
            if p in ir.grad_node:
                n = ir.params[p].numel * elt
                nbytes += n
                out["bw"].append((_made_at(ir, p), MADE, n, "gradients", b.index))
        gone = release[b.index]
        out["bw"].append((end if gone is None else gone, AFTER, -nbytes, "gradients", b.index))
    bucket_of = {p: b.index for b in buckets for p in b.params}
    for param, made, last, nbytes in partials:
        if param in bucket_of:
            out["bw"] += [(made, MADE, nbytes, "gradients", bucket_of[param]),
                          (last, AFTER, -nbytes, "gradients", bucket_of[param])]
    return out


def flow_bytes_of(buckets, ir: IR, align: int = ALIGN, world: int = 1) -> dict[int, int]:
    """Bytes of each flow bucket's fetched buffer, as the runtime allocates it (padded segments, the link dtype;
    device-side ZeRO fetches windows of W equal chunks)."""
    out = {}
    for b in buckets:
        if b.weight_mode == "flow":
            n = padded_numel([ir.params[p].numel for p in b.params], align)
            out[b.index] = (n if world <= 1 else chunk_elements(n, world) * world) * dtype_bytes(b.param_link_dtype)
    return out


def step_peak(buckets, ir: IR, weight_bytes: int, spans_cache: dict | None = None, world: int = 1,
              partials=()) -> StepPeak:
    """The peak of flow buffers + gradient tensors over the forward and backward of ``buckets``; ``partials``:
    GraphCosts.partial_gradients."""
    flow_bytes = flow_bytes_of(buckets, ir, world=world)
    best = StepPeak(0, 0)
    flow_peak = 0
    for phase, events in _events(buckets, ir, weight_bytes, flow_bytes, spans_cache, partials).items():
        live: dict[tuple[str, int], int] = {}
        total = flow = 0
        order = ir.fw_order if phase == "fw" else ir.bw_order
        for pos, _, delta, kind, bucket in sorted(events, key=lambda e: (e[0], e[1])):
            live[(kind, bucket)] = live.get((kind, bucket), 0) + delta
            total += delta
            if kind == "fetched":
                flow += delta
                flow_peak = max(flow_peak, flow)
            if delta > 0 and total > best.total:
                held = sorted(((k, b), v) for (k, b), v in live.items() if v > 0)
                best = StepPeak(total, 0, dict(PHASES)[phase], order[min(pos, len(order) - 1)],
                                tuple((b, v) for (k, b), v in held if k == "fetched"),
                                tuple((b, v) for (k, b), v in held if k == "gradients"))
    return dataclasses.replace(best, flow_peak=flow_peak)
