"""Bucketization: group parameters into optimizer buckets in the order backward produces their gradients.

Analysis only: returns the buckets as data; the optimizer-step pass applies them.
"""
from __future__ import annotations

FP32_BYTES = 4
# Each segment of a flat bucket starts at a multiple of ALIGN elements (runtime/flat_bucket.py lays buckets out
# so, and the planner counts the padding): 64 bytes of fp32, a cache line and an AVX-512 vector.
ALIGN = 16


def bucketize(ordered: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Split (name, numel) pairs, already in gradient order, into buckets of about ``bucket_bytes``
    fp32 gradient bytes. A parameter is never split; one larger than a bucket gets a bucket of its own."""
    buckets: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, numel in ordered:
        size = numel * FP32_BYTES
        if current and current_bytes + size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def chunk_elements(numel: int, world: int, block: int = 1) -> int:
    """Elements of each of the ``world`` equal chunks a ZeRO bucket of ``numel`` is cut into: ceil(numel / world),
    rounded up to a multiple of ``block`` (int8 moments: socompile/moment_format.py ``shard_block``). The
    reduce-scatter pads the bucket to ``world`` chunks; the last ranks' windows may be short or empty."""
    chunk = -(-numel // max(1, world))
    return -(-chunk // block) * block


def padded_numel(numels, align: int) -> int:
    """Elements of a flat bucket laid out as runtime/flat_bucket.py does: each segment starts at a multiple
    of ``align`` elements."""
    return sum((n + align - 1) // align * align for n in numels)
