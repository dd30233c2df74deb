"""One compile, start to end: the steps both the backend and offline planning run, in this order.

    capture             the two graphs and the parameters -> IR                       capture/
    plan                plan(ir, profile, options), exactly once per compile            plan/
    activation layout   layers planned "recompute"/"selective": tag the joint graph,    passes/activations.py
                        partition it again, rebuild the IR, re-anchor the plan on it    plan/anchor.py
    compile hooks       e.g. every rank planned alike (run with or without an optimizer) passes/table.py HOOKS
    bucket layout       the optimizer claims the plan's buckets; the offload runtime    optim/, runtime/
                        (and, when layers offload, the activation-offload runtime) is bound to them
    passes              rewrite the graphs as the plan says, in the table's order        passes/table.py
    checks              the graph checker after every pass (options.check_graphs)        passes/check.py
    dumps               trace artifacts, dump_dir                                       report/

``compile_partitioned`` is the partition hook's pipeline (backend.py calls it with AOTAutograd's two graphs and
the joint graph to partition again); ``plan_traced`` is offline planning's (offline.py: graphs traced under
FakeTensorMode, no optimizer, no joint graph, so no activation layout and no bucket layout).

The planner decides, the later steps apply: nothing after ``plan_once`` plans again or picks a number of its own
(the activation-offload prefetch distance is the plan's, ``Plan.activation_prefetch_ahead``).
"""
from __future__ import annotations

import logging
import weakref

from torch import fx

from .context import CompileContext
from .moment_format import format_of
from .logs import artifact, timed

log = logging.getLogger("socompile")

Graphs = tuple[fx.GraphModule, fx.GraphModule]


# ------------------------------------------------------------------------------------------------- drivers
def compile_partitioned(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule, joint=None) -> Graphs:
    """The pipeline of a live compile, run from the partitioner hook. ``joint``: the partitioner call to repeat on
    the joint graph (passes/activations.Repartition); returns the graphs AOTAutograd compiles."""
    ctx.forward_graph, ctx.backward_graph = fw, bw
    if not ctx.param_names:   # a parameter-free piece of a split region: nothing to plan
        return fw, bw
    infos = _describe_params(ctx)
    capture(ctx, fw, bw, infos)
    plan_once(ctx)
    fw, bw = lay_out_activations(ctx, fw, bw, infos, joint)
    emit_plan(ctx)
    run_compile_hooks(ctx)   # e.g. ranks must have planned alike (distributed runs), optimizer or not
    if ctx.optimizer is not None and ctx.plan.buckets:
        from torch.utils._python_dispatch import _disable_current_modes
        # The partitioner runs under AOTAutograd's fake mode, but the buckets and runtime buffers are real memory
        # and passes may talk to other ranks: run them with no mode active (passes enter the fake mode themselves
        # to give new nodes their fake values).
        with _disable_current_modes():
            lay_out_buckets(ctx)
            fw, bw = apply_passes(ctx, fw, bw)
        emit_pass_graphs(ctx)
    write_dumps(ctx)
    log.info("socompile: planned %d bucket(s) for target %s", len(ctx.plan.buckets), ctx.plan.target)
    return fw, bw


def plan_traced(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule, infos, symbol_names: dict[str, str],
                run_passes: bool) -> None:
    """The pipeline of offline planning (offline.plan_model): capture and plan; with ``run_passes``, the
    backward's passes, for reading (no optimizer: claim -1, no runtime bound, the forward's passes, which need a
    runtime, do not run). No joint graph, so layers planned "recompute" are not re-partitioned: the plan stays
    on the traced graphs."""
    ctx.forward_graph, ctx.backward_graph = fw, bw
    ctx.param_names = {p.input_index: p.name for p in infos}
    capture(ctx, fw, bw, infos, symbol_names)
    plan_once(ctx)
    if run_passes:
        from . import passes
        passes.run_passes(bw, "bw", ctx.plan, ctx)


# --------------------------------------------------------------------------------------------------- steps
def _describe_params(ctx: CompileContext) -> list:
    from .capture import describe
    return [describe(i, name, ctx.param_objects[i], optimized=ctx.optimizer is not None)
            for i, name in ctx.param_names.items()]


def capture(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule, infos,
            symbol_names: dict[str, str] | None = None) -> None:
    """The IR of the two graphs (``symbol_names``: readable names of symbolic sizes, offline)."""
    from .capture.ir import build_ir
    with timed("capture"):
        ctx.ir = build_ir(fw, bw, infos)
        if symbol_names is not None:
            ctx.ir.symbol_names = symbol_names


def plan_once(ctx: CompileContext) -> None:
    """The plan of this compile: every decision, the per-layer activations (options.activation_layers pins some)
    and every prefetch distance included. The only call of the planner in a compile."""
    from .calibrate import profile_for_target
    from .plan.planner import plan_with_details
    with timed("plan"):
        ctx.plan_details = plan_with_details(ctx.ir, profile_for_target(ctx.options.target), planning_options(ctx))
        ctx.plan = ctx.plan_details.plan


