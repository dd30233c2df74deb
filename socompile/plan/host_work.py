"""What the host CPU reads and writes per training step, by purpose: the terms the runtime books and the plan
predicts, from one set of formulas.

Per CPU-stepped bucket, for each pass the optimizer's runtime makes over host memory:

    adam kernel       the fused AdamW pass over the elements the kernel steps (its runs: consecutive segments
                      with a gradient, the padding between them included): reads the fp32 master, the gradient
                      in the landing dtype and both fp32 moments; writes master and moments, and the 2-byte copy
                      of bf16/fp16 weights where the kernel writes it (a separate master whose uploads or fetches
                      read a host-cast copy). 28 B/element with fp32 gradients, 26 with 2-byte ones, +2 with the copy
                      (hardware/profiles.py ADAM_BYTES_*). Twice when a clip redoes a speculated step.
    norm pass         the gradient read once more for the global norm: validation of a bucket whose step was not
                      speculated (``speculate=False``, or speculation held back).
    accumulation add  a micro-batch after the first added into the landing buffer on the host (a separate master:
                      it lands in a stage first): reads both, writes the landing buffer.
    gradient copy     the CPU build only, where the graph's gradients are host tensors: each copied into the
                      landing buffer (the gradient's bytes in, the landing dtype's out); a later micro-batch is
                      an accumulation add instead.
    upload copy       the CPU build only, where the "device" weights are host memory: the updated master copied
                      into the weights of a separate master with fp32 weights (bf16 ones were written by the kernel).

Per CPU-stepped bucket on rank r of W ZeRO ranks, the host path (``shard_layout`` "window": the CPU build): the
kernel steps the rank's window only, the whole gradients land in the state dtype, and a step into the window's
spare writes no 2-byte copy (the commit casts the whole bucket after the all-gather: ``host cast``). Beside:

    reduce copies     the gradients staged into a buffer padded to W chunks (when the bucket is not a multiple of
                      W), the received chunk divided by W, and the rank's shard of it copied into the landing
                      buffer (distributed/zero.py start_reduce, finish_reduce).
    gather copies     the rank's window staged into a chunk for the all-gather and the gathered weights copied into
                      the whole master (zero.py gather).
    spare copy        the commit of a step speculated into the spare exchanges the master's window with the spare's
                      (the model aliases the master, so its buffer stays): three copies of the window. A redone
                      or unspeculated step is taken in place.

Device-side ZeRO (``shard_layout`` "chunk": a separate fp32 master on a CUDA runtime) reduces and gathers on the
device, so no reduce or gather copies: the kernel steps the rank's window of its chunk with the gradients landed
as the device reduced them (bf16 weights: bf16), the commit exchanges the window with the spare's as above, and
2-byte weights are cast on the host from the master chunk into its stage (``host cast`` of the chunk), once per
step, for the upload or the fetches that read it.

What gloo itself reads and writes inside a collective is not booked (its algorithm's, not a pass of ours).

Per step, outside the buckets:

    activation copy   the CPU build only: each saved tensor of an offloaded layer copied into its host buffer in
                      forward and back into a fresh "device" buffer in backward, by the runtime's worker thread
                      (on a GPU these are DMA copies, no CPU work). Its bytes each way are the link traffic's
                      activation terms (plan/transfers.py), so the two ledgers cannot disagree.

``adam_kernel_bytes`` (hardware/cpu_adam.py) and the others are the formulas: the runtime books each pass with
them at the pass (``socompile.AdamW.host_work()``), ``per_step_host_work`` sums them over a plan, and the
simulator's CPU task of a bucket is its ``adam kernel`` bytes at the CPU's Adam bandwidth. Not among these terms
yet: the first step's one-off casts.
"""
from __future__ import annotations

from ..dtypes import dtype_bytes
from ..hardware.cpu_adam import adam_kernel_bytes
from ..ledger_names import ACTIVATION_FETCH, ACTIVATION_OFFLOAD
from ..moment_format import format_of, shard_block
from ..options import OFFLOADED_CHOICES
from .bucket_buffers import BucketStorage, landing_dtype, shard_layout, shard_window
from .bucketize import ALIGN, chunk_elements, padded_numel
from .transfers import per_step_traffic

__all__ = ["adam_kernel_bytes", "bucket_host_work", "kernel_writes_low_copy", "per_step_host_work"]

