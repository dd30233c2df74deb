"""The host-memory ledger (opt.host_memory(), runtime/memory.py HostLedger) against the plan's host model
(plan/memory.py host_buffers), byte for byte, by purpose and pinned/pageable, for each single-process plan shape
the runtime supports: on the CPU runtime (shared master: the parameters alias it) and under the emulated CUDA
device (the CUDA path on this CPU: a separate master, pins through the seam)."""
import pytest
import torch

import socompile
from socompile.models import build
from socompile.plan.memory import HostLayout, runtime_host_bytes
from socompile.plan.transfers import per_step_traffic
from socompile.runtime.memory import ACTIVATIONS, LANDING, MOMENTS, SPARES
from training_helpers import batches, lm_loss

def trained(monkeypatch, runtime, dtype=torch.float32, accumulate=1, steps=2, **options):
    """A tiny model compiled for ``runtime`` and trained ``steps`` optimizer steps; (optimizer, compile context).
    On the "cuda" runtime the model and its batches are on the GPU."""
    monkeypatch.setenv("SOCOMPILE_RUNTIME", runtime)
    device = "cuda" if runtime == "cuda" else "cpu"
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(device=device, dtype=dtype)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="256KB", grad_accumulation_steps=accumulate)
    backend = socompile.SuperOffload(compute="eager", bucket_size="256KB", runtime=runtime,
                                     **{"gpu_buckets": 0, **options})
    cmodel = torch.compile(model, backend=backend)
    for k, (x, y) in enumerate(batches(steps * accumulate)):
        lm_loss(cmodel(x.to(device)), y.to(device)).backward()
        if (k + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            if k + 1 == accumulate:   # laid out (the buckets made before the compile are gone): peaks from here
                opt.host_memory()
                opt.host_ledger.reset_peak()
    opt.wait_uploads()
    return opt, backend.compiled[0]


def layout(opt, accumulate=1) -> HostLayout:
    return HostLayout(pins=opt.runtime_kind != "cpu", shared_master=opt.host_master == "shared",
                      accumulation=accumulate > 1)


def assert_ledger_is_the_plan(opt, ctx, accumulate=1):
    planned = runtime_host_bytes(ctx.plan, ctx.ir, layout(opt, accumulate))
    books = opt.host_memory()
    # at the peak (the end of a forward once every buffer exists): every buffer the plan counts, activations too
    assert books["peak_by_purpose"] == planned
    # after the step: the same, less the offloaded activations (the backward consumed them)
    assert books["by_purpose"] == {k: v for k, v in planned.items() if k != ACTIVATIONS}
    assert books["peak"] == sum(v["pinned"] + v["pageable"] for v in planned.values())


EMULATED = {
    "stationary fp32": dict(weight_mode="stationary"),
    "flow fp32": dict(weight_mode="flow", prefetch_distance=1),
    "GPU buckets": dict(gpu_buckets=3, weight_mode="stationary"),
    "activation offload": dict(weight_mode="stationary", activations="offload"),
    "activation offload bf16": dict(weight_mode="stationary", activations="offload", cast_site="device"),
    "accumulation": dict(weight_mode="stationary"),
    "stationary bf16, device cast": dict(weight_mode="stationary", cast_site="device"),
    "stationary bf16, host cast": dict(weight_mode="stationary", cast_site="cpu"),
    "flow bf16": dict(weight_mode="flow", prefetch_distance=1, cast_site="cpu"),
    # fp16 weights: gradients cross and land as fp32 (cast on the device: the CPU kernel reads fp32 or bf16, not
    # fp16), weights go up from a pinned fp16 copy cast on the host, or as the fp32 master cast on the device
    "stationary fp16, host cast": dict(weight_mode="stationary", cast_site="cpu"),
    "stationary fp16, device cast": dict(weight_mode="stationary", cast_site="device"),
    "flow fp16": dict(weight_mode="flow", prefetch_distance=1, cast_site="cpu"),
}
DTYPE = {"activation offload bf16": torch.bfloat16, "stationary bf16, device cast": torch.bfloat16,
         "stationary bf16, host cast": torch.bfloat16, "flow bf16": torch.bfloat16,
         "stationary fp16, host cast": torch.float16, "stationary fp16, device cast": torch.float16,
         "flow fp16": torch.float16}
ACCUMULATE = {"accumulation": 2}
SLOW = {"flow fp32", "GPU buckets", "activation offload", "accumulation", "stationary bf16, host cast", "flow bf16",
        "stationary fp16, device cast"}


def _cases(names):
    return [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in names]


@pytest.mark.parametrize("case", _cases(EMULATED))
def test_emulated_cuda_host_ledger_equals_the_plan(monkeypatch, case):
    opt, ctx = trained(monkeypatch, "emulated", DTYPE.get(case, torch.float32), ACCUMULATE.get(case, 1),
                       **EMULATED[case])
    assert_ledger_is_the_plan(opt, ctx, ACCUMULATE.get(case, 1))
    # and the link traffic, per direction, dtype and purpose (a bf16 model saves fp32 tensors too: a norm's
    # rsqrt, attention's logsumexp, which cross as fp32)
    assert opt.traffic() == per_step_traffic(ctx.plan, ctx.ir, ACCUMULATE.get(case, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("case", list(EMULATED))
def test_cuda_host_ledger_and_traffic_equal_the_plan(monkeypatch, case):
    """The same ledgers on a real GPU: pinned host buffers, copy streams, asynchronous uploads and fetches."""
    opt, ctx = trained(monkeypatch, "cuda", DTYPE.get(case, torch.float32), ACCUMULATE.get(case, 1),
                       **EMULATED[case])
    assert opt.runtime_kind == "cuda"
    assert_ledger_is_the_plan(opt, ctx, ACCUMULATE.get(case, 1))
    assert opt.traffic() == per_step_traffic(ctx.plan, ctx.ir, ACCUMULATE.get(case, 1))


CPU = {
    "shared master": dict(weight_mode="stationary"),
    "shared master, GPU buckets": dict(gpu_buckets=3, weight_mode="stationary"),
    "bf16 flow": dict(weight_mode="flow", prefetch_distance=1, cast_site="cpu"),
}
CPU_DTYPE = {"bf16 flow": torch.bfloat16}


@pytest.mark.parametrize("case", [pytest.param(n, marks=[pytest.mark.slow] if n != "shared master" else [])
                                  for n in CPU])
def test_cpu_runtime_host_ledger_equals_the_plan(monkeypatch, case):
    opt, ctx = trained(monkeypatch, "cpu", CPU_DTYPE.get(case, torch.float32), **CPU[case])
    assert (opt.host_master == "shared") == (case in ("shared master", "shared master, GPU buckets"))
    assert opt.host_memory()["pinned"] == 0           # the CPU runtime pins nothing
    assert_ledger_is_the_plan(opt, ctx)


def test_an_offload_moves_each_saved_output_so_two_views_of_one_tensor_cross_twice():
    """Found on the H200 (docs/runtime.md, "On a GPU"): CUDA's attention saves its output twice, as a view and
    as a detach of it. The offload pass moves one copy per saved output, so the plan's host memory and link
    bytes count each (``LayerCosts.moved``), while the device memory an offload frees counts the tensor once."""
    import networkx as nx
    from socompile.capture.ir import IR
    from socompile.perf.analysis import LayerCosts, _saved_outputs, _view_roots
    from socompile.plan.transfers import offloaded_bytes

    g = nx.DiGraph()
    for key, kind, view in (("fw:mm", "call_function", False), ("fw:view_1", "call_function", True),
                            ("fw:detach_1", "call_function", True), ("fw:primals_1", "placeholder", False),
                            ("fw:t", "call_function", True), ("bw:view_1", "placeholder", False),
                            ("bw:detach_1", "placeholder", False), ("bw:t", "placeholder", False),
                            ("bw:tangents_1", "placeholder", False)):
        g.add_node(key, kind=kind, is_view=view)
    g.add_edges_from([("fw:mm", "fw:view_1"), ("fw:mm", "fw:detach_1"), ("fw:primals_1", "fw:t")])
    ir = IR(graph=g, params={}, fw_order=["fw:primals_1", "fw:mm", "fw:view_1", "fw:detach_1", "fw:t"],
            bw_order=["bw:view_1", "bw:detach_1", "bw:t", "bw:tangents_1"], fw_readers={}, bw_readers={},
            grad_node={}, grad_output_index={})
    # both views of mm are moved; the saved transpose of a weight (primals_1) stays on the device
    assert _saved_outputs(ir, set(), _view_roots(ir)) == [("fw:view_1", "fw:mm"), ("fw:detach_1", "fw:mm")]
    layer = LayerCosts(name="layers.0", fw_span=(0, 1), bw_span=(0, 1), saved=32768.0, saved_expr=32768,
                       boundary=0.0, boundary_expr=0, fw_time=0.0, bw_time=0.0,
                       saved_by_dtype=(("float32", 2 * 32768.0),), saved_tensors=2)
    assert layer.moved == offloaded_bytes(layer, "offload") == 2 * 32768 and layer.saved == 32768
