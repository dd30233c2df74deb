"""The pass registry: every graph rewrite is registered by name, runs in a fixed order, can be turned off by
name (``options={"disable_passes": [...]}``), and has its before/after graphs recorded for dumps.

A pass has one signature: ``fn(gm: GraphModule, plan: Plan, ctx: CompileContext) -> GraphModule``.
It applies the plan and decides nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx


@dataclasses.dataclass(frozen=True)
class RegisteredPass:
    name: str
    phase: str            # "fw" or "bw": which graph of the pair it rewrites
    fn: Callable


PASSES: tuple[RegisteredPass, ...] = ()   # filled below by register(); order of registration = order of runs


def register(name: str, phase: str):
    def wrap(fn):
        global PASSES
        if any(p.name == name for p in PASSES):
            raise ValueError(f"pass {name!r} registered twice")
        PASSES = PASSES + (RegisteredPass(name, phase, fn),)
        return fn
    return wrap


def known_pass_names() -> list[str]:
    return [p.name for p in PASSES]


def run_passes(gm: fx.GraphModule, phase: str, plan, ctx) -> fx.GraphModule:
    disabled = set(ctx.options.disable_passes)  # names checked when the Options were made
    for registered in PASSES:
        if registered.phase != phase or registered.name in disabled:
            continue
        before = gm.code
        gm = registered.fn(gm, plan, ctx)
        gm.graph.lint()
        gm.recompile()
        if gm.code != before:   # a pass with nothing to apply (e.g. no flow buckets) leaves no dump
            ctx.record_dump(phase, registered.name, before, gm.code, gm)
    return gm
