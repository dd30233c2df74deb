"""Folded tracing (capture/fold/): four traced blocks, block 2 repeated, must give the graphs and the plan of
tracing every block; models whose blocks do not repeat must be traced whole."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import sympy
import torch
from torch import nn

from socompile.capture import fold
from socompile.capture.fold.order import expand_order
from socompile.models.llama import PRESETS, build
from socompile.offline import plan_model


def _signature(ir, order):
    """Everything the planner reads from a node, without its name (symbols by their meaning: each trace
    numbers its own)."""
    def text(expr):
        if not isinstance(expr, sympy.Basic):
            return str(expr)
        return str(expr.xreplace({x: sympy.Symbol(ir.symbol_names[x.name]) for x in expr.free_symbols}))
    rows = []
    for key in order:
        d = ir.graph.nodes[key]
        rows.append((d["op"], d["kind"], text(d["bytes"]), text(d["flops"]), d["reads_params"], d["alias_of"],
                     d["is_view"], ir.graph.in_degree(key), ir.graph.out_degree(key)))
    return rows


def _plan_json(ctx) -> str:
    plan = ctx.plan.to_dict()
    for bucket in plan["buckets"]:
        bucket.pop("ready_after")      # a node name: copies are named <template>_b<block>
    return json.dumps(plan, sort_keys=True)


def _both(factory, **kwargs):
    return (plan_model(factory, fold=True, **kwargs), plan_model(factory, fold=False, **kwargs))


# small, symbolic: -m slow (~25 s alone); the default suite folds a symbolic trace of a plain stack below
@pytest.mark.parametrize("preset,layers,symbolic", [("llama-1b", 7, False),
                                                    pytest.param("small", 6, True, marks=pytest.mark.slow)])
def test_folded_graphs_and_plan_equal_full_trace(preset, layers, symbolic):
    cfg = dataclasses.replace(PRESETS[preset], n_layers=layers)
    folded, full = _both(lambda: build(cfg), batch=2, seq=128, options={"target": "gh200"},
                         dtype=torch.bfloat16, symbolic=symbolic)
    # The fold really happened: the folded trace names its copies <node>_b<block>.
    copies = [n.name for n in folded.backward_graph.graph.nodes if n.name.endswith(f"_b{layers - 2}")]
    assert copies, "block 2 was not repeated"
    a, b = folded.ir, full.ir
    assert list(a.params) == list(b.params) and a.params == b.params
    assert _signature(a, a.fw_order) == _signature(b, b.fw_order)
    assert _signature(a, a.bw_order) == _signature(b, b.bw_order)
    assert [a.bw_order.index(a.grad_node[p]) for p in a.params] == [b.bw_order.index(b.grad_node[p]) for p in b.params]
    assert a.grad_output_index == b.grad_output_index
    assert [len(a.fw_readers[p]) for p in a.params] == [len(b.fw_readers.get(p, ())) for p in b.params]
    assert _plan_json(folded) == _plan_json(full)


def test_folded_graphs_run_the_passes_and_keep_saved_names():
    cfg = dataclasses.replace(PRESETS["small"], n_layers=6)
    ctx = plan_model(lambda: build(cfg), batch=2, seq=64, options={"target": "gh200", "bucket_size": "256KB"})
    fw_out = next(n for n in ctx.forward_graph.graph.nodes if n.op == "output")
    saved = [v.name for v in fw_out.args[0][1:] if v is not None]
    bw_inputs = {n.name for n in ctx.backward_graph.graph.nodes if n.op == "placeholder"}
    assert set(saved) <= bw_inputs            # every saved tensor reaches the backward under its forward name
    descs = fw_out.meta["desc"][1:]
    assert [d.idx for d in descs] == list(range(len(descs)))
    ctx.forward_graph.graph.lint()
    ctx.backward_graph.graph.lint()


class _Block(nn.Module):
    def __init__(self, dim: int, index: int | None = None):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        if index is not None:
            self.layer_idx = index

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, n: int = 7, dim: int = 16, indexed: bool = False, scale_odd: bool = False):
        super().__init__()
        self.emb = nn.Embedding(32, dim)
        self.blocks = nn.ModuleList(_Block(dim, i if indexed else None) for i in range(n))
        self.head = nn.Linear(dim, 32)
        self.scale_odd = scale_odd

    def forward(self, tokens):
        x = self.emb(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.scale_odd and i % 2:
                x = x * 0.5       # after odd blocks only: block 2 (even) and block 1 (odd) differ
        return self.head(x)


def test_blocks_found_only_when_identical():
    assert fold.find_blocks(_Stack()) == fold.Blocks("blocks", 7)
    assert fold.find_blocks(_Stack(indexed=True)) is None       # a block index could change behaviour
    assert fold.find_blocks(_Stack(n=5)) is None                 # too few to be worth it
    assert fold.find_blocks(build(dataclasses.replace(PRESETS["small"], n_layers=8))) == fold.Blocks("layers", 8)


def test_a_model_that_does_not_repeat_is_traced_whole(caplog):
    # The handler goes on the logger itself: torch._logging.set_logs (other tests) may stop "socompile" from
    # propagating to the root logger, where caplog listens by default.
    logger = logging.getLogger("socompile.capture.trace")
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    try:
        folded, full = _both(lambda: _Stack(scale_odd=True), batch=2, seq=8, options={"target": "gh200"})
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
    assert any("tracing all 7 blocks" in r.getMessage() for r in caplog.records)
    assert not any(n.name.endswith("_b4") for n in folded.backward_graph.graph.nodes)
    assert _signature(folded.ir, folded.ir.bw_order) == _signature(full.ir, full.ir.bw_order)
    assert _plan_json(folded) == _plan_json(full)


@pytest.mark.parametrize("symbolic", [False, True])
def test_a_plain_stack_folds_to_the_full_trace(symbolic):
    folded, full = _both(lambda: _Stack(), batch=2, seq=8, options={"target": "gh200"}, symbolic=symbolic)
    shapes = [n.meta["val"].shape for n in folded.forward_graph.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)]
    assert any(isinstance(d, torch.SymInt) for shape in shapes for d in shape) == symbolic
    assert any(n.name.endswith("_b5") for n in folded.backward_graph.graph.nodes)
    assert _signature(folded.ir, folded.ir.fw_order) == _signature(full.ir, full.ir.fw_order)
    assert _signature(folded.ir, folded.ir.bw_order) == _signature(full.ir, full.ir.bw_order)
    assert _plan_json(folded) == _plan_json(full)


def test_expand_order_places_copies_between_slots_2_and_3():
    up = [None, 0, 0, 1, 1, 2, 2, 3, 3, None]
    order = expand_order(up, [3, 4], "test")
    assert [c for _, c in order] == [None] * 7 + [3, 3, 4, 4] + [None] * 3
    assert [p for p, _ in order][5:11] == [5, 6, 5, 6, 5, 6]
    down = [3, 2, 2, 1, 1, 0]
    order = expand_order(down, [3, 4], "test")
    assert order == [(0, None), (1, 4), (2, 4), (1, 3), (2, 3), (1, None), (2, None), (3, None), (4, None),
                     (5, None)]
    with pytest.raises(fold.FoldError):
        expand_order([1, 1, 2, None, 2, 3], [3], "test")     # slot 2 split where slot 1 is not


def test_an_error_inside_a_folded_block_is_the_error_the_user_sees():
    # "small" has 6 blocks (folded) and rotary tables for 512 positions: 1024 tokens fail inside block 0. The
    # fold's block tags used to unwind after torch's node-meta context had reset, raising KeyError('custom')
    # in place of the shape error.
    from socompile.offline import plan_model
    with pytest.raises(RuntimeError, match="broadcast"):
        plan_model("small", batch=1, seq=1024, run_passes=False)
