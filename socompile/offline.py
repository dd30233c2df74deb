"""Plan and dump without training: trace a model (under FakeTensorMode by default), then run the compile pipeline
(socompile/pipeline.py: plan, apply the passes) on the traced graphs.

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
               vocab_size: int | None = None, dtype: torch.dtype | None = None,
               symbolic: bool = False, run_passes: bool = True, fold: bool = True) -> CompileContext:
    """Trace ``model`` on (batch, seq) tokens, build the IR, plan it for ``options.target``.

    dtype: cast the model first (e.g. torch.bfloat16 to plan mixed-precision GPU training; the CPU trains fp32).
    symbolic: trace batch and sequence as symbols, so sizes in the plan are formulas of ``batch`` and ``seq``
    (slower to trace: about 3x on a 7B model).
    fold: trace 4 of a deep model's identical blocks and repeat one in the graphs (capture/fold/); the plan is
    the same as with every block traced, several times sooner. False traces every block.
    """
    from .capture.trace import trace_training_graphs
    from .pipeline import plan_traced

    opts = Options.resolve(options)
    factory = resolve_model_factory(model)
    if symbolic and not fake:
        raise ValueError("symbolic=True needs fake=True (symbolic sizes live in FakeTensorMode's ShapeEnv)")
    symbol_names: dict[str, str] = {}
    if symbolic:
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
        mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else contextlib.nullcontext()
    with mode:
        # Build in the planning dtype (casting FakeTensor parameters with .to() is not supported).
        previous = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            net = factory()
        finally:
            torch.set_default_dtype(previous)
        if dtype is not None:   # buffers built with an explicit dtype (e.g. rotary tables) follow the model
            for module in net.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None and buf.is_floating_point():
                        module._buffers[name] = buf.to(dtype)
        vocab = vocab_size or getattr(getattr(net, "cfg", None), "vocab_size", 256)
    if symbolic:
        dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
        tokens = mode.from_tensor(torch.zeros(batch, seq, dtype=torch.long), symbolic_context=dynamic)
        symbol_names = {str(tokens.shape[0].node.expr): "batch", str(tokens.shape[1].node.expr): "seq"}
    with mode:
        if not symbolic:
            tokens = torch.randint(0, vocab, (batch, seq))
        targets = torch.zeros_like(tokens) if symbolic else torch.randint(0, vocab, (batch, seq))
        fw, bw, infos = trace_training_graphs(net, (tokens,), (targets,), fold=fold)
    ctx = CompileContext(options=opts)
    plan_traced(ctx, fw, bw, infos, symbol_names, run_passes)   # claim -1: the graphs are for reading
    return ctx
