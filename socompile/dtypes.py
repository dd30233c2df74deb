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
