"""The passes, as data: one ordered table of every graph rewrite, and the compile hooks.

Each entry says which graph of the pair it rewrites (``phase``), what it ``requires`` (facts about the graphs
that an earlier pass ``provides``, e.g. cast_gradients rewrites the optimizer-step nodes insert_optimizer_steps
inserts) and the invariant the graph checker (check.py) holds it to. Passes run forward first, then backward,
each phase in table order; any can be turned off by name (``options={"disable_passes": [...]}``), and each one's
before/after graphs are recorded for dumps.

A pass has one signature: ``fn(gm, plan, ctx) -> gm``. It applies the plan and decides nothing. A forward pass
that leaves something for its backward pass returns ``(gm, record)`` instead, a frozen dataclass of type
``record``; the backward pass whose ``takes_record_of`` names it is called as ``fn(gm, plan, ctx, record)``
(record None when the forward pass did not run). The records live on ``ctx.pass_records``, by pass name.

A compile hook is ``fn(ctx) -> None``, called once the plan is made (``run_hooks``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx

from ..options import OptionError
from . import activation_offload, cast_gradients, check, insert_optimizer_steps, wait_uploads, weight_flow

PHASES = ("fw", "bw")    # the forward graph's passes run before the backward graph's


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    phase: str                              # "fw" or "bw": which graph of the pair it rewrites
    fn: Callable
    requires: tuple[str, ...] = ()          # facts an earlier pass provides, without which this one is wrong
    provides: tuple[str, ...] = ()          # facts about the rewritten graph later passes may rely on
    invariant: Callable | None = None       # check.py: (ctx, phase, gm) -> problems, checked after every pass
    record: type | None = None              # forward pass: the type of the record it returns beside the graph
    takes_record_of: str | None = None      # backward pass: the forward pass whose record it takes


@dataclasses.dataclass(frozen=True)
class CompileHook:
    name: str
    fn: Callable                            # (ctx) -> None, once the plan is made


def _check_plan_across_ranks(ctx) -> None:
    """Ranks that train together must have planned alike (distributed/plan_check.py); with one process there
    is nothing to compare, and socompile.distributed is not imported."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from ..distributed.plan_check import check_plan_across_ranks
        check_plan_across_ranks(ctx)


PASSES: tuple[Pass, ...] = (
    Pass("insert_optimizer_steps", "bw", insert_optimizer_steps.insert_optimizer_steps,
         provides=("optimizer_steps",), invariant=check.buckets_handed_once),
    Pass("weight_flow_forward", "fw", weight_flow.weight_flow_forward,
         provides=("fetched_weights_forward", "saved_views"), invariant=check.flow_weights_fetched,
         record=weight_flow.SavedViews),
    Pass("weight_flow_backward", "bw", weight_flow.weight_flow_backward,
         provides=("fetched_weights_backward",), invariant=check.flow_weights_fetched,
         takes_record_of="weight_flow_forward"),    # without it, the saved views are read off the forward graph
    Pass("wait_uploads", "fw", wait_uploads.wait_uploads, provides=("upload_waits",)),
    Pass("cast_gradients", "bw", cast_gradients.cast_gradients,
         requires=("optimizer_steps",), provides=("gradient_link_casts",)),
    Pass("activation_offload_forward", "fw", activation_offload.activation_offload_forward,
         provides=("offloaded_activations",), invariant=check.activations_offloaded,
         record=activation_offload.OffloadedActivations),
    Pass("activation_offload_backward", "bw", activation_offload.activation_offload_backward,
         requires=("offloaded_activations",), provides=("fetched_activations",),
         invariant=check.activations_fetched, takes_record_of="activation_offload_forward"),
)

HOOKS: tuple[CompileHook, ...] = (
    CompileHook("check_plan_across_ranks", _check_plan_across_ranks),
)


def known_pass_names() -> list[str]:
    """Every name ``disable_passes`` accepts: the passes, then the hooks."""
    return [p.name for p in PASSES] + [h.name for h in HOOKS]


