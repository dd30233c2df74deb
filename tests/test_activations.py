"""Per-layer activations: keep, recompute (activation checkpointing), selective (recompute all but attention) or
offload to host memory (passes/activations.py), and the planner's choice between them at long sequences.

Tolerances. Recompute runs the same aten ops on the same inputs in backward, and offload copies saved tensors
out and back exactly, so with compute="eager" every choice trains bitwise like the compiled 'keep' run; against
eager torch.optim.AdamW the existing tolerance of test_backend_training.py holds (atol 1e-6, see there). With
Inductor, recomputed ops are fused into the backward kernels differently, so that case is compared with eager
at the Inductor tolerance of test_backend_training.py (5e-5).
"""
import dataclasses
import operator
import re
import threading
import weakref

import pytest
import torch

import socompile
from socompile.models import build
from socompile.passes import activations
from socompile.passes.table import graph_problems
from socompile.capture.module_stack import module_path
from socompile.passes.layers import layer_of
from socompile.runtime.activation_offload import IN_FLIGHT, ActivationOffloadRuntime, offloadable
from socompile.runtime.device import CPURuntime, CUDARuntime
from training_helpers import assert_same_params, batches, lm_loss, run_pair

STEPS = 3
MIX = {"layers.0": "recompute", "layers.1": "offload"}


def _model():
    return build("tiny", n_layers=2)


def _train(choice: str, compute: str = "eager", steps: int = STEPS):
    options = {"bucket_size": "256KB", "compute": compute}
    if choice == "mix":
        return run_pair(_model, steps=steps, options={**options, "activation_layers": MIX})
    return run_pair(_model, steps=steps, options={**options, "activations": choice})


@pytest.fixture(scope="module")
def keep_run():
    """The compiled 'keep' run, itself checked against eager torch.optim.AdamW."""
    torch._dynamo.reset()
    ours, ref, backend, _ = _train("keep")
    assert backend.compiled[0].plan.activations == ()
    assert_same_params(ours, ref)
    return {n: p.detach().clone() for n, p in ours.named_parameters()}