def planning_options(ctx: CompileContext):
    """The options the planner sees: ``clipping``, ``host_master`` and ``moment_dtype`` left unset are the owning
    optimizer's (max_grad_norm set or not; its resolved host_master; its moment_dtype), and runtime "auto" the
    runtime this compile resolves it to, so the plan optimises and counts the step that will run (the host
    layout it counts depends on the runtime: plan/rollback.py ``host_layout``)."""
    import dataclasses
    if ctx.optimizer is None:
        return ctx.options
    facts = {}
    if ctx.options.runtime == "auto":
        from .runtime.device import resolve_runtime
        facts["runtime"] = resolve_runtime("auto")
    if ctx.options.clipping is None:
        facts["clipping"] = getattr(ctx.optimizer, "max_grad_norm", None) is not None
    if ctx.options.host_master is None and getattr(ctx.optimizer, "host_master", None) in ("shared", "separate"):
        facts["host_master"] = ctx.optimizer.host_master
    if ctx.options.moment_dtype is None and getattr(ctx.optimizer, "moment_dtype", None) is not None:
        facts["moment_dtype"] = str(ctx.optimizer.moment_dtype).removeprefix("torch.")
    return dataclasses.replace(ctx.options, **facts) if facts else ctx.options


def lay_out_activations(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule, infos, joint) -> Graphs:
    """Layers the plan recomputes are tagged in the joint graph, which is partitioned again; the IR is rebuilt
    from the new graphs and the plan re-anchored on it (not made again: plan/anchor.py says why)."""
    from .passes import activations
    _warn_offload_without_passes(ctx)
    recompute, selective = activations.recomputed_layers(ctx.plan.activations)
    if not recompute:
        return fw, bw
    if joint is None:
        log.warning("socompile: layers %s are planned to recompute their activations but this compile has no "
                    "joint graph to partition again; their activations are kept", ", ".join(recompute))
        return fw, bw
    from .capture.ir import build_ir
    from .plan.anchor import anchored
    with timed("activations"):
        before_fw, before_bw = fw.code, bw.code
        fw, bw, counts = activations.repartition(joint, recompute, selective)
        ctx.ir = build_ir(fw, bw, infos)
        ctx.plan = anchored(ctx.plan, ctx.ir)
    ctx.forward_graph, ctx.backward_graph = fw, bw
    ctx.record_dump("fw", activations.RECOMPUTE_NAME, before_fw, fw.code, fw)
    ctx.record_dump("bw", activations.RECOMPUTE_NAME, before_bw, bw.code, bw)
    ctx.activation_recomputed = counts
    log.info("socompile: recompute activations of %d layer(s) in backward (%d selective: attention kept; %d "
             "forward nodes tagged)", len(recompute), len(selective), sum(counts.values()))
    return fw, bw


def _warn_offload_without_passes(ctx: CompileContext) -> None:
    from .options import OFFLOADED_CHOICES as OFFLOADED
    offload = [layer for layer, choice in ctx.plan.activations if choice in OFFLOADED]
    if offload and (ctx.optimizer is None or not ctx.plan.buckets):
        log.warning("socompile: layers %s are planned to offload their activations, but the passes run only for "
                    "parameters of a socompile.AdamW; their activations are kept", ", ".join(offload))


def lay_out_buckets(ctx: CompileContext) -> None:
    """The optimizer claims the plan's buckets (flat buffers; parameters become views of them) and the runtimes
    that serve them are bound."""
    by_name = {name: ctx.param_objects[i] for i, name in ctx.param_names.items()}
    buckets = ctx.plan.buckets
    _check_moment_format(ctx)
    # On a CPU-only machine the "device" is the CPU: device-site buckets use the same kernel, but (as on a GPU)
    # only after validation, in opt.step(); CPU-site buckets are stepped as their gradients arrive.
    claim = ctx.optimizer.claim([[by_name[n] for n in b.params] for b in buckets],
                                early_step=[b.optimizer_site == "cpu" and ctx.options.speculate for b in buckets],
                                rollback=["inverse" if b.rollback == "inverse" else "pingpong" for b in buckets],
                                sites=[b.optimizer_site for b in buckets],
                                weight_modes=[b.weight_mode for b in buckets],
                                link_dtypes=[b.link_dtype for b in buckets],
                                cast_sites=[b.cast_site for b in buckets],
                                origin=ctx.origin)
    ctx.claim_handle = claim.handle
    for bucket in claim.buckets:   # option optimizer_threads: the CPU kernel's threads for these buckets
        bucket.use_kernel_threads(ctx.options.optimizer_threads)
    _bind_runtime(ctx, claim)
    _bind_activation_runtime(ctx)


def _check_moment_format(ctx: CompileContext) -> None:
    """The plan counted the moments in the format the optimizer stores them in (host memory, CPU bytes): an
    explicit ``moment_dtype`` option that contradicts the optimizer's would make both wrong."""
    import torch
    planned = format_of(ctx.plan.prediction("moment_bytes", 4))
    held = str(getattr(ctx.optimizer, "moment_dtype", torch.float32)).removeprefix("torch.")
    if planned != held:
        raise ValueError(
            f"socompile: the plan counts {planned} Adam moments (options moment_dtype={ctx.options.moment_dtype!r}) "
            f"but the optimizer stores them in {held} (socompile.AdamW(moment_dtype=torch.{held})): its host memory "
            f"and CPU bytes per step would not be the plan's. Leave the option unset (it follows the optimizer) or "
            f"build the optimizer with moment_dtype=torch.{planned}.")


