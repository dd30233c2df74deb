"""Per-layer activation policy (keep / recompute / offload) and the parallel model (dp x Ulysses sp) of the
planner and simulator, on the tiny preset traced at a long sequence under FakeTensorMode."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from test_plan_helpers import options, profile
from socompile.plan.memory import host_memory
from socompile.plan.planner import PlanError, plan, plan_with_details
from socompile.plan.verify import check

SEQ = 16384


@functools.lru_cache(maxsize=None)
def long_ir(seq: int = SEQ):
    from socompile.models import build
    from socompile.offline import plan_model
    ctx = plan_model(lambda: build("tiny", max_seq_len=seq), batch=1, seq=seq, options={"target": "gh200"},
                     dtype=torch.bfloat16, run_passes=False)
    return ctx.ir


# The activation-mix scenarios below were sized on a link of 450 GB/s each way (the datasheet's C2C figure); the
# gh200 profile's measured link is asymmetric (415 GB/s in, 170 out), which moves where offloads hide. They keep
# the symmetric link they were derived for.
SYMMETRIC_LINK = dict(link_bandwidth=450e9, link_bandwidth_d2h=0.0)


def _keep(hw=None, **kw):
    return plan_with_details(long_ir(), hw or profile(**SYMMETRIC_LINK),
                             options(activations="keep", gpu_buckets=0, **kw))


@functools.lru_cache(maxsize=None)
def _mix_setup():
    """A host that holds two offloaded layers (of four) and not the checkpoints of a third (selective_offload),
    and a device budget between what 'one kept, two
    offloaded, one recomputed' needs and what 'two kept, two recomputed' needs (docs/planner.md, decision 3:
    during a layer's backward, kept saved tensors + recomputed inputs + that layer + the next offload in
    flight + two input-sized gradients): two offloads free two inputs, so the mix needs one input less."""
    keep = _keep()
    costs = keep.costs
    layers = costs.layers
    saved = max(lc.saved for lc in layers)
    inputs = max(lc.boundary for lc in layers)
    flows = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1, optimizer_site="cpu")
             for b in keep.plan.buckets]
    reserved = host_memory(flows, 2)[0]
    hw = profile(host_memory=int((reserved + 2.05 * saved) / 0.9), **SYMMETRIC_LINK)
    fixed = keep.plan.prediction("device_peak_bytes") - keep.plan.prediction("activations_bytes")
    budget = int(fixed + costs.saved_bytes - saved + 3.5 * inputs)
    return hw, budget, saved, layers


def test_auto_offloads_what_the_host_holds_and_reruns_the_rest_but_attention():
    """Two offloads fill the host; of the other two layers, 'selective' (re-run all but attention, +0.1 ms each)
    costs less than 'recompute one, keep one' (+0.2 ms) and fits wherever keeping a layer does (it keeps only the
    inputs and attention outputs), by the estimate and by the simulated step alike."""
    hw, budget, saved, layers = _mix_setup()
    d = plan_with_details(long_ir(), hw, options(device_memory_budget=budget))
    choice = dict(d.plan.activations)
    assert [name for name, _ in d.plan.activations] == [lc.name for lc in layers]
    assert list(choice.values()).count("offload") == 2          # the host holds two layers' saved tensors
    assert choice == {"layers.0": "offload", "layers.1": "offload", "layers.2": "selective", "layers.3": "selective"}
    assert d.plan.prediction("activations_offloaded_bytes") == pytest.approx(2 * saved, rel=1e-6)
    assert d.plan.prediction("device_peak_bytes") <= budget
    assert dict(d.plan.prediction("host_parts"))["offloaded activations"] == int(2 * saved)
    line = next(x for x in d.plan.decisions if x.startswith("activations:"))
    assert "offload 2" in line and "selective 2" in line and "keep 0 of 4" in line and "ms" in line
    # Offload is cheaper here (the link hides under the next layer's compute), selective costs a forward less
    # its attention.
    assert d.simulation.step_time > d.costs.fw_time + d.costs.bw_time
    assert check(d.plan, long_ir(), hw, d.costs, d.cost) == []


def test_auto_takes_the_candidate_mix_with_the_fastest_simulated_step():
    """At 250 GB/s a layer's offload is only partly hidden under the next layer's compute by the policy's
    per-layer estimate, which then ranks 'two selective with their checkpoints offloaded, two kept' (+0.20 ms)
    first and 'two offloaded, one selective, one kept' (+0.27 ms) third; the simulated step, where the copies
    overlap the whole forward and backward, is faster with the offloads. Auto simulates its best candidate mixes
    and takes the offloads: its step is the faster of the two mixes planned as given (same placement: every
    bucket on the CPU)."""
    hw, _, saved, layers = _mix_setup()
    keep = _keep()
    costs = keep.costs
    # the host holds four layers' saved tensors (two more than _mix_setup's), the device 4.5 layer inputs
    # beside the kept saved tensors of three layers
    hw = dataclasses.replace(hw, link_bandwidth=250e9, host_memory=int(hw.host_memory + 2.45 * saved / 0.9))
    fixed = keep.plan.prediction("device_peak_bytes") - keep.plan.prediction("activations_bytes")
    budget = int(fixed + costs.saved_bytes - saved + 4.5 * max(lc.boundary for lc in layers))
    opts = options(device_memory_budget=budget, gpu_buckets=0)
    auto = plan_with_details(long_ir(), hw, opts)
    by_estimate = {"layers.0": "selective_offload", "layers.1": "selective_offload", "layers.2": "keep",
                   "layers.3": "keep"}
    offloads = {"layers.0": "offload", "layers.1": "offload", "layers.2": "selective", "layers.3": "keep"}
    step = {name: plan_with_details(long_ir(), hw, opts, activations=tuple(mix.items())).simulation.step_time
            for name, mix in (("estimate", by_estimate), ("offloads", offloads))}
    assert step["offloads"] < step["estimate"]
    assert dict(auto.plan.activations) == offloads
    # the same plan as the pinned one: deterministic arithmetic on the same tasks, equal to the last bit
    assert auto.simulation.step_time == step["offloads"]
    line = next(x for x in auto.plan.decisions if x.startswith("activations:"))
    assert f"the estimate's best {step['estimate']:.4g} s" in line


def test_memory_predicted_per_choice():
    keep = _keep()
    costs = keep.costs
    big = max(lc.saved for lc in costs.layers)
    rec = plan_with_details(long_ir(), profile(), options(activations="recompute", gpu_buckets=0))
    off = plan_with_details(long_ir(), profile(), options(activations="offload", gpu_buckets=0))
    peak = costs.activation_peak
    all_saved = sum(lc.saved for lc in costs.layers)
    inputs = sum(lc.boundary for lc in costs.layers)
    grads = 2 * max(lc.boundary for lc in costs.layers)
    outside = costs.saved_bytes - all_saved     # saved tensors outside the repeated layers (logits, ...)
    assert keep.plan.prediction("activations_bytes") == int(peak)
    # the larger of: the keep-everything peak without the non-kept layers, and a layer's backward
    assert rec.plan.prediction("activations_bytes") == int(max(peak - all_saved + inputs,
                                                               outside + inputs + big + grads))
    assert off.plan.prediction("activations_bytes") == int(max(peak - all_saved + big, outside + 2 * big + grads))
    assert rec.plan.prediction("activations_bytes") < peak and off.plan.prediction("activations_bytes") < peak
    assert off.plan.prediction("activations_offloaded_bytes") == int(all_saved)
    assert dict(off.plan.prediction("host_parts"))["offloaded activations"] == int(all_saved)
    assert dict(rec.plan.prediction("host_parts")).get("offloaded activations", 0) == 0   # no bytes: no part
    assert off.plan.prediction("host_pinned_bytes") - rec.plan.prediction("host_pinned_bytes") == int(all_saved)


def test_forced_choices_apply_to_every_layer_and_the_simulator_charges_them():
    keep = _keep()
    rec = plan_with_details(long_ir(), profile(), options(activations="recompute", gpu_buckets=0))
    off = plan_with_details(long_ir(), profile(), options(activations="offload", gpu_buckets=0))
    assert keep.plan.activations == ()
    assert {c for _, c in rec.plan.activations} == {"recompute"}
    assert {c for _, c in off.plan.activations} == {"offload"}
    # recompute: one forward per layer again in backward, on the GPU lane
    re_tasks = [t for t in rec.simulation.tasks if t.name.startswith("recompute ")]
    assert len(re_tasks) == len(rec.costs.layers)
    assert sum(t.duration for t in re_tasks) == pytest.approx(sum(lc.fw_time for lc in rec.costs.layers))
    gpu = lambda sim: sum(t.duration for t, lane in zip(sim.tasks, sim.lane_of) if lane == "gpu")
    assert gpu(rec.simulation) - gpu(keep.simulation) == pytest.approx(sum(lc.fw_time for lc in rec.costs.layers),
                                                                      rel=1e-6)
    # offload: each layer's saved bytes go out in forward and come back in backward
    outs = [t for t in off.simulation.tasks if t.name.startswith("act out ")]
    ins = [t for t in off.simulation.tasks if t.name.startswith("act in ")]
    assert [t.lane for t in outs] == ["d2h"] * len(off.costs.layers)
    assert [t.lane for t in ins] == ["h2d"] * len(off.costs.layers)
    assert sum(t.nbytes for t in outs) == pytest.approx(sum(lc.saved for lc in off.costs.layers))
    for sim in (rec.simulation, off.simulation):
        assert sim.step_time >= keep.simulation.step_time - 1e-12


def test_a_slow_link_makes_offload_visible_in_the_step_time():
    fast = plan_with_details(long_ir(), profile(), options(activations="offload", gpu_buckets=0))
    slow_hw = profile(link_bandwidth=1e9)
    slow = plan_with_details(long_ir(), slow_hw, options(activations="offload", gpu_buckets=0))
    assert slow.simulation.step_time > fast.simulation.step_time
    # and auto then prefers recomputing (whole layers or all but attention) for the layers it cannot keep
    hw, budget, _, _ = _mix_setup()
    auto = plan(long_ir(), dataclasses.replace(hw, link_bandwidth=1e9), options(device_memory_budget=budget))
    assert "offload" not in {c for _, c in auto.activations} and {"recompute", "selective"} & {
        c for _, c in auto.activations}


def test_offload_that_does_not_fit_the_host_is_an_error_naming_the_way_out():
    hw, budget, saved, _ = _mix_setup()
    with pytest.raises(PlanError, match="activations='auto'"):
        plan(long_ir(), hw, options(activations="offload"))


def test_activation_plans_are_deterministic():
    hw, budget, _, _ = _mix_setup()
    a = plan(long_ir(), hw, options(device_memory_budget=budget)).to_json()
    b = plan(long_ir(), hw, options(device_memory_budget=budget)).to_json()
    assert a == b


def test_report_shows_the_choice_per_layer_group_collapsed():
    from socompile.report import plan_table
    hw, budget, _, layers = _mix_setup()
    p = plan(long_ir(), hw, options(device_memory_budget=budget))
    text = plan_table(p)
    assert "activations" in text.splitlines()[1]
    assert "decision: activations: keep" in text
    rows = [line for line in text.splitlines() if line.startswith("layers.")]
    choices = dict(p.activations)
    for row in rows:
        name = row.split()[0]
        first = name.split("..")[0] if ".." in name else name
        first = first if first.count(".") == 1 else first
        assert choices[first] in row


# ---------------------------------------------------------------- parallel model

def test_sequence_parallel_divides_activations_and_compute_and_adds_all_to_alls():
    one = plan_with_details(long_ir(), profile(), options(gpu_buckets=0, activations="keep"))
    sp4 = plan_with_details(long_ir(), profile(), options(gpu_buckets=0, activations="keep", sp_degree=4))
    assert sp4.costs.activation_peak == pytest.approx(one.costs.activation_peak / 4)
    assert sp4.costs.fw_flops == pytest.approx(one.costs.fw_flops / 4)
    a2a = [t for t in sp4.simulation.tasks if "a2a" in t.name]
    n_attn = len(one.costs.fw_attention)
    assert len(a2a) == 4 * n_attn            # fw: qkv + out, bw: dout + dqkv, per attention
    # (sp-1)/sp of q, k, v and out per attention and direction
    expect = 2 * sum(one.costs.attention_bytes) / 4 * 3 / 4
    assert sum(t.nbytes for t in a2a) == pytest.approx(expect)
    assert sp4.plan.prediction("comm_ulysses_bytes") == int(expect)
    assert {t.lane for t in a2a} == {"net:inter"}          # gh200: one Superchip per node, NDR between them
    assert sp4.plan.prediction("sp_degree") == 4


def test_zero_shards_optimizer_state_per_rank_and_moves_each_bucket_twice():
    # the cast site pinned: the planner picks it by the simulated step, which ZeRO changes (a quarter of the CPU
    # pass per rank), and the CPU cast's bf16 copy is part of the Adam pass compared below
    one = plan_with_details(long_ir(), profile(), options(gpu_buckets=0, activations="keep", cast_site="cpu"))
    dp4 = plan_with_details(long_ir(), profile(), options(gpu_buckets=0, activations="keep", dp_degree=4,
                                                          cast_site="cpu"))
    state1, state4 = (sum(dict(d.plan.prediction("host_parts"))[k] for k in ("fp32 master", "Adam moments"))
                      for d in (one, dp4))
    assert state4 == pytest.approx(state1 / 4, rel=0.01)
    rs = [t for t in dp4.simulation.tasks if t.name.startswith("reduce-scatter")]
    ag = [t for t in dp4.simulation.tasks if t.name.startswith("all-gather")]
    assert len(rs) == len(ag) == len(dp4.plan.buckets)
    numel = sum(b.numel for b in dp4.plan.buckets)
    assert sum(t.nbytes for t in rs) == pytest.approx(numel * 2 * 3 / 4)   # bf16 gradients, (W-1)/W each
    adam = sum(t.duration for t in dp4.simulation.tasks if t.kind == "adam")
    adam1 = sum(t.duration for t in one.simulation.tasks if t.kind == "adam")
    assert adam == pytest.approx(adam1 / 4, rel=1e-6)
    assert dp4.plan.prediction("comm_zero_bytes") == pytest.approx(2 * numel * 2 * 3 / 4, rel=1e-6)


def test_intra_node_groups_use_the_fast_fabric():
    hw = profile(gpus_per_node=4)
    inside = plan_with_details(long_ir(), hw, options(gpu_buckets=0, activations="keep", sp_degree=4))
    across = plan_with_details(long_ir(), profile(), options(gpu_buckets=0, activations="keep", sp_degree=4))
    assert {t.lane for t in inside.simulation.tasks if "a2a" in t.name} == {"net:intra"}
    t_in = sum(t.duration for t in inside.simulation.tasks if "a2a" in t.name)
    t_out = sum(t.duration for t in across.simulation.tasks if "a2a" in t.name)
    assert t_in < t_out


def test_pcie_servers_share_the_host_between_their_gpus():
    from socompile.plan.planner import _per_rank_profile
    from socompile.hardware import PROFILES
    hw = _per_rank_profile(PROFILES["h100-pcie"], 8)
    assert hw.host_memory == PROFILES["h100-pcie"].host_memory // 8
    assert _per_rank_profile(PROFILES["gh200"], 8) == PROFILES["gh200"]


def test_parallel_plans_pass_the_checker_and_are_deterministic():
    opts = options(sp_degree=2, dp_degree=2)
    d = plan_with_details(long_ir(), profile(), opts)
    assert check(d.plan, long_ir(), profile(), d.costs, d.cost) == []
    assert d.plan.to_json() == plan(long_ir(), profile(), opts).to_json()


def test_pinned_choices_are_planned_as_given():
    pinned = (("layers.0", "offload"), ("layers.1", "recompute"))
    d = plan_with_details(long_ir(), profile(), options(gpu_buckets=0), activations=pinned)
    assert d.plan.activations == (("layers.0", "offload"), ("layers.1", "recompute"), ("layers.2", "keep"),
                                  ("layers.3", "keep"))
    assert d.plan.prediction("activations_offload_layers") == 1
    assert sum(1 for t in d.simulation.tasks if t.name.startswith("recompute ")) == 1
    assert any("pinned by the caller" in x for x in d.plan.decisions)
    with pytest.raises(PlanError, match="unknown layers"):
        plan(long_ir(), profile(), options(), activations=(("layers.9", "keep"),))


def test_checker_rejects_bad_activation_choices():
    p = plan(long_ir(), profile(), options(activations="recompute"))
    assert check(p, long_ir(), profile()) == []
    bad = dataclasses.replace(p, activations=(("layers.0", "swap"), ("layers.0", "keep"), ("lm_head", "keep")))
    problems = "\n".join(check(bad, long_ir(), profile()))
    assert "'swap'" in problems and "more than one" in problems and "lm_head" in problems
