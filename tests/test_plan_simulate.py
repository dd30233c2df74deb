import json

import pytest

from test_chrome_trace import lanes_by_tid
from test_plan_helpers import options, profile, traced
from socompile.plan.planner import plan_with_details
from socompile.hardware.cpu_adam import MEASURED
from socompile.perf.analysis import analyze
from socompile.perf.cost import CostModel
from socompile.perf.simulate import Task, replay, simulate


def test_lanes_run_in_issue_order_and_wait_for_dependencies():
    tasks = [Task("a", "gpu", 1.0, (), "compute"), Task("b", "d2h", 2.0, (0,), "transfer"),
             Task("c", "gpu", 1.0, (), "compute"), Task("d", "cpu0", 1.0, (1, 2), "adam")]
    start, end = replay(tasks)
    assert start == [0.0, 1.0, 1.0, 3.0] and end == [1.0, 3.0, 2.0, 4.0]


def _details():
    # A slow link and CPU make the schedules differ clearly on a tiny model.
    ir = traced(bf16=True)
    return plan_with_details(ir, profile(), options())


def test_zero_offload_is_slower_than_the_superoffload_plan_on_gh200():
    d = _details()
    assert d.zero_offload.step_time > d.simulation.step_time


def test_zero_infinity_is_no_faster_than_zero_offload():
    d = _details()
    inf = simulate(d.plan, d.costs, d.cost, "zero-infinity")
    assert inf.step_time >= d.zero_offload.step_time


def test_zero_offload_runs_deepspeeds_cpu_passes_back_to_back_after_backward():
    """DeepSpeed's step (stage 1/2, offload_optimizer=cpu): unscale_and_clip_grads (a mul_ over the fp32
    gradients), CPU Adam, the cast of the updated weights in the cross-device copy_, each one OpenMP pass over
    all cores: one CPU lane at the whole bandwidth, no idle time between the passes (the K worker lanes of the
    superoffload schedule left the lanes idle between passes that depend on each other); the uploads end it."""
    d = _details()
    z = d.zero_offload
    cpu = [(t, s, e) for t, s, e in zip(z.tasks, z.start, z.end) if t.lane.startswith("cpu")]
    assert {t.lane for t, _, _ in cpu} == {"cpu0"} and z.cpu_lanes == 1
    kinds = [t.name.split(" b")[0] for t, _, _ in cpu]
    n = sum(1 for b in d.plan.buckets)
    assert kinds == ["unscale g", "adam", "cast p"] * n
    assert cpu[0][1] >= z.backward_end
    grads_in = {int(t.name.rsplit("b", 1)[1]): e for t, _, e in zip(z.tasks, z.start, z.end)
                if t.name.startswith("grads b")}
    for (_, _, prev_e), (t, s, _) in zip(cpu, cpu[1:]):   # back to back, unless a gradient is still crossing
        wait = grads_in[int(t.name.rsplit("b", 1)[1])] if t.name.startswith("unscale") else 0.0
        assert s == pytest.approx(max(prev_e, wait), abs=1e-12)
    busy = sum(e - s for _, s, e in cpu)
    assert busy == pytest.approx(sum(d.cost.cpu_cast_time(b.numel, 4, 4) + d.cost.cpu_cast_time(b.numel)
                                     + d.cost.cpu_adam_time(b.numel, 4, False, MEASURED.baseline_of_ours)
                                     for b in d.plan.buckets))
    last_upload = max(e for t, _, e in zip(z.tasks, z.start, z.end) if t.name.startswith("upload"))
    assert z.step_time == last_upload > cpu[-1][2]


def test_step_time_is_at_least_the_gpu_compute_and_utilisation_at_most_one():
    d = _details()
    sim = d.simulation
    assert sim.step_time >= d.costs.fw_time + d.costs.bw_time - 1e-12
    assert 0 < sim.gpu_utilisation <= 1.0 and 0 < sim.mfu <= 1.0


def test_every_cpu_bucket_is_stepped_once_in_the_replay():
    d = _details()
    cpu = [b.index for b in d.plan.buckets if b.optimizer_site == "cpu"]
    names = [t.name for t in d.simulation.tasks if t.kind == "adam"]
    assert sorted(int(n.rsplit("b", 1)[1]) for n in names) == sorted(b.index for b in d.plan.buckets)
    assert len(names) == len(d.plan.buckets) and len(cpu) <= len(names)