def _bind_runtime(ctx: CompileContext, claim) -> None:
    """The offload runtime of this graph pair (device buffers, flow fetches, memory ledger). The optimizer's
    claim keeps it alive as long as the buckets it serves; graphs reach it by handle."""
    from .plan.flow_schedule import flow_schedule
    from .runtime.device import device_runtime
    from .runtime.offload import OffloadRuntime

    kind = _runtime_kind(ctx)
    device = ctx.param_objects[next(iter(ctx.param_objects))].device
    ctx.offload = OffloadRuntime(ctx.plan, claim.buckets, device_runtime(device, kind), events=ctx.optimizer.events,
                                 traffic=ctx.optimizer.traffic_ledger,
                                 before_host_read=_bucket_waiter(ctx.optimizer))
    claim.offload_runtimes = [*getattr(claim, "offload_runtimes", []), ctx.offload]
    ctx.flow_schedule = flow_schedule(ctx.plan, ctx.ir)


def _bucket_waiter(optimizer):
    """``optimizer.wait_bucket``, through a weak reference: the offload runtime lives in the optimizer's claim,
    which must not keep the optimizer alive (a deleted optimizer's graphs raise at their next backward)."""
    ref = weakref.ref(optimizer)

    def wait(flat) -> None:
        opt = ref()
        if opt is not None:
            opt.wait_bucket(flat)
    return wait


def _runtime_kind(ctx: CompileContext) -> str:
    """The runtime of option ``runtime`` (cpu, cuda or emulated); it must be the one the optimizer was built for,
    which decided where the master lives when it was built (docs/runtime.md)."""
    from .options import OptionError
    from .runtime.device import resolve_runtime
    kind = resolve_runtime(ctx.options.runtime)
    built_for = ctx.optimizer.runtime_kind
    if built_for != kind and "emulated" in (kind, built_for):
        raise OptionError(f"option runtime={ctx.options.runtime!r} asks for the {kind!r} runtime, but "
                          f"socompile.AdamW was built for {built_for!r} (it decides where the master lives when "
                          f"it is built): set SOCOMPILE_RUNTIME={kind} before building the optimizer")
    return kind


def _bind_activation_runtime(ctx: CompileContext) -> None:
    """The activation-offload runtime, when the plan offloads some layer and both offload passes will run. It
    shares the weight runtime's device, ledger and events, and lives as long as it (the claim holds that)."""
    from .passes.activation_offload import BW_NAME, FW_NAME
    from .options import OFFLOADED_CHOICES as OFFLOADED
    if not any(choice in OFFLOADED for _, choice in ctx.plan.activations):
        return
    if FW_NAME in ctx.options.disable_passes or BW_NAME in ctx.options.disable_passes:
        return   # the forward pass says so and keeps the activations
    from .runtime.activation_offload import ActivationOffloadRuntime
    weights = ctx.offload
    ctx.activation_offload = ActivationOffloadRuntime(weights.device, ledger=weights.ledger, events=weights.events,
                                                      traffic=weights.traffic,
                                                      host_ledger=ctx.optimizer.host_ledger,
                                                      host_work=ctx.optimizer.host_work_ledger)
    weights.activations = ctx.activation_offload


def apply_passes(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule) -> Graphs:
    """The registered passes, forward then backward (forward passes leave records for the backward ones)."""
    from . import passes
    with timed("passes"):
        fw = passes.run_passes(fw, "fw", ctx.plan, ctx)
        bw = passes.run_passes(bw, "bw", ctx.plan, ctx)
    ctx.forward_graph, ctx.backward_graph = fw, bw
    return fw, bw


def run_compile_hooks(ctx: CompileContext) -> None:
    """The compile hooks of passes/table.py (HOOKS), once the plan is made. With no mode active: the cross-rank
    plan check talks to the other ranks with real tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .passes import run_hooks
    with _disable_current_modes():
        run_hooks(ctx)


# --------------------------------------------------------------------------------------------------- dumps
def emit_plan(ctx: CompileContext) -> None:
    """The plan as tlparse artifacts (TORCH_TRACE=<dir>): JSON and the text table."""
    from .report.table import plan_json, plan_table
    artifact("socompile_plan", lambda: plan_json(ctx.plan), encoding="json")
    artifact("socompile_plan_table", lambda: plan_table(ctx.plan))


def emit_pass_graphs(ctx: CompileContext) -> None:
    for dump in ctx.dumps:
        artifact(f"socompile_pass_{dump.pass_name}_before", lambda d=dump: d.before)
        artifact(f"socompile_pass_{dump.pass_name}_after", lambda d=dump: d.after)


def write_dumps(ctx: CompileContext) -> None:
    if ctx.options.dump_dir:
        from .report.dump import write_dumps as write
        write(ctx, ctx.options.dump_dir)
