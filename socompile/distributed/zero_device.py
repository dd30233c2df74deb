"""The collectives of device-side ZeRO (runtime/sharded_bucket.py), and where host tensors may go.

A bucket with ``device_shard`` (a separate host master on a CUDA runtime, real or emulated) is reduced and gathered
on the device: ``start`` issues the reduce-scatter of its flat device gradients (the weights' dtype, bf16 for a bf16
model), ``finish`` waits for it and lands this rank's averaged shard in host memory, ``publish`` uploads the updated
shard and all-gathers the device weights. All three are called by socompile.distributed.zero.ZeroSharding, so the
issue order (the NOTE there) is the same as for host buckets: reduce-scatters from the training thread in graph
order, all-gathers in ``step()`` in bucket order.

NOTE: where the landing runs. gloo's ``wait`` blocks the calling thread until the data is there, so the CPU worker
waits and lands the shard (the training thread goes on with backward). NCCL's ``wait`` only makes the calling
thread's current CUDA stream wait, so with NCCL the training thread lands the shard right after issuing the
reduce-scatter (``stream_ordered``): the averaging and the D2H copy are queued behind the collective, no host
block, and the worker waits for the copy's event (``FlatBucket.wait_grads``).

Host tensors (the norm all-reduce, the initial broadcast, a re-layout's gathers) go to gloo as they are; a group
whose backend takes device tensors only (NCCL) gets a device copy (``staged``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .faults import guard
from .zero_gather import PendingGather


def takes_host_tensors(group) -> bool:
    """The group's backend can run collectives on CPU tensors (gloo, or "cpu:gloo,cuda:nccl")."""
    return "gloo" in str(dist.get_backend(group)).lower()


def stream_ordered(group) -> bool:
    """``wait`` on this group's work orders the current stream instead of blocking the thread (NCCL only)."""
    return not takes_host_tensors(group)


@contextlib.contextmanager
def staged(tensor: torch.Tensor, group):
    """``tensor`` as the group's collectives take it: itself for a backend that takes host tensors, else a copy
    on the rank's current GPU, copied back into ``tensor`` when the block ends."""
    if tensor.device.type != "cpu" or takes_host_tensors(group):
        yield tensor
        return
    on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    yield on_device
    tensor.copy_(on_device)


def start(sharding, bucket) -> object | None:
    """Issue the reduce-scatter (sum) of the bucket's device gradients; returns its work (None once landed:
    stream-ordered backends land at once, see the NOTE)."""
    shard = bucket.device_shard
    shard.wait_gathered()   # the weights' all-gather reads the shard buffer this writes (done by now: forward)
    with guard(f"reduce-scatter of bucket {bucket.index} (device)", sharding.group):
        work = dist.reduce_scatter_tensor(shard.reduce_output(), shard.grads, op=dist.ReduceOp.SUM,
                                          group=sharding.group, async_op=True)
    nbytes = shard.grads.numel() * shard.grads.element_size()
    sharding.stats.reduce_scatter_bytes += nbytes
    sharding.stats.sent_bytes += sharding.ring_bytes(nbytes)
    if sharding.stream_ordered:
        work.wait()
        shard.land(bucket)
        shard.release_grads()   # stream-ordered: the allocator reuses it after the collective (record_stream)
        return None
    shard.pool.reducing(work, shard, bucket)   # landed and freed once done (ZeroPool.settle, finish)
    return work


def finish(bucket, work, group) -> None:
    """Wait for the reduce-scatter (gloo: blocks this thread) and land the averaged shard in host memory; then
    wait for that copy, so the CPU kernel may read ``bucket.grad``."""
    if work is not None:   # lands it, unless the training thread did (ZeroPool.settle)
        with guard(f"reduce-scatter of bucket {bucket.index} (device, wait)", group):
            bucket.device_shard.wait_reduced()
    bucket.wait_grads()


def publish(sharding, bucket) -> None:
    """The updated master shard up (cast to the weights' dtype) and the all-gather of the device weights from
    every rank's shard, in the weights' dtype, issued (async): the first reader of the weights waits for it
    (``DeviceShard.wait_gathered``; distributed/zero_gather.py), so it overlaps the next forward."""
    shard = bucket.device_shard
    if shard.flow:   # no device weights to update: the next fetch uploads the new shard and gathers the window
        shard.refresh_window(bucket)
        return
    shard.upload_shard(bucket)   # waits for the previous all-gather first: it read the shard buffer
    with guard(f"all-gather of bucket {bucket.index} (device)", sharding.group):
        work = dist.all_gather_into_tensor(bucket.weights, shard.shard_buffer, group=sharding.group, async_op=True)
    shard.gathering(PendingGather(work, bucket.index, sharding.group))
    nbytes = bucket.weights.numel() * bucket.weights.element_size()
    sharding.stats.all_gather_bytes += nbytes
    sharding.stats.sent_bytes += sharding.ring_bytes(nbytes)


def fetch_window(sharding, bucket, window: torch.Tensor):
    """A flow bucket's fetch (runtime/offload.py prefetch): this rank's shard up into its chunk of ``window``
    (``padded`` elements), then the all-gather of the window in place, issued now (the training thread, in graph
    order: every rank fetches the same buckets in the same order). Returns what the fetch's wait calls: gloo blocks
    until the window is whole; NCCL orders the compute stream after the collective."""
    shard = bucket.device_shard
    mine, event = shard.upload_into(bucket, window)
    shard.runtime.wait_on_compute(event)
    if not sharding.stream_ordered:
        event.synchronize()   # gloo reads the chunk from this process's memory, on its own threads
    with guard(f"all-gather of bucket {bucket.index}'s weights (fetch)", sharding.group):
        work = dist.all_gather_into_tensor(window, mine, group=sharding.group, async_op=True)
    nbytes = window.numel() * window.element_size()
    sharding.stats.all_gather_bytes += nbytes
    sharding.stats.sent_bytes += sharding.ring_bytes(nbytes)

    def wait() -> None:
        with guard(f"all-gather of bucket {bucket.index}'s weights (fetch, wait)", sharding.group):
            work.wait()
    return wait


def gather_whole(sharding, bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's master and moments of a device-sharded bucket, whole (host tensors of ``padded`` elements):
    a new bucket layout adopts from them (ZeroSharding.unshard_state)."""
    shard = bucket.device_shard
    out = []
    for name, mine in (("master", bucket.master), ("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)):
        whole = torch.empty(shard.padded, dtype=mine.dtype)
        with staged(whole, sharding.group) as dst, staged(mine.clone(), sharding.group) as src, \
                guard(f"all-gather of bucket {bucket.index}'s {name} (re-layout)", sharding.group):
            dist.all_gather_into_tensor(dst, src, group=sharding.group)
        out.append(whole)
    return tuple(out)