def test_unknown_schedule_is_rejected():
    d = _details()
    with pytest.raises(ValueError, match="schedule"):
        simulate(d.plan, d.costs, d.cost, "zero-7")


def test_the_simulated_transfers_move_the_bytes_of_the_plans_transfer_list():
    """One list for the simulator and the runtime (plan/transfers.py): the simulated step's gradient copies,
    uploads, flow fetches and activation copies move, per purpose, what per_step_traffic says a step moves
    (the runtime's opt.traffic() is tested equal to the same sums in tests/test_emulated_training.py)."""
    from socompile.plan.transfers import per_step_traffic
    ir = traced(bf16=True)
    # every kind of bucket in one plan: flow, stationary cast on the device, GPU-stepped; offloaded activations
    d = plan_with_details(ir, profile(), options(gpu_buckets=1, weight_mode="flow:0,2", prefetch_distance=1,
                                                 cast_site="device", activations="offload"))
    assert {(b.weight_mode, b.optimizer_site) for b in d.plan.buckets} >= {("flow", "cpu"), ("stationary", "cpu")}
    purpose = {"grads": "gradients", "upload": "weight upload", "prefetch": "flow fetch", "act out":
               "activation offload", "act in": "activation fetch"}
    simulated: dict[str, float] = {}
    for t in d.simulation.tasks:
        if t.kind == "transfer":
            name = next(p for n, p in purpose.items() if t.name.startswith(n) or f" {n} " in t.name)
            simulated[name] = simulated.get(name, 0) + t.nbytes
    planned: dict[str, int] = {}
    for (_, _, name), nbytes in per_step_traffic(d.plan, ir, layers=d.costs.layers).items():
        planned[name] = planned.get(name, 0) + nbytes
    assert simulated == pytest.approx(planned, rel=1e-12) and "gradients" in planned
    assert ("weight upload" in planned) == any(b.weight_mode == "stationary" and b.optimizer_site == "cpu"
                                               for b in d.plan.buckets)
def test_the_simulated_step_exports_one_complete_event_per_task_on_its_lane():
    d = _details()
    sim = simulate(d.plan, d.costs, d.cost, "zero-offload")
    trace = json.loads(json.dumps(sim.chrome_trace(pid=3)))    # what a viewer reads back
    work = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(work) == len(sim.tasks)
    lanes = lanes_by_tid(trace, 3)
    for event, task, start, end in zip(work, sim.tasks, sim.start, sim.end):
        assert event["name"] == task.name and event["cat"] == task.kind and event["pid"] == 3
        assert lanes[event["tid"]] == task.lane
        assert event["ts"] == start * 1e6 and abs(event["dur"] - (end - start) * 1e6) < 1e-6
    assert set(lanes.values()) == set(sim.lane_of)