def run_order(table: tuple[Pass, ...] = PASSES) -> list[Pass]:
    return sorted(table, key=lambda p: PHASES.index(p.phase))   # stable: table order within a phase


def check_requirements(disabled, table: tuple[Pass, ...] = PASSES) -> None:
    """Before any pass runs: every fact an enabled pass requires is provided by an earlier pass, and that pass
    is enabled. A table whose order breaks this is a bug (RuntimeError); ``disable_passes`` turning off a pass
    that an enabled one needs is the user's (OptionError, naming both)."""
    order = run_order(table)
    for position, entry in enumerate(order):
        if entry.name in disabled:
            continue
        for fact in entry.requires:
            providers = [p for p in order[:position] if fact in p.provides]
            if not providers:
                later = [p.name for p in order[position + 1:] if fact in p.provides]
                raise RuntimeError(f"pass {entry.name!r} requires {fact!r}, which no earlier pass provides"
                                   + (f" ({later} provide it only after it runs)" if later else ""))
            if all(p.name in disabled for p in providers):
                names = [p.name for p in providers]
                raise OptionError(f"disable_passes turns off {', '.join(map(repr, names))}, which provides "
                                  f"{fact!r} that pass {entry.name!r} requires: disable {entry.name!r} too, or "
                                  f"keep {names[0]!r}")


def run_passes(gm: fx.GraphModule, phase: str, plan, ctx, table: tuple[Pass, ...] = PASSES) -> fx.GraphModule:
    """Apply the enabled passes of ``phase`` in order; check the graph after each (or after the last), as
    ``ctx.options.check_graphs`` says."""
    disabled = set(ctx.options.disable_passes)  # names checked when the Options were made
    check_requirements(disabled, table)
    mode = ctx.options.check_graphs
    applied: list[Pass] = []
    for entry in (p for p in run_order(table) if p.phase == phase and p.name not in disabled):
        before = gm.code
        gm = _apply(entry, gm, plan, ctx)
        gm.graph.lint()
        gm.recompile()
        if gm.code != before:   # a pass with nothing to apply (e.g. no flow buckets) leaves no dump
            ctx.record_dump(phase, entry.name, before, gm.code, gm)
        applied.append(entry)
        if mode == "each_pass":
            check.check_graph(ctx, phase, gm, applied, f"pass {entry.name!r}")
    if mode == "final" and applied:
        check.check_graph(ctx, phase, gm, applied, f"the {phase} passes {[p.name for p in applied]} (set "
                                                   f"check_graphs='each_pass' to find the one at fault)")
    return gm


def _apply(entry: Pass, gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    if entry.takes_record_of is not None:
        return entry.fn(gm, plan, ctx, ctx.pass_records.get(entry.takes_record_of))
    if entry.record is None:
        return entry.fn(gm, plan, ctx)
    gm, record = entry.fn(gm, plan, ctx)
    if not isinstance(record, entry.record):
        raise TypeError(f"pass {entry.name!r} returned a {type(record).__name__} record, expected "
                        f"{entry.record.__name__}")
    ctx.pass_records[entry.name] = record
    return gm


def graph_problems(ctx, fw: fx.GraphModule | None, bw: fx.GraphModule | None, disabled=()) -> list[str]:
    """Every broken invariant of the rewritten ``fw``/``bw`` graphs (None: not checked) of the passes of the
    table that are not ``disabled``: what the compile checks, for tests and tools."""
    out: list[str] = []
    for phase, gm in (("fw", fw), ("bw", bw)):
        if gm is None:
            continue
        out += [p for e in PASSES if e.phase == phase and e.name not in disabled and e.invariant is not None
                for p in e.invariant(ctx, phase, gm)]
    return out


def run_hooks(ctx) -> None:
    """The compile hooks not turned off by name, once the plan is made."""
    for hook in HOOKS:
        if hook.name not in ctx.options.disable_passes:
            hook.fn(ctx)