ADAM_KERNEL = "adam kernel"
NORM_PASS = "norm pass"
ACCUMULATION_ADD = "accumulation add"
UPLOAD_COPY = "upload copy"
SPARE_COPY = "spare copy"
HOST_CAST = "host cast"
INVERSE_STEP = "inverse step"
GRADIENT_COPY = "gradient copy"
ACTIVATION_COPY = "activation copy"
REDUCE_COPIES = "reduce copies"
GATHER_COPIES = "gather copies"
PURPOSES = (ADAM_KERNEL, NORM_PASS, ACCUMULATION_ADD, GRADIENT_COPY, UPLOAD_COPY, SPARE_COPY, HOST_CAST, INVERSE_STEP,
            ACTIVATION_COPY, REDUCE_COPIES, GATHER_COPIES)


def kernel_writes_low_copy(b, *, shared_master: bool, weight_bytes: int) -> bool:
    """Whether the CPU kernel writes the 2-byte weight copy of bucket ``b`` in its pass (FlatBucket.low_out):
    2-byte weights with a separate master, uploaded from a host cast (cast_site "cpu") or fetched (flow)."""
    return (not shared_master) and weight_bytes == 2 and (b.weight_mode == "flow" or b.cast_site == "cpu")


def norm_pass_bytes(elements: int, grad_bytes: int) -> tuple[int, int]:
    return elements * grad_bytes, 0


def add_bytes(elements: int, element_bytes: int) -> tuple[int, int]:
    """``a += b``: both read, one written."""
    return 2 * elements * element_bytes, elements * element_bytes


def copy_bytes(elements: int, src_bytes: int, dst_bytes: int) -> tuple[int, int]:
    return elements * src_bytes, elements * dst_bytes