def _saved(cmodel, x, rt=None):
    """What autograd saves for one compiled forward: (tensors, device bytes, host-copy bytes), parameters
    (and views of them) left out: they are weights, not activations."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = cmodel(x)
    params = {p.untyped_storage().data_ptr() for p in cmodel.parameters()}
    acts = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    host = [t for t in acts if rt is not None and rt.is_host_copy(t)]
    device = [t for t in acts if not (rt is not None and rt.is_host_copy(t))]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return out, acts, nbytes(device), nbytes(host)


def _compiled(choice: str, **options):
    torch.manual_seed(0)
    model = _model()
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="256KB")
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "256KB",
                                      "activations": choice, **options})
    return model, opt, backend, torch.compile(model, backend=backend)


def _saved_by_layer(choice: str):
    """``choice`` compiled on one batch, forward and backward: (what autograd saves, its device bytes, the saved
    forward outputs by layer, the compile context)."""
    model, opt, backend, cmodel = _compiled(choice)
    x, y = batches(1)[0]
    out, acts, device_bytes, _ = _saved(cmodel, x)
    lm_loss(out, y).backward()
    ctx = backend.compiled[0]
    return acts, device_bytes, _layer_outputs(ctx.forward_graph, ctx.backward_graph, ["layers.0", "layers.1"]), ctx


def _compiled_and_stepped(choice: str, x, y):
    """``choice`` compiled by a first training step on (x, y): (its optimizer, the compiled model, the compile
    context)."""
    model, opt, backend, cmodel = _compiled(choice)
    lm_loss(cmodel(x), y).backward()                   # compile
    opt.step()
    opt.zero_grad()
    return opt, cmodel, backend.compiled[0]


def _layer_outputs(fw, bw, layers):
    """Saved forward outputs (the backward's non-tangent inputs) by the layer that produced them."""
    saved = {n.name for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    output = next(n for n in fw.graph.nodes if n.op == "output")
    out = {}
    for arg in output.args[0]:
        if isinstance(arg, torch.fx.Node) and arg.name in saved:
            out.setdefault(layer_of(arg, layers), []).append(arg)
    return out


@pytest.mark.parametrize("choice", ["recompute", "selective", "selective_offload", "offload", "mix"])
def test_each_choice_trains_like_eager_and_bitwise_like_keep(choice, keep_run):
    ours, ref, backend, _ = _train(choice)
    plan = backend.compiled[0].plan
    want = MIX if choice == "mix" else {"layers.0": choice, "layers.1": choice}
    assert {k: v for k, v in plan.activations if v != "keep"} == want
    assert_same_params(ours, ref)                     # eager torch.optim.AdamW, stated tolerance
    for name, p in ours.named_parameters():           # the compiled 'keep' run, bitwise
        torch.testing.assert_close(p.detach(), keep_run[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def test_recompute_saves_only_each_layer_output_and_recomputes_in_backward():
    counts = {}
    for choice in ("keep", "recompute"):
        acts, device_bytes, by_layer, ctx = _saved_by_layer(choice)
        bw_mm = sum(1 for n in ctx.backward_graph.graph.nodes if n.target is torch.ops.aten.mm.default)
        counts[choice] = (len(acts), device_bytes, by_layer, bw_mm, ctx)
    keep, rec = counts["keep"], counts["recompute"]
    # a checkpointed layer keeps one tensor: its output, the next layer's input ([batch, seq, dim])
    for layer in ("layers.0", "layers.1"):
        assert len(keep[2][layer]) > 5
        assert [tuple(n.meta["val"].shape) for n in rec[2][layer]] == [(2, 32, 128)]
    assert rec[0] < keep[0] and rec[1] < keep[1] / 4     # measured: 30 vs 56 tensors, 175 KB vs 1.28 MB
    # the layers' forward matmuls run again in backward: 6 of the 7 per layer (w_down's output only feeds the
    # residual add, which the backward does not need)
    assert rec[3] == keep[3] + 2 * 6
    ctx = rec[4]
    assert ctx.activation_recomputed["layers.0"] > 20
    # every node the plan names is in the graphs that run (the plan was made again on them)
    names = {n.name for n in ctx.backward_graph.graph.nodes}
    assert all(b.ready_after.split(":", 1)[1] in names for b in ctx.plan.buckets)


def test_offload_moves_saved_layer_activations_to_host_and_the_ledger_books_them_in_flight():
    x, y = batches(1)[0]
    *_, keep_model = _compiled("keep")
    _, keep_acts, keep_device, _ = _saved(keep_model, x)
    opt, cmodel, ctx = _compiled_and_stepped("offload", x, y)
    rt = ctx.activation_offload
    assert rt.ledger is ctx.offload.ledger             # one ledger for everything the runtime holds on the device
    rt.drain()
    baseline = rt.ledger.summary()["current"]
    rt.ledger.reset_peak()
    before = dict(rt.stats)
    out, acts, device, host = _saved(cmodel, x, rt)
    rt.drain()
    offloaded = rt.stats["offloaded_bytes"] - before["offloaded_bytes"]
    assert len(acts) == len(keep_acts)                 # the same tensors are saved ...
    assert host == offloaded > 0                       # ... the layers' ones as host copies
    assert device == keep_device - offloaded           # measured: 1.28 MB -> 165 KB on the device
    assert device < keep_device / 5
    assert rt.in_flight() == 0                         # every device->host copy is done and un-booked
    lm_loss(out, y).backward()
    assert rt.stats["fetched_bytes"] - before["fetched_bytes"] == offloaded
    assert rt.in_flight() == 0 and not rt._fetching and not rt.host_ptrs
    s = rt.ledger.summary()
    # in flight at the peak: more than nothing, at most every offloaded byte (two layers: both, in backward)
    assert 0 < s["peak"] - baseline <= offloaded
    assert s["current"] == baseline
    opt.step()


def test_rewritten_graphs_pass_the_invariant_checkers_with_weight_flow_and_the_checker_names_a_missing_prefetch():
    torch.manual_seed(0)
    model = _model()
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="256KB")
    backend = socompile.SuperOffload(compute="eager", gpu_buckets=0, bucket_size="256KB", weight_mode="flow",
                                     prefetch_distance=1, activation_layers=MIX)
    cmodel = torch.compile(model, backend=backend)
    x, y = batches(1)[0]
    lm_loss(cmodel(x), y).backward()
    ctx = backend.compiled[0]
    assert any(b.weight_mode == "flow" for b in ctx.plan.buckets)
    assert graph_problems(ctx, ctx.forward_graph, ctx.backward_graph) == []   # flow and offload alike
    assert ctx.offload.live_fetched() == 0
    prefetch = [n for n in ctx.backward_graph.graph.nodes
                if n.target is torch.ops.socompile.prefetch_activations.default]
    assert len(prefetch) == 1 and prefetch[0].args[1] == "layers.1"   # one offloaded layer
    hosts = prefetch[0].args[2]
    prefetch[0].args = (*prefetch[0].args[:2], hosts[1:])    # the first host copy would never come back
    problems = graph_problems(ctx, ctx.forward_graph, ctx.backward_graph)
    assert problems == [f"backward: saved activation {hosts[0].name} is prefetched 0 times, expected once"]


def test_dumps_show_the_new_ops_and_the_recompute_partition(tmp_path):
    model, opt, backend, cmodel = _compiled("keep", dump_dir=str(tmp_path), activation_layers=MIX)
    x, y = batches(1)[0]
    lm_loss(cmodel(x), y).backward()
    files = {p.name: p.read_text() for p in tmp_path.glob("*.py")}
    fw = next(t for n, t in files.items() if n.endswith("activation_offload_forward_after.py"))
    bw = next(t for n, t in files.items() if n.endswith("activation_offload_backward_after.py"))
    assert re.search(r"socompile\.offload_activation\.default\(\d+, 'layers\.1', ", fw)
    assert "'layers.0'" not in fw                                    # recomputed, not offloaded
    assert re.search(r"socompile\.prefetch_activations\.default\(\d+, 'layers\.1', \[", bw)
    assert re.search(r"socompile\.wait_activation\.default\(\d+, 'layers\.1', 0, ", bw)
    rec_before = next(t for n, t in files.items() if n.endswith("fw_00_activation_recompute_before.py"))
    rec_after = next(t for n, t in files.items() if n.endswith("fw_00_activation_recompute_after.py"))
    saved = lambda code: code.rsplit("return", 1)[1].count(",")     # noqa: E731
    assert saved(rec_after) < saved(rec_before)


@pytest.mark.slow
def test_inductor_compute_with_recompute_and_offload_matches_eager():
    ours, ref, backend, _ = _train("mix", compute="inductor", steps=3)
    ctx = backend.compiled[0]
    assert ctx.activation_offload.stats["fetched_tensors"] == ctx.activation_offload.stats["offloaded_tensors"] > 0
    assert_same_params(ours, ref, atol=5e-5, rtol=0)


def test_recompute_without_a_socompile_optimizer_trains_like_eager():
    torch.manual_seed(0)
    model = _model()
    ref = build("tiny", n_layers=2)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    backend = socompile.SuperOffload(compute="eager", activations="recompute")
    cmodel = torch.compile(model, backend=backend)
    for x, y in batches(3):
        for m, o in ((cmodel, opt), (ref, ref_opt)):
            lm_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert backend.compiled[0].activation_recomputed
    assert_same_params(model, ref, atol=0, rtol=0)     # same ops, same torch optimizer: bitwise


def _attention_outputs(fw):
    """Forward nodes that are outputs (getitem) of an attention kernel."""
    return {n for n in fw.graph.nodes if n.target is operator.getitem and activations._is_attention(n.args[0])}


def test_selective_saves_inputs_and_attention_outputs_and_recomputes_the_rest_but_attention():
    runs = {}
    for choice in ("keep", "recompute", "selective"):
        acts, device_bytes, by_layer, ctx = _saved_by_layer(choice)
        bw = ctx.backward_graph.graph.nodes
        runs[choice] = dict(n=len(acts), bytes=device_bytes, by_layer=by_layer, ctx=ctx,
                            mm=sum(1 for n in bw if n.target is torch.ops.aten.mm.default),
                            attn=sum(1 for n in bw if activations._is_attention(n)
                                     and "backward" not in str(n.target)),
                            rng=sum(1 for n in bw if "run_with_rng_state" in str(n.target)))
    keep, rec, sel = runs["keep"], runs["recompute"], runs["selective"]
    assert rec["bytes"] < sel["bytes"] < keep["bytes"]      # measured: 175 KB < 322 KB < 1.28 MB
    # per layer: its output (the next layer's input) and the attention kernel's outputs (out, logsumexp)
    attn_out = _attention_outputs(sel["ctx"].forward_graph)
    for layer in ("layers.0", "layers.1"):
        saved = sel["by_layer"][layer]
        assert len(saved) == 3 and sum(n in attn_out for n in saved) == 2
        assert (2, 32, 128) in [tuple(n.meta["val"].shape) for n in saved if n not in attn_out]
    nbytes = lambda n: n.meta["val"].numel() * n.meta["val"].element_size()  # noqa: E731
    # selective = recompute + the attention outputs - the generator state recompute saves to redo attention
    rng = [n for n in rec["ctx"].backward_graph.graph.nodes if n.op == "placeholder" and "rng_state" in n.name]
    assert len(rng) == 2
    assert sel["bytes"] - rec["bytes"] == sum(nbytes(n) for layer in ("layers.0", "layers.1")
                                              for n in sel["by_layer"][layer] if n in attn_out) - \
        sum(nbytes(n) for n in rng)
    # the projections run again (6 matmuls per layer, as for recompute), the attention kernel does not
    assert sel["mm"] == rec["mm"] == keep["mm"] + 2 * 6
    assert keep["attn"] == sel["attn"] == 0 and rec["attn"] + rec["rng"] >= 2
    assert sel["ctx"].plan.activations == (("layers.0", "selective"), ("layers.1", "selective"))
    assert sel["ctx"].plan.prediction("activations_selective_layers") == 2


def test_selective_offload_moves_the_checkpoints_of_selective_layers_to_host():
    """selective_offload = selective's partition + the offload passes: what a selective layer keeps (its output,
    its attention outputs) waits in host memory; on the device only what is outside the layers stays."""
    x, y = batches(1)[0]
    *_, sel_model = _compiled("selective")
    _, sel_acts, sel_device, _ = _saved(sel_model, x)
    opt, cmodel, ctx = _compiled_and_stepped("selective_offload", x, y)
    rt = ctx.activation_offload
    assert ctx.activation_recomputed and ctx.plan.prediction("activations_selective_offload_layers") == 2
    out, acts, device, host = _saved(cmodel, x, rt)
    rt.drain()
    assert len(acts) == len(sel_acts) and host > 0 and device + host == sel_device   # the same tensors, moved
    offloads = [n.args[1] for n in ctx.forward_graph.graph.nodes
                if n.target is torch.ops.socompile.offload_activation.default]
    assert sorted(offloads) == ["layers.0"] * 3 + ["layers.1"] * 3     # output + out + logsumexp, per layer
    lm_loss(out, y).backward()
    assert rt.in_flight() == 0 and not rt._fetching
    opt.step()


# ---------------------------------------------------------------------------------------------- planner
def test_at_long_sequence_auto_keeps_attention_outputs_and_beats_full_recompute():
    """The tiny preset at 16384 tokens (attention is half of a layer's forward), with a device budget that
    fits every layer's input and attention outputs but not one kept layer: auto picks selective for every
    layer, predicts less memory than keep and less step time than full recompute (the simulator re-runs each
    layer's forward less its attention)."""
    from test_plan_activations import long_ir
    from test_plan_helpers import options, profile
    from socompile.plan.memory import host_memory
    from socompile.plan.planner import plan_with_details
    ir = long_ir()
    forced = {c: plan_with_details(ir, profile(), options(activations=c, gpu_buckets=0))
              for c in ("keep", "recompute", "selective")}
    layers = forced["keep"].costs.layers
    assert all(0 < lc.attention_time < lc.fw_time and lc.attention_saved > 0 for lc in layers)
    act = {c: d.plan.prediction("activations_bytes") for c, d in forced.items()}
    assert act["recompute"] < act["selective"] < act["keep"]
    # the policy budgets activations beside every weight streamed (flow buffers: a little more than this plan's
    # fixed part), so one layer's attention outputs of slack; a kept layer would need ~16 of them
    att = layers[0].attention_saved
    fixed = forced["selective"].plan.prediction("device_peak_bytes") - act["selective"]
    budget = int(fixed + act["selective"] + att)
    auto = plan_with_details(ir, profile(), options(gpu_buckets=0, device_memory_budget=budget))
    assert dict(auto.plan.activations) == {lc.name: "selective" for lc in layers}
    assert any(line.startswith("activations: keep 0 of 4 (-), selective 4") for line in auto.plan.decisions)
    step = {c: d.simulation.step_time for c, d in forced.items()}
    assert auto.simulation.step_time == pytest.approx(step["selective"])
    assert step["keep"] < step["selective"] < step["recompute"]
    assert step["recompute"] - step["selective"] == pytest.approx(sum(lc.attention_time for lc in layers), rel=0.05)
    # two layers' attention outputs less: the others keep their checkpoints in host memory (selective_offload,
    # the link hidden under compute), or, with no host memory to spare, fall back to full recompute
    tight = plan_with_details(ir, profile(), options(gpu_buckets=0, device_memory_budget=int(budget - 2 * att)))
    assert set(dict(tight.plan.activations).values()) == {"selective", "selective_offload"}
    assert tight.simulation.step_time == pytest.approx(step["selective"], rel=0.02)
    flows = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1) for b in forced["keep"].plan.buckets]
    no_room = profile(host_memory=int(host_memory(flows, 2)[0] / 0.9))
    tight = plan_with_details(ir, no_room, options(gpu_buckets=0, device_memory_budget=int(budget - 2 * att)))
    assert set(dict(tight.plan.activations).values()) == {"selective", "recompute"}
    assert step["selective"] < tight.simulation.step_time < step["recompute"]


# ---------------------------------------------------------------------------------------------- runtime
def test_runtime_copies_out_and_back_with_the_same_layout_and_books_the_copies_in_flight():
    rt = ActivationOffloadRuntime(CPURuntime())
    gate = threading.Event()
    rt.stream.submit(gate.wait)                       # hold the stream: the copy stays queued
    t = torch.randn(4, 6, 5).permute(2, 0, 1)         # non-contiguous, dense
    want = t.clone()
    ref = weakref.ref(t)
    host = rt.offload("layers.0", t)
    del t
    assert rt.in_flight() == want.numel() * 4         # booked from the offload ...
    assert ref() is not None                          # the runtime holds the original until its copy is done
    gate.set()
    rt.drain()
    assert ref() is None                              # ... and not a moment longer
    assert rt.in_flight() == want.numel() * 4         # ... to the forward's wait for the layer
    rt.wait_offloads("layers.0")
    assert rt.in_flight() == 0
    with pytest.raises(RuntimeError, match="none were queued"):
        rt.wait_offloads("layers.0")
    assert host.stride() == want.stride() and torch.equal(host, want) and rt.is_host_copy(host)
    rt.prefetch("layers.0", [host])
    assert not rt.is_host_copy(host)                  # fetched back: no longer a pending host copy
    with pytest.raises(RuntimeError, match="prefetched twice"):
        rt.prefetch("layers.0", [host])
    back = rt.wait("layers.0", 0)
    assert back.stride() == want.stride() and torch.equal(back, want)
    assert back.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="not prefetched"):
        rt.wait("layers.0", 0)
    s = rt.ledger.summary()
    assert s["current"] == 0 and s["phase_peak"]["forward"] == s["phase_peak"]["backward"] == want.numel() * 4
    rt.device.shutdown()
    assert offloadable(want) and offloadable(torch.randn(4, 6)[:, :3].contiguous())
    assert not offloadable(torch.randn(4, 1).expand(4, 6))      # stride 0: a flat buffer cannot hold it
    assert not offloadable(torch.randn(4, 6)[:, ::2])          # gaps between elements