def test_socompile_simulate_writes_every_schedule_as_its_own_process(tmp_path, capsys, monkeypatch):
    from socompile.cli import plan_commands
    d = _details()   # planned once per process: the command's own planning is tested elsewhere
    monkeypatch.setattr(plan_commands, "_plan", lambda args: None)
    monkeypatch.setattr(plan_commands, "_details", lambda ctx: d)
    out = tmp_path / "sim.json"
    assert plan_commands.cmd_simulate(["--model", "tiny", "--seq", "64", "--batch", "2", "--target", "gh200",
                         "--trace", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["simulated step (superoffload)", "simulated step (zero-infinity)",
                                          "simulated step (zero-offload)"]
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_on_a_cpu_device_every_lane_takes_the_same_cores_one_task_at_a_time():
    """A CPU-only build (calibrate without CUDA: device_is_host): compute, memcpy "transfers" and the inline
    optimizer share the cores, so the replayed step is the sum of its tasks; as a separate GPU they overlap."""
    hw = profile(host_cores=2)
    d = plan_with_details(traced(bf16=True), hw, options())
    on_cpu = simulate(d.plan, d.costs, CostModel(profile(host_cores=2, device_is_host=True), d.cost.symbol_values))
    assert {t.resource for t in on_cpu.tasks} == {"gpu"}
    assert on_cpu.step_time == pytest.approx(sum(t.duration for t in on_cpu.tasks), rel=1e-9)
    assert {t.lane for t in on_cpu.tasks} == set(d.simulation.lane_of)   # the trace keeps the logical lanes
    as_gpu = simulate(d.plan, d.costs, d.cost)
    assert as_gpu.step_time < on_cpu.step_time


def test_fp32_matmuls_run_at_the_profiles_fp32_rate_where_it_has_one():
    ir = traced()   # an fp32 model
    bf16_rate = profile(device_bf16_flops=1e11)   # a CPU-like rate: the tiny model's matmuls are compute-bound
    slow_fp32 = profile(device_bf16_flops=1e11, device_fp32_flops=1e11 / 3)
    t_same = analyze(ir, CostModel(bf16_rate, ir.symbol_values)).fw_time
    t_fp32 = analyze(ir, CostModel(slow_fp32, ir.symbol_values)).fw_time
    assert t_fp32 > t_same
    assert bf16_rate.matmul_flops("torch.float32") == bf16_rate.device_bf16_flops   # shipped: unchanged
    assert slow_fp32.matmul_flops("torch.bfloat16") == bf16_rate.device_bf16_flops


def test_a_cpu_device_pays_each_kernels_dispatch_and_placeholders_cost_nothing():
    cost = CostModel(profile(device_op_latency=5e-6))
    assert cost.node_time("memory", 0, 0) == 5e-6 and cost.node_time("free", 0, 0) == 0
    assert CostModel(profile()).node_time("memory", 0, 0) == 0   # shipped GPU profiles: launches hidden


# -- a calibrated CPU "device": kernels at the rates measured for their kind, dtype and shape ------------------

BF16, FP32 = "torch.bfloat16", "torch.float32"
ATTENTION_BW = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
ATTENTION_FW = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def measured(*rates, **changes):
    """A CPU-device profile (no GPU efficiency applies to its measured rates) with ``rates``."""
    from socompile.hardware.profiles import KernelRate
    return profile(device_is_host=True, device_kernel_rates=tuple(KernelRate(*r) for r in rates), **changes)


def test_an_attention_node_runs_at_the_measured_rate_of_its_direction_dtype_and_shape():
    hw = measured(("attention", BF16, 20e9, (128, 32)), ("attention_backward", BF16, 8e9, (128, 32)),
                  ("attention_backward", FP32, 30e9, (128, 32)))
    cost = CostModel(hw)
    flops = 1e9   # compute-bound: no bytes
    assert cost.node_time("attention", flops, 0, BF16, ATTENTION_BW, (128, 32)) == pytest.approx(flops / 8e9)
    assert cost.node_time("attention", flops, 0, BF16, ATTENTION_FW, (128, 32)) == pytest.approx(flops / 20e9)
    assert cost.node_time("attention", flops, 0, FP32, ATTENTION_BW, (128, 32)) == pytest.approx(flops / 30e9)
    # a dtype the profile did not measure: the datasheet rate times the class's efficiency, as before
    from socompile.perf.cost import EFFICIENCY
    assert cost.node_time("attention", flops, 0, "torch.float16", ATTENTION_BW, (128, 32)) == pytest.approx(
        flops / (hw.device_bf16_flops * EFFICIENCY["attention"]))


def test_measured_rates_are_interpolated_between_shapes_and_clamped_outside_them():
    hw = measured(("attention_backward", BF16, 8e9, (128, 32)), ("attention_backward", BF16, 32e9, (512, 32)),
                  ("attention_backward", BF16, 16e9, (128, 128)), ("attention_backward", BF16, 64e9, (512, 128)))
    # log-log linear: 256 tokens is halfway between 128 and 512, so the rate is the geometric mean
    assert hw.kernel_flops("attention_backward", BF16, (256, 32)) == pytest.approx(16e9)
    assert hw.kernel_flops("attention_backward", BF16, (256, 64)) == pytest.approx((16e9 * 32e9) ** 0.5)
    assert hw.kernel_flops("attention_backward", BF16, (64, 16)) == 8e9       # below the grid: nearest
    assert hw.kernel_flops("attention_backward", BF16, (4096, 256)) == 64e9   # above it
    assert hw.kernel_flops("attention_backward", FP32, (256, 32)) == 0       # not measured


def test_a_matmul_node_without_dimensions_runs_at_the_rate_of_the_square_of_its_flops():
    """A profile measured before matmuls were keyed by (shortest, longest) side names one side per square."""
    hw = measured(("matmul", BF16, 100e9, (128,)), ("matmul", BF16, 200e9, (512,)), ("matmul", FP32, 70e9, (256,)))
    assert {r.shape for r in hw.device_kernel_rates} == {(128, 128), (512, 512), (256, 256)}
    cost = CostModel(hw)
    at_256 = 2 * 256**3   # a 256-cube of work: halfway (in logs) between the measured sides 128 and 512
    assert cost.node_time("matmul", at_256, 0, BF16) == pytest.approx(at_256 / (100e9 * 200e9) ** 0.5)
    assert cost.node_time("matmul", at_256, 0, FP32) == pytest.approx(at_256 / 70e9)


def test_a_tall_matmul_runs_at_the_rate_measured_for_its_shortest_and_longest_side():
    """Without bf16 matrix instructions a 1024 x 128 x 128 product runs ~1.6x faster than the square of its
    FLOPs (calibrate.py MATMUL_TALL): the node's own dimensions pick the rate, in any order."""
    hw = measured(("matmul", BF16, 3e9, (256, 256)), ("matmul", BF16, 5e9, (128, 1024)),
                  ("matmul", BF16, 3e9, (512, 512)), ("matmul", BF16, 3e9, (256, 2048)))
    cost = CostModel(hw)
    flops = 2 * 1024 * 128 * 128   # the FLOPs of a 256-side square
    for dims in ((1024, 128, 128), (128, 1024, 128), (128, 128, 1024)):   # forward, weight and input gradient
        assert cost.node_time("matmul", flops, 0, BF16, matmul_dims=dims) == pytest.approx(flops / 5e9)
    assert cost.node_time("matmul", flops, 0, BF16) == pytest.approx(flops / 3e9)   # no dimensions: the square


def test_a_bf16_elementwise_node_takes_its_bytes_times_the_measured_bf16_slowdown():
    hw = measured(("elementwise", FP32, 90e9), ("elementwise", BF16, 30e9))
    cost = CostModel(hw)
    fp32 = cost.node_time("memory", 0, 1e6, FP32)
    assert hw.elementwise_slowdown(BF16) == pytest.approx(3.0) and hw.elementwise_slowdown(FP32) == 1.0
    assert cost.node_time("memory", 0, 1e6, BF16) == pytest.approx(3.0 * fp32)


def test_a_profile_without_measured_kernel_rates_charges_as_before():
    """The shipped GPU profiles have no device_kernel_rates: datasheet rates times efficiency, bytes at the
    bandwidth, whatever the dtype or shape (tests/test_plan_golden.py checks their plans byte for byte)."""
    from socompile.perf.cost import EFFICIENCY
    hw = profile()
    cost = CostModel(hw)
    assert hw.device_kernel_rates == () and hw.elementwise_slowdown(BF16) == 1.0
    memory = 1e6 / (hw.device_bandwidth * EFFICIENCY["memory"])
    assert cost.node_time("memory", 0, 1e6, BF16) == pytest.approx(memory)
    assert cost.node_time("attention", 1e12, 0, BF16, ATTENTION_BW, (128, 32)) == pytest.approx(
        1e12 / (hw.device_bf16_flops * EFFICIENCY["attention"]))
    assert cost.node_time("matmul", 1e12, 0, BF16) == pytest.approx(1e12 / (hw.device_bf16_flops
                                                                           * EFFICIENCY["matmul"]))


def test_matmul_nodes_carry_the_dimensions_of_their_product():
    """Every aten.mm of a traced step names (rows, inner, columns) with rows x inner x columns x 2 its FLOPs
    (a bmm or addmm reads its matrices at other positions: the same rule)."""
    from socompile.perf.cost import op_class
    ir = traced()
    mms = [d for _, d in ir.graph.nodes(data=True) if d["kind"] == "call_function"
           and op_class(d["op"], d["is_view"]) == "matmul"]
    assert mms and all(d["matmul_dims"] is not None for d in mms)
    assert all(2 * d["matmul_dims"][0] * d["matmul_dims"][1] * d["matmul_dims"][2] == d["flops"] for d in mms
               if d["op"].startswith("aten.mm"))
    assert any(max(d["matmul_dims"]) > 2 * min(d["matmul_dims"]) for d in mms)   # tiny's tokens exceed its width


def test_attention_nodes_carry_their_dtype_and_query_shape():
    """The CPU attention kernels return (output, logsumexp): the node's dtype is its output's (it was "": every
    attention ran at the bf16 rate), and its (tokens, head dim) choose the measured rate."""
    from socompile.perf.cost import op_class
    ir = traced(bf16=True)   # tiny: 4 heads of 32, traced at seq 64
    attention = [d for _, d in ir.graph.nodes(data=True) if d["kind"] == "call_function"
                 and op_class(d["op"], d["is_view"]) == "attention"]
    assert attention and all(d["dtype"] == BF16 and d["attention_dims"] == (64, 32) for d in attention)


def test_each_cpu_bucket_step_pays_the_measured_runtime_overhead_once():
    """cpu_bucket_overhead: the runtime's Python work around each bucket's kernel (calibrate measures it; 0 in
    the GPU profiles). On a CPU device every task runs one after the other, so the step grows by exactly one
    overhead per CPU-stepped bucket."""
    hw = profile(host_cores=2, device_is_host=True)
    d = plan_with_details(traced(bf16=True), hw, options(gpu_buckets=0))
    cpu_buckets = sum(1 for bk in d.plan.buckets if bk.optimizer_site != "device")
    base = simulate(d.plan, d.costs, CostModel(hw, d.cost.symbol_values))
    slow = simulate(d.plan, d.costs, CostModel(profile(host_cores=2, device_is_host=True, cpu_bucket_overhead=1e-3),
                                               d.cost.symbol_values))
    assert cpu_buckets > 1
    assert slow.step_time - base.step_time == pytest.approx(cpu_buckets * 1e-3, rel=1e-6)
    assert CostModel(hw).cpu_adam_time(0) == 0   # shipped profiles: no overhead charged


def test_each_offloaded_saved_tensor_pays_the_measured_runtime_work_once_out_and_back():
    """activation_offload_overhead: the runtime's work per saved tensor of an offloaded layer, out and back
    (calibrate measures it through the graph's ops; 0 in the GPU profiles)."""
    hw = profile(host_cores=2, device_is_host=True)
    d = plan_with_details(traced(bf16=True), hw, options(gpu_buckets=0, activations="offload"))
    offloaded = [lc for lc in d.costs.layers if dict(d.plan.activations).get(lc.name) == "offload"]
    tensors = sum(lc.saved_tensors for lc in offloaded)
    base = simulate(d.plan, d.costs, CostModel(hw, d.cost.symbol_values))
    slow = simulate(d.plan, d.costs, CostModel(profile(host_cores=2, device_is_host=True,
                                                       activation_offload_overhead=1e-3), d.cost.symbol_values))
    assert offloaded and tensors > len(offloaded)
    assert slow.step_time - base.step_time == pytest.approx(tensors * 1e-3, rel=1e-6)


@pytest.mark.parametrize("tensors", [0, 2])
def test_a_bucket_step_pays_the_runtime_work_per_bucket_and_per_gradient_tensor(tensors):
    """cpu_grad_overhead: the runtime receives each gradient tensor of a bucket on its own (calibrate measures
    it beside the per-bucket work): a bucket of ``tensors`` tensors costs the per-bucket work plus that many."""
    hw = profile(device_is_host=True, cpu_bucket_overhead=1e-3, cpu_grad_overhead=1e-4)
    cost = CostModel(hw)
    kernel = CostModel(profile(device_is_host=True)).cpu_adam_time(1e6, 4, False)
    assert cost.cpu_adam_time(1e6, 4, False, tensors=tensors) == pytest.approx(kernel + 1e-3 + tensors * 1e-4)
    assert cost.bucket_overhead(tensors) == pytest.approx(1e-3 + tensors * 1e-4)


def test_every_bucket_step_cpu_and_device_pays_its_gradient_tensors_in_the_simulated_step():
    """On a CPU device every task runs one after the other, so the step grows by the per-tensor work of every
    bucket's gradient tensors, CPU- and device-stepped alike (both go through the same runtime per tensor)."""
    hw = profile(host_cores=2, device_is_host=True)
    d = plan_with_details(traced(bf16=True), hw, options(gpu_buckets=1))
    assert {bk.optimizer_site for bk in d.plan.buckets} == {"cpu", "device"}
    tensors = sum(len(bk.params) for bk in d.plan.buckets)
    base = simulate(d.plan, d.costs, CostModel(hw, d.cost.symbol_values))
    slow = simulate(d.plan, d.costs, CostModel(profile(host_cores=2, device_is_host=True, cpu_grad_overhead=1e-3),
                                               d.cost.symbol_values))
    assert slow.step_time - base.step_time == pytest.approx(tensors * 1e-3, rel=1e-6)


def test_each_flow_prefetch_pays_the_runtimes_work_per_fetch():
    """weight_fetch_overhead: the runtime's work per flow fetch (prefetch, wait, release) beyond the copy
    hand-off; on a CPU device the step grows by it once per prefetch the step issues."""
    hw = profile(host_cores=2, device_is_host=True)
    d = plan_with_details(traced(bf16=True), hw, options(gpu_buckets=0, weight_mode="flow"))
    base = simulate(d.plan, d.costs, CostModel(hw, d.cost.symbol_values))
    fetches = sum(1 for t in base.tasks if " prefetch b" in t.name)
    slow = simulate(d.plan, d.costs, CostModel(profile(host_cores=2, device_is_host=True,
                                                       weight_fetch_overhead=1e-3), d.cost.symbol_values))
    assert fetches > 1
    assert slow.step_time - base.step_time == pytest.approx(fetches * 1e-3, rel=1e-6)


def test_a_view_node_pays_the_dispatch_of_an_op_where_the_device_pays_it():
    """A view moves no data, but a CPU "device" dispatches it like any op (device_op_latency); on a GPU
    (latency 0, launches hidden) it stays free, so the GPU plans do not change."""
    from socompile.perf.cost import RESHAPE_OPS, op_class
    ir = traced()
    calls = [ir.graph.nodes[k] for k in ir.fw_order if ir.graph.nodes[k]["kind"] == "call_function"]
    views = sum(1 for n in calls if n["is_view"] or n["op"] in RESHAPE_OPS)   # _unsafe_view: a view undeclared
    others = sum(1 for n in calls if op_class(n["op"], n["is_view"]) != "free")   # kernels: paid it before
    base = analyze(ir, CostModel(profile(), ir.symbol_values)).fw_time
    paid = analyze(ir, CostModel(profile(device_op_latency=1e-3), ir.symbol_values)).fw_time
    assert views > 0
    assert paid - base == pytest.approx((views + others) * 1e-3, rel=1e-6)
    assert CostModel(profile()).view_time() == 0


def test_an_elementwise_node_of_a_measured_family_takes_its_elements_at_the_measured_rate_when_slower():
    """Roofline per family: max(bytes at the bandwidth, elements at the family's measured elements/s). A slow
    measured rate (a math op in bf16 on a CPU) sets the time; a fast one leaves the bytes' time; an op of no
    family, or a dtype not measured, is charged as before."""
    from socompile.perf.cost import EFFICIENCY, elementwise_family
    hw = measured(("elementwise_math", BF16, 1e6), ("elementwise_binary", BF16, 1e15))
    cost = CostModel(hw)
    memory = 1e6 / (hw.device_bandwidth * EFFICIENCY["memory"])
    assert elementwise_family("aten.silu.default") == "math" and elementwise_family("aten.mul.Tensor") == "binary"
    assert elementwise_family("aten.sum.dim_IntList") == "reduction" and elementwise_family("aten.cat.default") is None
    assert cost.node_time("memory", 0, 1e6, BF16, "aten.silu.default", elements=5e5) == pytest.approx(0.5)
    assert cost.node_time("memory", 0, 1e6, BF16, "aten.mul.Tensor", elements=5e5) == pytest.approx(memory)
    assert cost.node_time("memory", 0, 1e6, FP32, "aten.silu.default", elements=5e5) == pytest.approx(memory)
    assert cost.node_time("memory", 0, 1e6, BF16, "aten.cat.default", elements=5e5) == pytest.approx(memory)


def test_analysis_gives_an_elementwise_node_its_largest_operands_elements():
    """The traced bf16 model's silu nodes (tiny: batch x seq x hidden elements, bf16) take elements/rate."""
    ir = traced(bf16=True)
    silu = [k for k in ir.fw_order if ir.graph.nodes[k]["op"].startswith("aten.silu")]
    slow = measured(("elementwise_math", BF16, 1.0))   # one element per second: the elements are the time
    times = analyze(ir, CostModel(slow, ir.symbol_values)).fw_times
    cost = CostModel(slow, ir.symbol_values)
    for k in silu:
        elements = cost.value(ir.graph.nodes[k]["bytes"]) / 2
        assert times[ir.fw_order.index(k)] == pytest.approx(elements)
    assert silu
