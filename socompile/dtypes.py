"""The dtype names a Plan records (``BucketPlan.link_dtype``, ``param_link_dtype``: the precision of what
crosses the link), their element sizes and their torch dtypes: one table for the planner, the passes and the
runtime."""
from __future__ import annotations

from types import MappingProxyType

import torch

TORCH_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
HALF = ("bfloat16", "float16")   # the 2-byte names


def dtype_bytes(name: str) -> int:
    """Bytes per element: 2 for a half-precision name, else 4 (the only other name a plan records is float32)."""
    return 2 if name in HALF else 4


def dtype_name(nbytes: int) -> str:
    """The name a plan records for an element size: 2 bytes -> 'bfloat16', else 'float32'."""
    return "bfloat16" if nbytes == 2 else "float32"


def gradient_link_name(weights: str) -> str:
    """The dtype in which the gradients of ``weights`` (a name above) cross the link and land in host memory by
    default: bf16 weights' as bf16 (the CPU kernel reads bf16 gradients directly, half the bytes); any other
    weights' as float32. The kernel (socompile_ext) reads fp32 or bf16 gradients, not fp16: fp16 gradients
    (loss-scaled) are cast to fp32 on the device before the copy, which is exact, where bf16 would drop three of
    their mantissa bits and a host-side cast would need a pass over them (4 B/param cross instead of 2)."""
    return "bfloat16" if weights == "bfloat16" else "float32"


def weights_name(dtypes) -> str:
    """The name a plan uses for weights of torch ``dtypes`` ("torch.float16", ... or names): float16 when all
    are fp16, else the name of their common size (2 bytes: bfloat16)."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    if names and all(n == "float16" for n in names):
        return "float16"
    return dtype_name(2 if names and all(n in HALF for n in names) else 4)
