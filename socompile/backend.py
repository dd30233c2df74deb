"""The ``superoffload`` torch.compile backend.

    torch.compile(model, backend="superoffload", options={...})

Dynamo gives us the forward FX graph; AOTAutograd splits it into forward and backward graphs. When the
backward graph is compiled (lazily, at the first ``.backward()``), we capture both graphs into the IR, plan,
lay out the socompile optimizer's buckets to the plan, and run the passes that put the optimizer's work into
the backward graph. The compute is then compiled by Inductor (default) or run by the FX interpreter.

NOTE: this module is what the ``torch_dynamo_backends`` entry point loads: keep its imports cheap.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping

import torch
from torch import fx

from . import errors
from .context import CompileContext
from .errors import OffloadError
from .logs import artifact, register_with_torch, timed
from .options import Options

log = logging.getLogger("socompile")
register_with_torch()   # TORCH_LOGS=+socompile; only adds our name to torch's log registry


def superoffload(gm: fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
                 mode: str | None = None):
    """Entry point named ``superoffload`` (found by Dynamo through the entry-point group)."""
    if mode not in (None, "default"):
        raise OffloadError(f"superoffload supports mode=None or 'default', got {mode!r}: CUDA graphs "
                           "('reduce-overhead') cannot replay host-side optimizer steps")
    return SuperOffload(options)(gm, example_inputs)


class SuperOffload:
    """Backend as an object that keeps what it compiled (contexts with IR, plan, dumps) for inspection:

        backend = socompile.SuperOffload(bucket_size="1MB")
        cmodel = torch.compile(model, backend=backend)
        ...; backend.compiled[0].plan
    """

    def __init__(self, options: Mapping[str, Any] | Options | None = None, **kwargs):
        if isinstance(options, Options):
            if kwargs:
                options = Options.resolve({**options.to_dict(), **kwargs})
            self.options = options
        else:
            self.options = Options.resolve({**(options or {}), **kwargs})
        self.compiled: list[CompileContext] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **_ignored):
        from .capture import find_parameters

        self._check_dynamo_graph(gm)
        params = find_parameters(gm, example_inputs)
        if not params and (errors.graph_break_of(gm) is not None or errors.is_resumed_piece(gm)):
            # A parameter-free piece of a region split by a graph break (e.g. the loss after the break):
            # nothing to offload here, compile its compute as usual.
            log.debug("socompile: a piece of a split graph has no parameters; compiled without the optimizer")
            return _compile(gm, example_inputs, CompileContext(options=self.options))
        if not params:
            raise OffloadError("superoffload: the compiled graph has no parameters, so there is nothing to "
                               "offload. Compile the nn.Module that owns the parameters, or use "
                               "backend='inductor' for parameter-free functions.")
        from .per_model import PerModelGraphs

        names = {index: name for index, name, _ in params}
        objects = {index: p for index, _, p in params}
        again = _CompileAgain(self, gm, names)   # before the first compile, which rewrites gm in place
        return PerModelGraphs(objects, self._compile_for(gm, example_inputs, names, objects), again)

    def _compile_for(self, gm: fx.GraphModule, example_inputs: list, names: dict[int, str],
                     params: dict[int, torch.nn.Parameter]):
        """Compile Dynamo's graph for one model's parameters (graph input index -> parameter) and their
        optimizer: its plan, claim and buckets."""
        ctx = CompileContext(options=self.options)
        ctx.param_names = dict(names)
        ctx.param_objects = dict(params)
        ctx.optimizer = _owning_optimizer(list(params.values()), list(names.values()))
        ctx.origin = _origin(gm)
        self.compiled.append(ctx)
        compiled = _compile(gm, example_inputs, ctx)
        if not torch.is_grad_enabled() and ctx.optimizer is not None:
            return _with_committed_weights(compiled, ctx.optimizer)
        return _activating(compiled, ctx)

    def _check_dynamo_graph(self, gm: fx.GraphModule) -> None:
        """Graph breaks inside the compiled region and recompile storms: say where, and what to do."""
        brk = errors.graph_break_of(gm)
        _, count = errors.compile_count(gm)
        if brk is not None and self.options.on_graph_break != "ignore":
            message = errors.graph_break_message(brk)
            if self.options.on_graph_break == "error":
                raise OffloadError(message)
            if count == 0:   # once per break, not again on every recompile
                log.warning(message)
        limit = self.options.recompile_warn_after
        if limit and count == limit:
            log.warning(errors.recompile_message(count))


class _CompileAgain:
    """Compiles a Dynamo graph again for another model's parameters (socompile/per_model.py says why).

    It keeps a pristine copy of the graph (compiling rewrites it: Inductor's pre-grad passes) and, as example
    inputs, Dynamo's fake values of its inputs: symbolic sizes stay symbolic, so a graph Dynamo compiled for
    dynamic shapes is compiled again for them, and no real tensor of the first model is kept. The backend
    object is held weakly: ``superoffload()`` makes one per compile, and its ``compiled`` contexts hold their
    models; once it is gone, a fresh one with the same options compiles."""

    def __init__(self, backend: SuperOffload, gm: fx.GraphModule, names: dict[int, str]):
        import copy

        self._backend = weakref.ref(backend)
        self._options = backend.options
        self._names = names
        self._gm = copy.deepcopy(gm)   # node meta (fake values, sources) is shared, not copied
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._example_inputs = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]

    def __call__(self, params: dict[int, torch.nn.Parameter]):
        import copy

        log.info("socompile: compiling a graph again for the parameters of another model (or of a new "
                 "optimizer): Dynamo shares compiled code between models of one class, and each model's "
                 "optimizer gets its own plan and buckets")
        backend = self._backend() or SuperOffload(self._options)
        return backend._compile_for(copy.deepcopy(self._gm), self._example_inputs, self._names, params)


def _with_committed_weights(compiled, optimizer):
    """A graph compiled under ``torch.no_grad()`` (evaluation) is an inference graph: AOTAutograd never
    partitions it, so none of the training passes run (no weight fetches, no upload waits), and flow
    parameters of a separate host master hold 0 bytes between uses. Run it with every weight in place, as
    ``opt.materialized_weights()`` gives them (cast from the master, uploads waited for), freed after."""
    owner = weakref.ref(optimizer)

    def run(*args):
        opt = owner()
        if opt is None:
            return compiled(*args)
        with opt.materialized_weights():
            return compiled(*args)
    run._boxed_call = getattr(compiled, "_boxed_call", False)   # Dynamo passes a list to boxed functions
    return run


def _origin(gm: fx.GraphModule):
    """The graph's Dynamo frame, and whether it is a piece of a region split by a graph break."""
    from .optim.graph_claim import GraphOrigin
    piece = errors.graph_break_of(gm) is not None or errors.is_resumed_piece(gm)
    return GraphOrigin(frame=errors.compile_count(gm)[0], piece=piece)


def _activating(compiled, ctx: CompileContext):
    """Before each run of a training graph, its optimizer claim is made active: another compiled graph of the
    same parameters (a recompile, a branch switched by a model attribute) may have taken them over since
    (optim/graph_claim.py). A flag check when nothing changed."""
    if ctx.claim_handle < 0:
        return compiled
    from .runtime import handles
    claim = weakref.ref(handles.lookup(ctx.claim_handle))   # the optimizer owns its claims (and their buckets)

    def run(*args):
        live = claim()
        if live is not None:   # else the optimizer is gone; the backward says so
            live.activate()
        return compiled(*args)
    run._boxed_call = getattr(compiled, "_boxed_call", False)   # Dynamo passes a list to boxed functions
    return run


def _owning_optimizer(params: list[torch.nn.Parameter], names: list[str]):
    from .optim.owner import owner_of

    owners = {}
    unowned = []
    for p, name in zip(params, names):
        opt = owner_of(p)
        if opt is None:
            if p.requires_grad:
                unowned.append(name)
        else:
            owners[id(opt)] = opt
    total = len(unowned) + sum(1 for p in params if owner_of(p) is not None)
    if len(owners) > 1:
        raise OffloadError("one compiled graph has parameters of several socompile optimizers; use one "
                           "socompile.AdamW with parameter groups instead")
    if unowned:
        shown = ", ".join(unowned[:3]) + (" ..." if len(unowned) > 3 else "")
        log.warning(errors.unowned_parameters_message(len(unowned), total, shown))
    return next(iter(owners.values()), None)


def _compile(gm: fx.GraphModule, example_inputs: list, ctx: CompileContext):
    from torch._functorch import config as functorch_config

    # NOTE: plan at partition time. Weight flow rewrites the forward (fetch, release, saved views) and the
    # backward (re-fetch, optimizer steps) together, so both graphs must be known before either is compiled.
    # The partitioner is the one place that sees both: we run the stock min-cut partitioner, then plan and
    # rewrite its two outputs. AOTAutograd compiles the forward at once and the backward lazily, as before.
    #
    # NOTE: no AOTAutograd cache. A cache hit would skip our partition hook, so the optimizer's buckets would
    # never be laid out for the cached graph. Inductor's own FX graph cache stays on: it keys on the graph
    # after our passes.
    with functorch_config.patch(enable_autograd_cache=False):
        if ctx.options.compute == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx
            with inductor_config.patch(custom_partitioner_fn=_partitioner(ctx)):
                return compile_fx(gm, example_inputs)
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def eager(graph, inputs, **kwargs):
            return make_boxed_func(graph.forward)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            ctx.repartition = _repartition(min_cut_rematerialization_partition, joint, joint_inputs, kwargs)
            return _apply_plan(ctx, fw, bw)

        return aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition)(gm, example_inputs)


