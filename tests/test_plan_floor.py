"""The least device memory a plan needs: with weight flow it is below what keeping every weight
needs, it scales with the buckets and the tokens, the planner picks a bucket size that reaches it when the user
pinned none, and the PlanError prints it in adaptive units as a number a budget can be set to.

The model: eight Linear(512, 512) (8.4 MB of fp32 weights in 1 MB matrices) on 4 tokens, with a device budget of
60% of its weights, the shape of a reported failure (an 8.5 MB model, 4 tokens, 60%).

Tolerance of the training test: atol 1e-6, the argument of tests/test_backend_training.py (compute="eager" runs
the same aten ops as eager PyTorch on a bitwise copy of the weights; fp32 weights and gradients cross the link
unchanged; only the kernel's correctly rounded sqrt differs from torch's by an ulp, ~1e-8 after one step).
"""
import re

import pytest
import torch
from torch import nn

from socompile.capture.ir import build_ir
from socompile.capture.trace import trace_training_graphs
from socompile.options import Options, parse_bytes
from socompile.plan.memory import runtime_device_bytes
from socompile.plan.planner import PlanError, plan
from test_plan_helpers import profile
from training_helpers import assert_same_params, run_pair

WIDTH, DEPTH, TOKENS = 512, 8, 4


def mlp() -> nn.Module:
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def mse(out, y):
    return nn.functional.mse_loss(out, y)


def data(steps: int = 1):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, TOKENS, WIDTH, generator=g), torch.randn(1, TOKENS, WIDTH, generator=g))
            for _ in range(steps)]


def traced_mlp():
    torch.manual_seed(0)
    model = mlp()
    x, y = data()[0]
    fw, bw, infos = trace_training_graphs(model, (x,), (y,), loss_fn=mse)
    return build_ir(fw, bw, infos), weight_bytes(model)


IR, WEIGHTS = traced_mlp()
ONE_MATRIX = WIDTH * WIDTH * 4          # bytes of one weight matrix (and of its gradient)
PINS = {"bucket_size not pinned": {}, "bucket_size='256KB'": {"bucket_size": "256KB"}}


def plan_options(**kw) -> Options:
    return Options(**kw)    # not test_plan_helpers.options, which pins bucket_size: here the default is the point


def printed_minimum(**kw) -> tuple[int, int, str]:
    """(printed minimum in bytes, the printing's rounding step in bytes, the message) of a 1 KB budget."""
    with pytest.raises(PlanError) as info:
        plan(IR, profile(), plan_options(device_memory_budget="1KB", **kw))
    message = str(info.value)
    found = re.search(r"needs at least ([0-9.]+) ([KMG]?B)\b", message)
    assert found, message
    step = parse_bytes(f"0.1{found.group(2)}") if found.group(2) != "B" else 1
    return parse_bytes(f"{found.group(1)}{found.group(2)}"), step, message


@pytest.mark.parametrize("pin", list(PINS))
def test_a_budget_of_60_percent_of_the_weights_plans_with_weight_flow_and_trains_like_eager(pin):
    budget = int(0.6 * WEIGHTS)
    ours, ref, backend, _ = run_pair(mlp, steps=1, loss_fn=mse, data=data(),
                                     options={"gpu_buckets": None, "device_memory_budget": budget, **PINS[pin]})
    ctx = backend.compiled[0]
    assert any(b.weight_mode == "flow" for b in ctx.plan.buckets)
    if not PINS[pin]:   # 64 MB buckets (one, of all 8.4 MB) cannot fit: the planner chose smaller ones and says so
        assert ctx.plan.bucket_size < WEIGHTS / 2 and ctx.plan.decisions[0].startswith("bucket size: ")
    assert ctx.plan.prediction("device_peak_bytes") <= budget
    # Plan = execution: what the runtime held on the device is what the plan predicted, byte for byte.
    predicted = runtime_device_bytes(ctx.plan, ctx.ir)
    assert ctx.offload.ledger.summary()["peak"] == predicted["peak"] == ctx.plan.prediction("runtime_device_peak_bytes")
    # ... and no more than the budget set aside for it: the weights saved for backward (t(w)) do not keep every
    # flow buffer to the end of the forward, and buffers read by one node together are all counted.
    parts = dict(ctx.plan.prediction("device_parts"))
    assert predicted["peak"] <= parts["stationary weights"] + parts["GPU optimizer state"] + parts["weight-flow buffers"]
    assert_same_params(ours, ref, atol=1e-6)


@pytest.mark.parametrize("pin", list(PINS))
def test_the_floor_with_weight_flow_is_below_the_weights_and_below_the_floor_without(pin):
    floor, _, message = printed_minimum(**PINS[pin])
    assert floor < WEIGHTS, message            # streaming every weight needs less than keeping them all
    size = parse_bytes(re.search(r"(?:bucket_size=|buckets of )([0-9.]+ [KMG]?B)", message).group(1))
    without = plan(IR, profile(), plan_options(bucket_size=size, gpu_buckets=0, weight_mode="stationary"))
    assert floor < without.prediction("device_peak_bytes"), message


def test_activations_are_the_tokens_not_a_weight_gradient():
    # 4 tokens x 512 features x 4 B = 8 KB per activation: 16 saved layer outputs are ~130 KB. A weight's
    # gradient (1 MB) is gradient staging, counted once by the bucket that stages it.
    p = plan(IR, profile(), plan_options(gpu_buckets=0))
    assert p.prediction("activations_bytes") < ONE_MATRIX
    staging = dict(p.prediction("device_parts"))["gradient staging"]
    # 64 MB buckets: one bucket of all 8.4 MB. Its gradients are live once, at the end of the backward (the
    # staging the step holds, plan/step_timeline.py), not twice as "two of the largest bucket in flight" had it.
    assert len(p.buckets) == 1 and staging == p.buckets[0].numel * 4


@pytest.mark.parametrize("pin", list(PINS))
def test_a_budget_at_the_printed_minimum_plans_and_one_print_step_below_does_not(pin):
    floor, step, message = printed_minimum(**PINS[pin])
    assert "0.00" not in message and re.search(r"at least [0-9.]+ [KM]B", message), message
    fits = plan(IR, profile(), plan_options(device_memory_budget=floor, **PINS[pin]))
    assert fits.prediction("device_peak_bytes") <= floor
    with pytest.raises(PlanError):             # the exact minimum lies within one printed step below
        plan(IR, profile(), plan_options(device_memory_budget=floor - step, **PINS[pin]))


def test_a_target_too_small_is_told_the_device_memory_that_plans():
    hw = profile(device_memory=profile().device_reserved + 10**6)    # 1 MB usable
    with pytest.raises(PlanError, match=r"choose a target with at least ([0-9.]+ [KMG]B) of device memory") as info:
        plan(IR, hw, plan_options())
    number, unit = re.search(r"target with at least ([0-9.]+) ([KMG]B)", str(info.value)).groups()
    advised, step = parse_bytes(number + unit), parse_bytes("0.1" + unit)
    assert plan(IR, profile(device_memory=advised), plan_options()).prediction("device_peak_bytes") <= \
        advised - hw.device_reserved
    with pytest.raises(PlanError):             # the advice is the least that plans, to the printed digit
        plan(IR, profile(device_memory=advised - step), plan_options())
