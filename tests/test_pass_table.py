"""The pass table (socompile/passes/table.py): names, requirements checked before any pass runs, the graph
checker after every pass, the fw -> bw records, the compile hooks, and the imports that used to go round."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

import socompile
from socompile import pass_names
from socompile.offline import plan_model
from socompile.options import OptionError, Options
from socompile.passes import table
from socompile.passes.check import GraphInvariantError
from socompile.passes.table import Pass

PACKAGE = pathlib.Path(socompile.__file__).parent


def test_the_leaf_module_names_the_passes_and_hooks_of_the_table_in_its_order():
    assert pass_names.PASS_NAMES == tuple(p.name for p in table.PASSES)
    assert pass_names.HOOK_NAMES == tuple(h.name for h in table.HOOKS)
    assert list(pass_names.DISABLEABLE) == table.known_pass_names()
    assert len(set(pass_names.DISABLEABLE)) == len(pass_names.DISABLEABLE)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at the top or inside functions, as written ('.passes', 'torch', ...)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" if node.module else base + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_options_and_the_activation_passes_no_longer_import_in_a_circle():
    assert _imports(PACKAGE / "pass_names.py") == {"__future__", "__future__.annotations"}   # a leaf
    assert not any("passes" in m for m in _imports(PACKAGE / "options.py"))
    activations, offload = PACKAGE / "passes" / "activations.py", PACKAGE / "passes" / "activation_offload.py"
    assert not any("activation_offload" in m for m in _imports(activations))
    assert not any(m.endswith("activations") or ".activations." in m for m in _imports(offload))
    # the private node builder is no longer imported across passes: everyone takes graph_build's
    for path in (PACKAGE / "passes").glob("*.py"):
        assert "_Builder" not in path.read_text(), path.name


def test_a_cross_rank_plan_check_is_a_hook_known_without_initialising_distributed():
    # it used to become a known name only once init_distributed/make_topology/shard_optimizer registered it
    assert Options(disable_passes=("check_plan_across_ranks",)).disable_passes == ("check_plan_across_ranks",)
    ctx = plan_model("tiny", batch=1, seq=8, run_passes=False)
    table.run_hooks(ctx)      # one process: nothing to compare, nothing raised


def test_turning_off_a_pass_that_an_enabled_pass_requires_is_an_option_error_naming_both():
    with pytest.raises(OptionError, match=r"turns off 'insert_optimizer_steps', which provides 'optimizer_steps' "
                                          r"that pass 'cast_gradients' requires: disable 'cast_gradients' too"):
        socompile.SuperOffload(disable_passes=["insert_optimizer_steps"])
    with pytest.raises(OptionError, match="'activation_offload_forward'.*'activation_offload_backward' requires"):
        table.check_requirements({"activation_offload_forward"})
    table.check_requirements({"insert_optimizer_steps", "cast_gradients"})   # both off: fine


def _ctx(**options):
    return plan_model("tiny", batch=1, seq=8, run_passes=False, options={"bucket_size": "64KB", **options})


def test_requirements_are_checked_before_the_first_pass_runs():
    ctx = _ctx(disable_passes=("insert_optimizer_steps", "cast_gradients"))
    ran = []
    first = Pass("first", "fw", lambda gm, plan, ctx: ran.append("first") or gm)
    needs = Pass("needs_steps", "bw", lambda gm, plan, ctx: gm, requires=("optimizer_steps",))
    steps = next(p for p in table.PASSES if p.name == "insert_optimizer_steps")
    with pytest.raises(OptionError, match="'insert_optimizer_steps'.*'needs_steps' requires"):
        table.run_passes(ctx.forward_graph, "fw", ctx.plan, ctx, table=(steps, first, needs))
    assert ran == []          # the forward pass did not run: the backward's requirement was checked first
    misordered = (first, needs, steps)      # same phase, the provider listed after the pass that needs it
    with pytest.raises(RuntimeError, match=r"'needs_steps' requires 'optimizer_steps', which no earlier pass "
                                           r"provides \(\['insert_optimizer_steps'\] provide it only after"):
        table.check_requirements((), misordered)


def _duplicate_a_step(gm, plan, ctx):
    """A broken pass: hands bucket 0 to its optimizer a second time."""
    step = next(n for n in gm.graph.nodes if n.target is torch.ops.socompile.bucket_grads_ready.default)
    with gm.graph.inserting_after(step):
        copy = gm.graph.call_function(step.target, step.args)
    copy.meta["val"] = None
    return gm


@pytest.mark.parametrize("mode", ["each_pass", "final", "off"])
def test_the_graph_checker_catches_a_pass_that_breaks_an_earlier_passes_invariant_and_names_it(mode):
    ctx = _ctx(check_graphs=mode)
    steps = next(p for p in table.PASSES if p.name == "insert_optimizer_steps")
    harmless = Pass("harmless", "bw", lambda gm, plan, ctx: gm)
    broken = Pass("duplicate_a_step", "bw", _duplicate_a_step)
    test_table = (steps, broken, harmless)
    if mode == "off":
        table.run_passes(ctx.backward_graph, "bw", ctx.plan, ctx, table=test_table)
        return
    with pytest.raises(GraphInvariantError) as caught:
        table.run_passes(ctx.backward_graph, "bw", ctx.plan, ctx, table=test_table)
    message = str(caught.value)
    assert "backward: bucket 0 is handed to its optimizer 2 times, expected once" in message
    if mode == "each_pass":
        assert caught.value.after == "pass 'duplicate_a_step'"     # the culprit, not the pass after it
    else:
        assert "'duplicate_a_step'" in caught.value.after and "each_pass" in caught.value.after


def test_a_bad_check_graphs_value_is_an_option_error():
    with pytest.raises(OptionError, match="check_graphs must be 'each_pass', 'final' or 'off', got 'always'"):
        Options(check_graphs="always")


def test_forward_passes_hand_frozen_records_to_their_backward_passes():
    from socompile.models import build
    from socompile.passes.activation_offload import OffloadedActivations
    from socompile.passes.weight_flow import SavedViews
    from training_helpers import run_pair
    _, _, backend, _ = run_pair(lambda: build("tiny", n_layers=2), steps=1,
                                options={"bucket_size": "256KB", "weight_mode": "flow", "prefetch_distance": 1,
                                         "compute": "eager", "activations": "offload"})
    ctx = backend.compiled[0]
    assert isinstance(ctx.pass_records["weight_flow_forward"], SavedViews)
    offloaded = ctx.pass_records["activation_offload_forward"]
    assert isinstance(offloaded, OffloadedActivations) and offloaded.tensors
    waits = [n for n in ctx.backward_graph.graph.nodes if n.target is torch.ops.socompile.wait_activation.default]
    assert len(waits) == len(offloaded.tensors)        # the backward pass fetched every tensor the record lists
    with pytest.raises(dataclasses.FrozenInstanceError):
        offloaded.tensors = ()
    assert not hasattr(ctx, "flow_saved_chains") and not hasattr(ctx, "activation_offloaded")
