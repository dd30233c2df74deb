"""The ``superoffload`` torch.compile backend.

    torch.compile(model, backend="superoffload", options={...})

Dynamo gives us the forward FX graph; AOTAutograd splits it into forward and backward graphs. This module is
the Dynamo / AOTAutograd glue: at partition time it hands both graphs (and the joint graph, for recompute) to
the compile pipeline (socompile/pipeline.py: capture, plan once, layouts, passes, checks, dumps). The compute
is then compiled by Inductor (default) or run by the FX interpreter.

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
from .logs import register_with_torch
from .options import Options

log = logging.getLogger("socompile")
register_with_torch()   # TORCH_LOGS=+socompile; only adds our name to torch's log registry


def superoffload(gm: fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
                 mode: str | None = None):
    """Entry point named ``superoffload`` (found by Dynamo through the entry-point group)."""
    _check_mode(mode)
    return SuperOffload(options)(gm, example_inputs)


def _check_mode(mode: str | None) -> None:
    """torch.compile's ``mode`` reaches a backend as a keyword. Only the default is ours: CUDA graphs
    ("reduce-overhead", "max-autotune") replay recorded kernels and would skip the host-side optimizer steps,
    uploads and waits the graph calls, so training would silently stop updating the weights."""
    if mode not in (None, "default"):
        raise OffloadError(f"superoffload supports mode=None or 'default', got {mode!r}: CUDA graphs "
                           "('reduce-overhead') cannot replay host-side optimizer steps. Drop mode=... from "
                           "torch.compile.")


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
        if self.options.disable_passes:   # as run_passes does, but before anything is compiled
            from .passes.table import check_requirements   # (the passes import the planner: only when needed)
            check_requirements(self.options.disable_passes)
        self.compiled: list[CompileContext] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                 options: Mapping[str, Any] | None = None):
        from .capture import find_parameters

        _check_mode(mode)
        if options:   # torch.compile(..., backend=SuperOffload(...), options={...}) would drop them silently
            raise OffloadError(f"torch.compile(options={dict(options)!r}) was given with a SuperOffload object: "
                               "its options are the object's own. Pass them to it, "
                               "socompile.SuperOffload(options) or SuperOffload(**options), or use "
                               "backend='superoffload' with options=...")

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
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def eager(graph, inputs, **kwargs):
            return _freeing_inputs(graph)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            return _run_pipeline(ctx, fw, bw, _repartition(min_cut_rematerialization_partition, joint,
                                                           joint_inputs, kwargs))

        return aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition)(gm, example_inputs)


def _freeing_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a boxed function (one list of inputs, which it empties) on a copy of its graph: each input,
    a saved activation above all, is let go after its last use, as Inductor's code does and as the planner's
    liveness counts it (perf/analysis.py). Called with unpacked arguments, the backward would keep every saved
    tensor to its end. ``gm`` itself is left as it is (the checker and reports read it)."""
    graph = fx.Graph()
    graph.set_codegen(fx.graph._BoxedCodeGen())   # torch's own boxed codegen (Inductor's convention)
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)   # boxed: its _boxed_call is the codegen's


def _partitioner(ctx: CompileContext):
    """Inductor's partitioner hook (``config.custom_partitioner_fn``): Inductor still runs its joint-graph
    passes first and then calls this with ``compiler="inductor"``."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class SuperOffloadPartitioner(CustomPartitionerFn):
        def __call__(self, joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            return _run_pipeline(ctx, fw, bw, _repartition(min_cut_rematerialization_partition, joint,
                                                           joint_inputs, kwargs))

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
    """The same partitioner on the same joint graph, for activation recompute (the pipeline's activation
    layout; passes/activations.py)."""
    from .passes.activations import Repartition
    return Repartition(partition_fn, joint, joint_inputs, kwargs)


def _partitioner_id() -> str:
    return _PARTITIONER_ID


def _run_pipeline(ctx: CompileContext, fw: fx.GraphModule, bw: fx.GraphModule, joint):
    """From the partitioner hook into the one compile pipeline (socompile/pipeline.py): plan, lay out, rewrite."""
    from .pipeline import compile_partitioned
    return compile_partitioned(ctx, fw, bw, joint)
