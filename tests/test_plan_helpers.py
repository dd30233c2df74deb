"""Shared builders for the planner tests: one traced IR per model, reused (tracing costs seconds)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from socompile.options import Options
from socompile.hardware import GB, PROFILES


@functools.lru_cache(maxsize=None)
def traced(model: str = "tiny", batch: int = 2, seq: int = 64, bf16: bool = False, symbolic: bool = False):
    """(ir) of a preset traced under FakeTensorMode; cached per process."""
    from socompile.offline import plan_model
    ctx = plan_model(model, batch=batch, seq=seq, options={"target": "gh200"},
                     dtype=torch.bfloat16 if bf16 else None, symbolic=symbolic, run_passes=False)
    return ctx.ir


def profile(base: str = "gh200", **changes):
    return dataclasses.replace(PROFILES[base], **changes)


def options(**kw) -> Options:
    kw.setdefault("bucket_size", "64KB")
    return Options(**kw)


__all__ = ["GB", "options", "profile", "traced"]
