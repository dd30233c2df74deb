"""One compile pipeline (socompile/pipeline.py), planned once: the planner runs exactly once per compile, live
(with recomputed or offloaded layers) and offline; a re-partition re-anchors the plan on the new graphs; per-layer
activation pins are an option (activation_layers)."""
import dataclasses

import pytest
import torch

import socompile
from socompile.models import build
from socompile.options import OptionError, Options
from socompile.plan import planner
from socompile.plan.anchor import anchored
from socompile.plan.search_state import PlanError
from socompile.plan.plan import ACTIVATION_CHOICES, ACTIVATION_PREFETCH_AHEAD
from socompile.passes.table import graph_problems
from training_helpers import batches, lm_loss


@pytest.fixture
def planner_calls(monkeypatch):
    """Counts the planner's runs (every entry point, plan() and plan_with_details(), goes through this one)."""
    calls = []
    real = planner._plan_with_details

    def counting(*args, **kwargs):
        calls.append(args[2])      # the Options it planned with
        return real(*args, **kwargs)
    monkeypatch.setattr(planner, "_plan_with_details", counting)
    return calls


def _compile_one_step(max_grad_norm=None, **options):
    """Compile the 2-layer tiny model with a socompile.AdamW and run one forward and backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("tiny", n_layers=2)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="256KB", max_grad_norm=max_grad_norm)
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "256KB", **options})
    x, y = batches(1)[0]
    lm_loss(torch.compile(model, backend=backend)(x), y).backward()
    opt.step()
    return backend.compiled[0]


# Inductor: ~90 s of compiling on two cores, so with the slow tests (-m slow); eager covers the same pipeline.
@pytest.mark.parametrize("compute", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compile_with_recomputed_layers_plans_once(planner_calls, compute):
    ctx = _compile_one_step(compute=compute, activations="recompute")
    assert ctx.activation_recomputed["layers.0"] > 0 and ctx.activation_recomputed["layers.1"] > 0
    assert len(planner_calls) == 1
    # the plan was re-anchored on the re-partitioned graphs: the invariant checker finds every step point there
    assert graph_problems(ctx, ctx.forward_graph, ctx.backward_graph) == []
    assert all(ctx.ir.bw_order[b.ready_position] == b.ready_after for b in ctx.plan.buckets)


def test_a_compile_with_offloaded_layers_plans_once_and_binds_the_activation_runtime(planner_calls):
    ctx = _compile_one_step(activation_layers={"layers.0": "recompute", "layers.1": "offload"})
    assert len(planner_calls) == 1
    assert planner_calls[0].clipping is False      # the optimizer does not clip: the unclipped step is planned
    assert not any(d.startswith("objective:") for d in ctx.plan.decisions)
    assert dict(ctx.plan.activations) == {"layers.0": "recompute", "layers.1": "offload"}
    assert ctx.activation_offload is not None and ctx.offload.activations is ctx.activation_offload
    assert ctx.activation_offload.stats["offloaded_tensors"] > 0


def test_a_compile_plans_for_the_step_its_optimizer_runs_clipped_or_not(planner_calls):
    """options.clipping left unset is the owning optimizer's max_grad_norm: the planner optimises the clipped
    step (every speculated CPU step redone) only when the optimizer clips."""
    clipped = _compile_one_step(max_grad_norm=1.0)
    assert [o.clipping for o in planner_calls] == [True]
    assert any(d.startswith("objective: the clipped step") for d in clipped.plan.decisions)
    # (an optimizer without max_grad_norm plans unclipped: see the offload test above, which compiles one)


def test_the_clipping_option_reads_true_false_or_none_from_the_environment():
    # offline planning of a clipped run: SOCOMPILE_CLIPPING=1 python -m socompile plan ...
    assert [Options.resolve(environ={"SOCOMPILE_CLIPPING": v}).clipping for v in ("1", "off", "none")] == \
        [True, False, None]


def test_offline_planning_plans_once(planner_calls):
    from socompile.offline import plan_model
    ctx = plan_model("tiny", batch=2, seq=64, options={"activations": "recompute"})
    assert len(planner_calls) == 1
    assert ctx.plan.recompute == "layers"


def test_anchoring_on_the_planned_ir_changes_nothing():
    from socompile.offline import plan_model
    ctx = plan_model("tiny", batch=2, seq=64, run_passes=False)
    assert anchored(ctx.plan, ctx.ir) == ctx.plan


def test_anchoring_moves_each_step_point_to_the_ir_it_is_given():
    from socompile.offline import plan_model
    ctx = plan_model("tiny", batch=2, seq=64, run_passes=False)
    # the same backward order with one more node in front: every step point moves one place, same node key
    shifted = dataclasses.replace(ctx.ir)
    shifted.bw_order = ["bw:extra_first_node", *ctx.ir.bw_order]
    moved = anchored(ctx.plan, shifted)
    assert [b.ready_position for b in moved.buckets] == [b.ready_position + 1 for b in ctx.plan.buckets]
    assert [b.ready_after for b in moved.buckets] == [b.ready_after for b in ctx.plan.buckets]


def test_layer_pins_are_an_option_checked_when_made():
    assert Options(activation_layers={"layers.0": "offload"}).activation_layers == {"layers.0": "offload"}
    with pytest.raises(OptionError, match=r"layer 'layers\.0' has choice 'checkpoint'; allowed: 'keep', "
                                          r"'recompute', 'selective', 'selective_offload', 'offload'"):
        Options(activation_layers={"layers.0": "checkpoint"})
    with pytest.raises(OptionError, match="must be dict or NoneType"):
        Options(activation_layers="layers.0=recompute")
    env = Options.resolve({}, environ={"SOCOMPILE_ACTIVATION_LAYERS": "layers.0=recompute,layers.1=offload"})
    assert env.activation_layers == {"layers.0": "recompute", "layers.1": "offload"}
    with pytest.raises(OptionError, match="layer=choice pairs"):
        Options.resolve({}, environ={"SOCOMPILE_ACTIVATION_LAYERS": "layers.0"})


def test_a_pinned_layer_the_graph_does_not_have_is_a_plan_error_naming_the_layers():
    from socompile.offline import plan_model
    with pytest.raises(PlanError, match=r"activation_layers names \['layers\.7'\].*its layers: layers\.0\.\.3"):
        plan_model("tiny", batch=2, seq=64, options={"activation_layers": {"layers.7": "recompute"}})


def test_pinned_layers_take_their_choice_and_the_others_the_planners():
    from socompile.offline import plan_model
    # 'keep' for every layer, then layers.1 pinned: only that one changes
    ctx = plan_model("tiny", batch=2, seq=64, run_passes=False,
                     options={"activations": "keep", "activation_layers": {"layers.1": "selective"}})
    assert dict(ctx.plan.activations) == {"layers.0": "keep", "layers.1": "selective", "layers.2": "keep",
                                          "layers.3": "keep"}     # the tiny preset has 4 layers


def test_the_activation_prefetch_distance_is_the_plans():
    from socompile.offline import plan_model
    plan = plan_model("tiny", batch=2, seq=64, run_passes=False).plan
    assert plan.activation_prefetch_ahead == ACTIVATION_PREFETCH_AHEAD == 1
    assert "activation_prefetch_ahead" not in plan.to_json()       # a planner constant, not a JSON field


def test_the_compile_context_declares_every_attribute():
    from socompile.context import CompileContext
    ctx = CompileContext(options=Options())
    assert ctx.activation_offload is None and ctx.flow_schedule == {} and ctx.pass_records == {}
    with pytest.raises(AttributeError):
        ctx.repartition = object()     # undeclared (the joint graph is an argument of the pipeline, not state)