def _partitioner(ctx: CompileContext):
    """Inductor's partitioner hook (``config.custom_partitioner_fn``): Inductor still runs its joint-graph
    passes first and then calls this with ``compiler="inductor"``."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class SuperOffloadPartitioner(CustomPartitionerFn):
        def __call__(self, joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            ctx.repartition = _repartition(min_cut_rematerialization_partition, joint, joint_inputs, kwargs)
            return _apply_plan(ctx, fw, bw)

        def uuid(self):
            # Inductor's FX graph cache keys on the graphs *after* our passes (runtime handles included), so
            # the partitioner itself needs only a stable name.
            return _PARTITIONER_ID

        def __reduce__(self):
            # The cache key pickles Inductor's config, this object included: pickle it as its name.
            return (_partitioner_id, ())

    return SuperOffloadPartitioner()


_PARTITIONER_ID = "socompile.backend.SuperOffloadPartitioner/1"


def _repartition(partition_fn, joint, joint_inputs, kwargs):
    """The same partitioner on the same joint graph, for activation recompute (passes/activations.py)."""
    from .passes.activations import Repartition
    return Repartition(partition_fn, joint, joint_inputs, kwargs)


def _partitioner_id() -> str:
    return _PARTITIONER_ID


def _apply_plan(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
    from . import passes
    from .capture import build_ir, describe
    from .plan import get_profile, plan

    ctx.forward_graph, ctx.backward_graph = fw, bw
    if not ctx.param_names:   # a parameter-free piece of a split region: nothing to plan
        return fw, bw
    with timed("capture"):
        infos = [describe(i, name, ctx.param_objects[i], optimized=ctx.optimizer is not None)
                 for i, name in ctx.param_names.items()]
        ctx.ir = build_ir(fw, bw, infos)
    with timed("plan"):
        ctx.plan = plan(ctx.ir, get_profile(ctx.options.target), ctx.options)
    # --- activations (passes/activations.py): layers planned "recompute" are tagged in the joint graph, which
    # is partitioned again (new IR, plan made again with the same per-layer choices pinned) ---
    with timed("activations"):
        fw, bw = passes.activations.repartition(ctx, fw, bw)
    # ---
    _emit_plan(ctx)
    if ctx.optimizer is not None and ctx.plan.buckets:
        from torch.utils._python_dispatch import _disable_current_modes
        by_name = {name: ctx.param_objects[i] for i, name in ctx.param_names.items()}
        # The partitioner runs under AOTAutograd's fake mode, but the buckets and runtime buffers are real memory
        # and passes may talk to other ranks: run them with no mode active (passes enter the fake mode themselves
        # to give new nodes their fake values).
        with _disable_current_modes():
            # On a CPU-only machine the "device" is the CPU: device-site buckets use the same kernel, but (as on
            # a GPU) only after validation, in opt.step(); CPU-site buckets are stepped as their gradients arrive.
            claim = ctx.optimizer.claim([[by_name[n] for n in b.params] for b in ctx.plan.buckets],
                                        early_step=[b.optimizer_site == "cpu" and ctx.options.speculate
                                                    for b in ctx.plan.buckets],
                                        rollback=["inverse" if b.rollback == "inverse" else "pingpong"
                                                  for b in ctx.plan.buckets],
                                        sites=[b.optimizer_site for b in ctx.plan.buckets],
                                        weight_modes=[b.weight_mode for b in ctx.plan.buckets],
                                        origin=ctx.origin)
            ctx.claim_handle = claim.handle
            for bucket in claim.buckets:   # option optimizer_threads: the CPU kernel's threads for these buckets
                bucket.kernel_threads = ctx.options.optimizer_threads
            _bind_runtime(ctx, claim)
            with timed("passes"):
                fw = passes.run_passes(fw, "fw", ctx.plan, ctx)
                bw = passes.run_passes(bw, "bw", ctx.plan, ctx)
        ctx.forward_graph, ctx.backward_graph = fw, bw
        _check_rewritten(ctx, fw, bw)
        _emit_pass_graphs(ctx)
    else:   # no socompile optimizer, so no passes ran: ranks must still have planned alike (distributed runs)
        from torch.utils._python_dispatch import _disable_current_modes
        for check in (p for p in passes.registry.PASSES if p.name == "check_plan_across_ranks"
                      and p.name not in ctx.options.disable_passes):
            with _disable_current_modes():   # it talks to the other ranks with real tensors
                check.fn(bw, ctx.plan, ctx)
    if ctx.options.dump_dir:
        from .report.dump import write_dumps
        write_dumps(ctx, ctx.options.dump_dir)
    log.info("socompile: planned %d bucket(s) for target %s", len(ctx.plan.buckets), ctx.plan.target)
    return fw, bw


def _bind_runtime(ctx: CompileContext, claim) -> None:
    """The offload runtime of this graph pair (device buffers, flow fetches, memory ledger). The optimizer's
    claim keeps it alive as long as the buckets it serves; graphs reach it by handle."""
    from .plan.flow_schedule import flow_schedule
    from .options import OptionError
    from .runtime.device import device_runtime, resolve_runtime
    from .runtime.offload import OffloadRuntime

    kind = resolve_runtime(ctx.options.runtime)
    built_for = getattr(ctx.optimizer, "runtime_kind", kind)
    if built_for != kind and "emulated" in (kind, built_for):
        raise OptionError(f"option runtime={ctx.options.runtime!r} asks for the {kind!r} runtime, but "
                          f"socompile.AdamW was built for {built_for!r} (it decides where the master lives when "
                          f"it is built): set SOCOMPILE_RUNTIME={kind} before building the optimizer")
    device = ctx.param_objects[next(iter(ctx.param_objects))].device
    ctx.offload = OffloadRuntime(ctx.plan, claim.buckets, device_runtime(device, kind), events=ctx.optimizer.events)
    claim.offload_runtimes = [*getattr(claim, "offload_runtimes", []), ctx.offload]
    ctx.flow_schedule = flow_schedule(ctx.plan, ctx.ir)
    ctx.flow_saved_chains = {}


def _check_rewritten(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """The invariant checker on the graphs that will run (a failure is a pass bug, caught before any step)."""
    from .plan.verify import PlanInvariantError, check_graphs
    problems = check_graphs(ctx.plan, ctx.ir, fw, bw, disabled=ctx.options.disable_passes)
    if problems:
        raise PlanInvariantError(problems)


def _emit_plan(ctx: CompileContext) -> None:
    """The plan as tlparse artifacts (TORCH_TRACE=<dir>): JSON and the text table."""
    from .report.table import plan_json, plan_table
    artifact("socompile_plan", lambda: plan_json(ctx.plan), encoding="json")
    artifact("socompile_plan_table", lambda: plan_table(ctx.plan))


def _emit_pass_graphs(ctx: CompileContext) -> None:
    for dump in ctx.dumps:
        artifact(f"socompile_pass_{dump.pass_name}_before", lambda d=dump: d.before)
        artifact(f"socompile_pass_{dump.pass_name}_after", lambda d=dump: d.after)
