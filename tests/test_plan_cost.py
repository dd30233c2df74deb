import sympy
import pytest

from socompile.perf.cost import CostModel, op_class
from socompile.hardware import PROFILES


def test_matmul_time_is_compute_bound_when_flops_dominate():
    cost = CostModel(PROFILES["gh200"])
    t = cost.node_time("matmul", 2 * 4096**3, 3 * 4096 * 4096 * 2)
    assert t == pytest.approx(2 * 4096**3 / (989e12 * 0.70))


def test_elementwise_time_is_bandwidth_bound():
    cost = CostModel(PROFILES["gh200"])
    assert cost.node_time("memory", 0, 8e9) == pytest.approx(8e9 / (4.0e12 * 0.80))


def test_views_cost_nothing():
    assert op_class("aten.view.default", is_view=True) == "free"
    assert CostModel(PROFILES["gh200"]).node_time("free", 10**12, 10**12) == 0


def test_unsafe_view_costs_nothing_like_a_view():
    """AOTAutograd reshapes each matmul's output with aten._unsafe_view, which the IR does not mark a view (it
    declares no alias): the graph's analysis charges it no time, as it does a view, where it used to charge its
    bytes at HBM bandwidth."""
    from test_plan_helpers import traced
    from socompile.perf.analysis import analyze
    assert op_class("aten._unsafe_view.default") == "free"
    assert op_class("aten._unsafe_view.out") == "memory"     # the .out overload writes a copy
    ir = traced(bf16=True)
    costs = analyze(ir, CostModel(PROFILES["gh200"], ir.symbol_values))
    for order, times in ((ir.fw_order, costs.fw_times), (ir.bw_order, costs.bw_times)):
        reshapes = [i for i, k in enumerate(order) if ir.graph.nodes[k]["op"] == "aten._unsafe_view.default"]
        assert reshapes and not any(ir.graph.nodes[order[i]]["is_view"] for i in reshapes)
        assert [times[i] for i in reshapes] == [0.0] * len(reshapes)


def test_node_time_is_a_formula_of_symbolic_shapes_evaluated_at_given_shapes():
    b, s = sympy.symbols("b s", integer=True, positive=True)
    cost = CostModel(PROFILES["gh200"], {"b": 4, "s": 4096})
    expr = cost.node_time("memory", 0, 8192 * b * s)
    assert expr.free_symbols == {b, s}
    assert cost.value(expr) == pytest.approx(8192 * 4 * 4096 / 3.2e12)


def test_transfer_time_is_latency_plus_bytes_over_the_link():
    cost = CostModel(PROFILES["h100-pcie"])
    assert cost.transfer_time(55e9, "h2d") == pytest.approx(1 + 10e-6)


def test_cpu_adam_time_uses_the_kernels_bytes_per_parameter():
    cost = CostModel(PROFILES["gh200"])
    assert cost.cpu_adam_time(8e9) == pytest.approx(8e9 * 28 / PROFILES["gh200"].adam_bandwidth)
    assert cost.cpu_adam_time(8e9, grad_dtype_bytes=2) < cost.cpu_adam_time(8e9)


def test_attention_flops_are_counted_on_cpu_traces_causal_lower_triangle():
    """The CPU SDPA kernel is not in torch's flop registry: its FLOPs come from the SDPA formulas, causal
    attention counting (s+1)/(2s) of the full score matrix; backward is 2.5x forward (torch's formula)."""
    from test_plan_helpers import traced
    from socompile.models.llama import PRESETS
    ir = traced()                       # tiny, batch 2, seq 64
    cfg = PRESETS["tiny"]
    b, s, h, d = 2, 64, cfg.n_heads, cfg.dim // cfg.n_heads
    full = 4 * b * h * s * s * d
    fw = [ir.graph.nodes[k]["flops"] for k in ir.fw_order if "attention" in ir.graph.nodes[k]["op"]]
    bw = [ir.graph.nodes[k]["flops"] for k in ir.bw_order if "attention" in ir.graph.nodes[k]["op"]]
    assert len(fw) == len(bw) == cfg.n_layers
    assert fw == [full * (s + 1) // (2 * s)] * cfg.n_layers
    assert bw == [int(2.5 * full * (s + 1) / (2 * s))] * cfg.n_layers