def kernel_elements(sizes: list[int], align: int = ALIGN) -> int:
    """Elements the kernel steps in a bucket of segments ``sizes`` that all have gradients and share one param
    group and step count: one run from the first segment to the end of the last (the padding between them
    included, the last one's not), as runtime/flat_bucket.py ``runs`` merges them."""
    if not sizes:
        return 0
    return sum(-(-n // align) * align for n in sizes[:-1]) + sizes[-1]


def bucket_host_work(b, sizes: list[int], *, shared_master: bool, weight_bytes: int, validating: bool,
                     speculation: str = "on", micro_batches: int = 1, host_is_device: bool = False,
                     moment_bytes: float = 4, rank: int = 0, world: int = 1,
                     weight_dtype: str = "") -> dict[str, tuple[int, int]]:
    """{purpose: (read, written)} of CPU bucket ``b`` (a BucketPlan; ``sizes``: its parameters' elements) in one
    step. ``speculation``: "on" (stepped as its gradients arrive; a validation that does not clip commits),
    "off" (stepped after backward, or held back by a predicted or certain clip: validation first reads the
    norm), "redo" (speculated, then clipped: stepped again). ``host_is_device``: the CPU build.
    ``moment_bytes``: 4 (fp32 moments), 2 (bf16) or 1.25 (int8 blocks). ``rank`` of ``world``: a ZeRO rank (module doc);
    ``weight_dtype``: the parameters' dtype name (default: bfloat16, float32 or float64 by ``weight_bytes``)."""
    if b.optimizer_site != "cpu":
        return {}
    weight_dtype = weight_dtype or {2: "bfloat16", 4: "float32", 8: "float64"}[weight_bytes]
    # how the runtime cuts the bucket over the ranks: plan/bucket_buffers.py's rule (a CUDA runtime pins a
    # separate master's buffers)
    cut = shard_layout(BucketStorage(separate=not shared_master, weight_dtype=weight_dtype,
                                     pins=not shared_master and not host_is_device), world)
    numel = padded_numel(sizes, ALIGN)
    block = shard_block(format_of(moment_bytes))   # int8 moments: windows of whole blocks
    lo, hi = shard_window(numel, rank, world, block)
    elements = max(0, min(kernel_elements(sizes), hi) - lo)   # the kernel's run, cut to this rank's window
    if cut == "chunk":     # the device reduced the gradients in the weights' dtype
        grad_bytes = dtype_bytes(landing_dtype(weight_dtype, "float32"))
    elif cut == "window":  # the host reduce-scatter sums the whole gradients in the state dtype
        grad_bytes = 4
    else:
        grad_bytes = 4 if shared_master else dtype_bytes(b.link_dtype)
    low_copy = cut == "whole" and kernel_writes_low_copy(b, shared_master=shared_master, weight_bytes=weight_bytes)
    read, written = adam_kernel_bytes(elements, grad_bytes, low_copy, moment_bytes)
    passes = 2 if speculation == "redo" and validating else 1
    out = {ADAM_KERNEL: (read * passes, written * passes)}
    if validating and speculation == "off":
        out[NORM_PASS] = norm_pass_bytes(elements, grad_bytes)
    if host_is_device:   # the first micro-batch's gradients copied in (from the parameters' dtype)
        out[GRADIENT_COPY] = copy_bytes(sum(sizes), weight_bytes, grad_bytes)
    if micro_batches > 1 and cut != "chunk":   # device-side ZeRO accumulates on the device
        r, w = add_bytes(sum(sizes), grad_bytes)
        out[ACCUMULATION_ADD] = (r * (micro_batches - 1), w * (micro_batches - 1))
    if host_is_device and not shared_master and weight_bytes == 4 and b.weight_mode == "stationary":
        out[UPLOAD_COPY] = copy_bytes(numel, 4, 4)   # the whole buffer
    if cut != "whole":
        # a step into the spare is swapped in at its commit; a redone or unspeculated step is taken in place
        out.update(zero_host_work(numel, rank, world, spare_swap=b.rollback == "exact" and speculation == "on",
                                  on_device=cut == "chunk", block=block))
    if cut == "window" and not shared_master and weight_bytes == 2 \
            and not (b.weight_mode == "stationary" and b.cast_site == "device"):
        out[HOST_CAST] = copy_bytes(numel, 4, weight_bytes)   # the whole bucket, after the all-gather
    if cut == "chunk" and weight_bytes == 2:
        out[HOST_CAST] = copy_bytes(chunk_elements(numel, world), 4, weight_bytes)   # the master chunk into its stage
    return out


def _summed(*terms: tuple[int, int]) -> tuple[int, int]:
    return sum(r for r, _ in terms), sum(w for _, w in terms)


def zero_host_work(numel: int, rank: int, world: int, spare_swap: bool, on_device: bool = False,
                   state_bytes: int = 4, block: int = 1) -> dict[str, tuple[int, int]]:
    """The copies ZeRO makes on the host of a bucket of ``numel`` padded elements on ``rank`` of ``world``, per
    step (module doc); ``spare_swap``: the bucket steps into its ping-pong spare and swaps it in; ``on_device``:
    device-side ZeRO, whose collectives and their copies are the device's; ``block``: what a chunk is a
    multiple of (plan/bucket_buffers.py ``zero_block``)."""
    chunk = chunk_elements(numel, world, block)
    lo, hi = shard_window(numel, rank, world, block)
    window, s = hi - lo, state_bytes
    out = {}
    if not on_device:
        staged = [(0, chunk * world * s), copy_bytes(numel, s, s)] if chunk * world != numel else []
        out[REDUCE_COPIES] = _summed(*staged, copy_bytes(chunk, s, s), copy_bytes(window, s, s))
        out[GATHER_COPIES] = _summed((0, chunk * s), copy_bytes(window, s, s), copy_bytes(numel, s, s))
    if spare_swap:
        out[SPARE_COPY] = _summed(*[copy_bytes(window, s, s)] * 3)
    return out


def activation_copy_bytes(traffic: dict) -> int:
    """Bytes of saved activations one step copies each way (offload in forward, fetch in backward): the
    activation terms of the step's link traffic (plan/transfers.py ``per_step_traffic``). On the CPU build a
    copy reads and writes that many bytes."""
    return sum(v for (_, _, purpose), v in traffic.items() if purpose in (ACTIVATION_OFFLOAD, ACTIVATION_FETCH))


def per_step_host_work(plan, ir, layers=None, traffic: dict | None = None, **facts) -> dict[str, tuple[int, int]]:
    """{purpose: (read, written)} of one step of ``plan``, summed over its buckets (``bucket_host_work``'s
    keyword arguments in ``facts``), in the keys of ``socompile.AdamW.host_work()``; on the CPU build
    (``host_is_device``) with the activation copies of the layers it offloads, taken from the step's link
    ``traffic`` (``per_step_traffic`` at the same micro-batches; computed here when not given, from ``layers``:
    perf/analysis.py LayerCosts, analysed at the trace shapes when not given)."""
    total: dict[str, tuple[int, int]] = {}
    if facts.get("host_is_device") and any(c in OFFLOADED_CHOICES for _, c in plan.activations):
        if traffic is None:
            traffic = per_step_traffic(plan, ir, facts.get("micro_batches", 1), layers=layers)
        moved = activation_copy_bytes(traffic)
        if moved:
            total[ACTIVATION_COPY] = (moved, moved)
    for b in plan.buckets:
        sizes = [int(ir.params[p].numel) for p in b.params]
        for purpose, (r, w) in bucket_host_work(b, sizes, **facts).items():
            tr, tw = total.get(purpose, (0, 0))
            total[purpose] = (tr + r, tw + w)
    return {k: v for k, v in total.items() if v != (0, 0)}
