import dataclasses

import pytest

from test_plan_helpers import GB, options, profile, traced
from socompile.plan.planner import PlanError, plan


def test_same_input_gives_byte_identical_plan_json():
    ir = traced()
    assert plan(ir, profile(), options()).to_json() == plan(ir, profile(), options()).to_json()


def test_everything_stays_on_the_gpu_when_memory_is_plentiful_and_the_cpu_is_slow():
    p = plan(traced(), profile(cpu_adam_bandwidth=1e6), options())
    assert all(b.optimizer_site == "device" for b in p.buckets)


def test_gpu_resident_buckets_are_the_ones_whose_gradients_come_last():
    p = plan(traced(), profile(device_bf16_flops=1e9, device_bandwidth=1e9), options(gpu_buckets=2))
    sites = [b.optimizer_site for b in p.buckets]
    assert sites == ["cpu"] * (len(sites) - 2) + ["device", "device"]


def test_options_gpu_buckets_pins_the_count():
    p = plan(traced(), profile(), options(gpu_buckets=1))
    assert sum(b.optimizer_site == "device" for b in p.buckets) == 1


def test_tight_device_budget_moves_optimizer_state_to_the_cpu():
    ir = traced()
    roomy = plan(ir, profile(), options())
    tight = plan(ir, profile(), options(device_memory_budget=roomy.prediction("device_peak_bytes") // 2))
    assert sum(b.optimizer_site == "cpu" for b in tight.buckets) > 0
    assert tight.prediction("device_peak_bytes") <= tight.prediction("device_budget_bytes")


def test_weights_flow_only_when_stationary_weights_do_not_fit():
    ir = traced()
    all_cpu = plan(ir, profile(), options(gpu_buckets=0))
    assert all(b.weight_mode == "stationary" for b in all_cpu.buckets)
    parts = dict(all_cpu.prediction("device_parts"))
    budget = all_cpu.prediction("device_peak_bytes") - parts["stationary weights"] // 2
    flowing = plan(ir, profile(), options(gpu_buckets=0, device_memory_budget=budget))
    flow = [b for b in flowing.buckets if b.weight_mode == "flow"]
    assert flow and all(b.prefetch_distance >= 1 for b in flow)
    assert flowing.prediction("device_peak_bytes") <= budget


def test_infeasible_plan_states_the_minimum_memory_and_what_to_change():
    with pytest.raises(PlanError, match=r"at least [0-9.]+ MB.*sequence length"):   # 2.5 MB, not "0.00 GB"
        plan(traced(), profile(), options(device_memory_budget="1MB"))


def _step(p) -> float:
    return dict(p.predicted)["step_time_s"]


def _stationary_casts(p) -> set[str]:
    return {b.cast_site for b in p.buckets if b.optimizer_site == "cpu" and b.weight_mode == "stationary"}


@pytest.mark.parametrize("where", ["c2c-grace-368", "gh200", "h100-pcie", "slow-cpu"])
def test_the_cast_site_is_the_one_with_the_faster_simulated_step(where):
    """Updated bf16 weights cross as fp32 and are cast on the GPU, or the CPU kernel writes them as bf16 in its
    pass (2 more bytes per param on the CPU) and bf16 crosses: the planner runs its search once per site and
    keeps the faster simulated step (ties: the CPU cast, half the link bytes). Each pinned site's plan is that
    site's own search, so the chosen plan's step is the smaller of the two, on C2C, PCIe and a slow CPU."""
    hw = {"c2c-grace-368": profile(cpu_adam_bandwidth=368e9), "gh200": profile(),
          "h100-pcie": profile("h100-pcie"), "slow-cpu": profile(cpu_adam_bandwidth=20e9)}[where]
    ir = traced(bf16=True)
    chosen = plan(ir, hw, options(gpu_buckets=0))
    on_cpu, on_gpu = (plan(ir, hw, options(gpu_buckets=0, cast_site=site)) for site in ("cpu", "device"))
    assert _step(chosen) == min(_step(on_cpu), _step(on_gpu))
    expected = "cpu" if _step(on_cpu) <= _step(on_gpu) else "device"
    assert _stationary_casts(chosen) == {expected}
    assert {b.param_link_dtype for b in chosen.buckets if b.cast_site == expected and b.optimizer_site == "cpu"
            and b.weight_mode == "stationary"} == {"bfloat16" if expected == "cpu" else "float32"}
    casts = next(line for line in chosen.decisions if line.startswith("casts: "))
    assert "simulated step" in casts and "ps/param" not in casts, casts


def test_the_simulated_step_overrules_the_sum_of_link_and_cpu_times():
    """The sum 4/link vs 2/link + 2/cpu_adam says CPU on gh200 (the CPU Adam streams faster than the link), but
    in a CPU-bound step (one short sequence) the link is idle and the CPU's 2 extra bytes per param are on the
    critical path: the planner casts on the GPU, and the step it plans is faster than the CPU cast's (1 MB
    buckets: with 64 KB ones the per-bucket overheads hide the difference and the two tie)."""
    hw = profile()
    assert 2 / hw.h2d_bandwidth + 2 / hw.adam_bandwidth < 4 / hw.h2d_bandwidth     # the sum's answer: the CPU
    ir = traced(bf16=True)
    chosen = plan(ir, hw, options(gpu_buckets=0, bucket_size="1MB"))
    on_cpu = plan(ir, hw, options(gpu_buckets=0, bucket_size="1MB", cast_site="cpu"))
    assert _stationary_casts(chosen) == {"device"}
    assert _step(chosen) < _step(on_cpu)


def test_bf16_gradients_cross_the_link_as_bf16_and_fp32_models_stay_fp32():
    assert {b.link_dtype for b in plan(traced(bf16=True), profile(), options(gpu_buckets=0)).buckets} == {"bfloat16"}
    assert {b.link_dtype for b in plan(traced(), profile(), options(gpu_buckets=0)).buckets} == {"float32"}


def test_host_memory_too_small_for_ping_pong_falls_back_to_inverse_rollback():
    ir = traced()
    full = plan(ir, profile(), options(gpu_buckets=0))
    need = full.prediction("host_bytes")
    small = plan(ir, profile(host_memory=int(need * 0.8 / 0.9)), options(gpu_buckets=0))
    assert {"exact", "inverse"} >= {b.rollback for b in small.buckets} and \
        any(b.rollback == "inverse" for b in small.buckets)


def test_symbolic_trace_reports_peak_memory_as_a_formula_of_batch_and_seq():
    p = plan(traced(symbolic=True), profile(), options())
    assert "batch*seq" in p.prediction("device_peak_formula")


def test_with_clipping_the_planner_optimises_the_clipped_step():
    """With clipping every CPU step speculated during backward is redone after validation: the planner's GPU
    bucket count is the best for that step (not the unclipped one's), and its predicted step is that step's."""
    from socompile.perf.simulate import simulate
    from socompile.plan.planner import plan_with_details
    ir = traced()
    # a device fast enough that its buckets finish during backward, while CPU steps redone after it are exposed
    hw = profile(device_bf16_flops=2e12, device_bandwidth=4e11)
    unclipped = plan_with_details(ir, hw, options(bucket_size="256KB"))
    clipped = plan_with_details(ir, hw, options(bucket_size="256KB", clipping=True))
    redo = simulate(clipped.plan, clipped.costs, clipped.cost, speculation="redo").step_time
    assert clipped.plan.prediction("step_time_s") == round(redo, 6)
    n = len(clipped.plan.buckets)
    times = [plan(ir, hw, options(bucket_size="256KB", clipping=True, gpu_buckets=k)).prediction("step_time_s")
             for k in range(n + 1)]
    assert clipped.plan.prediction("step_time_s") == min(times)
    # the objective changed the decision, and the clipped step is faster than with the unclipped plan's count
    assert clipped.plan.prediction("gpu_buckets") > unclipped.plan.prediction("gpu_buckets")
    assert redo < simulate(unclipped.plan, unclipped.costs, unclipped.cost, speculation="redo").step_time


def test_without_speculation_the_planner_optimises_the_step_that_validates_first():
    """options.speculate=False: no CPU step starts before validation, so the planner's GPU bucket count is the
    best for that step (simulated with speculation "off"), not for the speculated one, and the plan says so."""
    from socompile.perf.simulate import simulate
    from socompile.plan.planner import plan_with_details
    ir = traced()
    # as above: a device fast enough that CPU steps waiting for the end of backward are exposed
    hw = profile(device_bf16_flops=2e12, device_bandwidth=4e11)
    speculated = plan_with_details(ir, hw, options(bucket_size="256KB"))
    waiting = plan_with_details(ir, hw, options(bucket_size="256KB", speculate=False))
    off = simulate(waiting.plan, waiting.costs, waiting.cost, speculation="off").step_time
    assert waiting.plan.prediction("step_time_s") == round(off, 6)
    assert any(d.startswith("objective: the step without speculation") for d in waiting.plan.decisions)
    n = len(waiting.plan.buckets)
    times = [plan(ir, hw, options(bucket_size="256KB", speculate=False, gpu_buckets=k)).prediction("step_time_s")
             for k in range(n + 1)]
    assert waiting.plan.prediction("step_time_s") == min(times)
    # the objective changed the decision, and the step that runs is faster than with the speculated plan's count
    assert waiting.plan.prediction("gpu_buckets") != speculated.plan.prediction("gpu_buckets")
    assert off < simulate(speculated.plan, speculated.costs, speculated.cost, speculation="off").step_time


def test_automatic_gpu_bucket_count_is_at_least_as_fast_as_every_hand_set_count():
    ir = traced()
    hw = profile(device_bf16_flops=2e11, device_bandwidth=4e10)
    auto = plan(ir, hw, options())
    n = len(auto.buckets)
    times = [plan(ir, hw, options(gpu_buckets=k)).prediction("step_time_s") for k in range(n + 1)]
    assert auto.prediction("step_time_s") <= min(times) + 1e-12
