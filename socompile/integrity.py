"""Checksums and value checks that let a checkpoint prove it holds what was written.

Neither ``torch.save`` nor torch.distributed.checkpoint verifies anything on load: a flipped bit in a tensor's
bytes comes back as a wrong value. ``socompile.save`` therefore records, per tensor, the crc32 of its bytes
(with its dtype and shape), and ``socompile.load`` recomputes and compares them before anything is loaded.

Why crc32: it detects every burst error up to 32 bits and any other corruption with probability 1 - 2^-32, which is
what disks, copies and transfers do; it is not a defence against someone who edits the file on purpose (they
can recompute it). Measured on a 100 MB fp32 tensor (one core of the 2-core CI machine): zlib.crc32 2.7 GB/s,
adler32 2.7, sha256 1.6, sha1 1.7, blake2b 0.7, md5 0.5; ``torch.save`` itself wrote 0.9 GB/s to memory.
zlib releases the GIL, so tensors are hashed on a thread pool (one tensor per task). A 25B-parameter checkpoint
(bf16 weights, fp32 master and moments: 14 bytes per parameter, 350 GB) costs 350 GB / (2.7 GB/s x threads)
extra at save and again at load: about 16 s on 8 cores, 130 s on one, next to the minutes the disk takes.

Value checks use ``torch.aminmax`` (one pass, NaN propagates into both ends; 11 GB/s measured), so a finite
check of 200 GB of moments costs about 20 s.
"""
from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch

ALGORITHM = "crc32"
_MAX_THREADS = 8


def checksum(tensor: torch.Tensor) -> int:
    """crc32 of the tensor's elements as laid out contiguously on the CPU (any dtype: read as bytes)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def tensors_in(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts/lists/tuples with a readable name: ``optimizer.state[3].exp_avg``,
    ``model.layers.0.attn.wq.weight``."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors_in(value, f"{prefix}.{key}" if isinstance(key, str) else f"{prefix}[{key!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensors_in(value, f"{prefix}[{i}]")


def records(tree: dict) -> dict[str, dict]:
    """``{name: {"crc32", "dtype", "shape"}}`` for every tensor under the top-level entries of ``tree``."""
    named = [item for key, value in tree.items() for item in tensors_in(value, key)]
    sums = _in_parallel(checksum, [tensor for _, tensor in named])
    return {name: {ALGORITHM: value, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
            for (name, tensor), value in zip(named, sums)}


def verify(source: str, tree: dict, saved: dict[str, dict]) -> None:
    """Raise RuntimeError naming the first tensor of ``tree`` that differs from its saved record, or a
    tensor / record present on one side only."""
    found = dict(item for key, value in tree.items() for item in tensors_in(value, key))
    missing = [name for name in saved if name not in found]
    if missing:
        raise RuntimeError(f"{source} is not complete: {_listed(missing)} has a checksum but is not in the file "
                           "(the file was cut short or edited). Load an earlier checkpoint.")
    unrecorded = [name for name in found if name not in saved]
    if unrecorded:
        raise RuntimeError(f"{source} is corrupt: {_listed(unrecorded)} has no checksum (the file was edited "
                           "after it was written). Load an earlier checkpoint, or re-save from the process "
                           "that has the right values.")
    for name, tensor in found.items():
        want = saved[name]
        if want.get("dtype") != str(tensor.dtype) or list(want.get("shape", ())) != list(tensor.shape):
            raise RuntimeError(f"{source} is corrupt: {name} is {tensor.dtype} {list(tensor.shape)}, but was "
                               f"saved as {want.get('dtype')} {want.get('shape')}. Load an earlier checkpoint.")
    sums = _in_parallel(checksum, list(found.values()))
    for name, value in zip(found, sums):
        written = saved[name].get(ALGORITHM)
        if value != written:
            written = f"{written:#010x}" if isinstance(written, int) else repr(written)
            raise RuntimeError(f"{source} is corrupt: the bytes of {name} do not match the checksum written at "
                               f"save ({ALGORITHM} {written} saved, {value:#010x} read): "
                               "they changed on disk or in a copy. Load an earlier checkpoint, or copy this one "
                               "again from where it was written.")


def bad_values(tensor: torch.Tensor, nonnegative: bool = False) -> str | None:
    """What is wrong with the values of a floating tensor (None: finite, and >= 0 when asked)."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return None
    real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    low, high = torch.aminmax(real.detach())
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)) and (not nonnegative or bool(low >= 0)):
        return None
    flat = real.detach().reshape(-1)
    not_finite = int((~torch.isfinite(flat)).sum())
    if not_finite:
        first = int((~torch.isfinite(flat)).nonzero()[0])
        return f"has {not_finite} non-finite element(s) (first at flat index {first}: {flat[first].item()})"
    negative = int((flat < 0).sum())
    first = int((flat < 0).nonzero()[0])
    return f"has {negative} negative element(s) (first at flat index {first}: {flat[first].item():.3g})"


def is_step_count(step) -> bool:
    """A finite, non-negative integer value (a number or a one-element tensor)."""
    try:
        value = float(step)
    except (TypeError, ValueError, RuntimeError):   # not a number, or a tensor of several elements
        return False
    return math.isfinite(value) and value >= 0 and value == int(value)


def _in_parallel(function, items: list) -> list:
    if len(items) < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(_MAX_THREADS, os.cpu_count() or 1, len(items))) as pool:
        return list(pool.map(function, items))


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" (and {len(names) - most} more)" if len(names) > most else "")