def test_runtime_on_cuda_uses_a_side_stream_pinned_buffers_and_event_waits_on_the_compute_stream():
    from test_runtime_device import _Recorder
    api = _Recorder()
    rt = ActivationOffloadRuntime(CUDARuntime("cuda", api=api))
    t = torch.randn(3, 4)
    host = rt.offload("layers.0", t)
    assert ("pinned", 12) in api.calls
    kinds = [c[0] for c in api.calls]
    # the side stream waits for the compute stream (t is written there), copies, records an event
    assert kinds.index("wait_stream") < kinds.index("use_stream") < kinds.index("record")
    assert rt.in_flight() == 48
    rt.wait_offloads("layers.0")
    assert api.calls[-1][:2] == ("wait_event", "compute")     # the compute stream waits, the host does not
    assert rt.in_flight() == 0
    rt.prefetch("layers.0", [host])
    assert rt.in_flight() == 48                               # the fetched buffer, until its wait
    back = rt.wait("layers.0", 0)
    assert api.calls[-1][:2] == ("wait_event", "compute")
    assert rt.in_flight() == 0 and torch.equal(back, t)
    assert not any(c[0] == "event_synchronize" for c in api.calls)


def test_module_paths_name_the_layer_groups_of_parameter_names():
    paths = {"L['self'].layers.0.attn": "layers.0.attn",
             "L['self']._modules['layers']._modules['0']": "layers.0",
             "L['self'].model.layers[3].mlp": "model.layers.3.mlp",
             "L['mod'].h.11": "h.11"}
    assert {p: module_path(p) for p in paths} == paths
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {"a": ("L['self'].model", object), "b": ("L['self'].model.layers.12.mlp", object)}
    assert layer_of(node, ["model.layers.1", "model.layers.12"]) == "model.layers.12"
    assert layer_of(node, ["model.layers.1"]) is None
