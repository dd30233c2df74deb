"""Plan and dump without training: trace a model (under FakeTensorMode by default), plan, apply the passes.

    ctx = socompile.offline.plan_model("llama-13b", batch=4, seq=4096, options={"target": "gh200"})
    print(socompile.report.plan_table(ctx.plan))
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .context import CompileContext
from .options import Options


def resolve_model_factory(model: str | Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """A preset name ('tiny', 'llama-13b') or 'pkg.module:function' returning an nn.Module."""
    if callable(model):
        return model
    if ":" in model:
        module_name, _, attr = model.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    from .models import build
    return lambda: build(model)


def plan_model(model: str | Callable[[], torch.nn.Module], batch: int = 4, seq: int = 256,
               options: Mapping[str, Any] | Options | None = None, fake: bool = True,
               vocab_size: int | None = None) -> CompileContext:
    from . import passes
    from .capture.ir import build_ir
    from .capture.trace import trace_training_graphs
    from .plan import get_profile, plan

    opts = Options.resolve(options)
    factory = resolve_model_factory(model)
    mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else contextlib.nullcontext()
    with mode:
        net = factory()
        vocab = vocab_size or getattr(getattr(net, "cfg", None), "vocab_size", 256)
        tokens = torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))
        fw, bw, infos = trace_training_graphs(net, (tokens,), (targets,))
    ctx = CompileContext(options=opts)
    ctx.forward_graph, ctx.backward_graph = fw, bw
    ctx.param_names = {p.input_index: p.name for p in infos}
    ctx.ir = build_ir(fw, bw, infos)
    ctx.plan = plan(ctx.ir, get_profile(opts.target), opts)
    passes.run_passes(bw, "bw", ctx.plan, ctx)   # claim -1: the graph is for reading, not for running
    return ctx
