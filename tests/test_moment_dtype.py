"""socompile.AdamW(moment_dtype=torch.bfloat16): the CPU buckets' moments stored in bf16, stochastically rounded
by the kernel (docs/kernel.md, "bf16 moments").

Reference: an eager AdamW that keeps its moments in bf16 and rounds them with the same bits. The bits are a
fixed hash of (bucket, step count, element of the bucket) (runtime/cpu_adam.py ``round_seed``), so the
reference needs only where each parameter sits in its bucket (the optimizer's public ``buckets``: index and
offsets). Its fp32 arithmetic is the kernel's order (tests/test_ext_adam.py ``emulate_fp32``), its gradients
are eager PyTorch's, which the compiled graph with eager compute reproduces bit for bit
(tests/test_backend_training.py): so parameters and moments must agree bit for bit, with no tolerance.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import socompile
from socompile.models import build
from socompile.plan.host_work import per_step_host_work
from socompile.plan.memory import HostLayout, runtime_host_bytes
from socompile.runtime.cpu_adam import round_seed
from socompile.runtime.speculation import clip_coefficient
from test_ext_adam import emulate_fp32
from test_ext_moments import round_bits, stochastic_bf16
from training_helpers import batches, lm_loss, use_emulated_device
from dist_helpers import assert_ranks_ok

HYP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class QuantisedAdamW:
    """Eager AdamW with bf16 moments rounded as the kernel rounds them, over ``model``'s parameters placed in
    buckets as ``layout`` says ({parameter name: (bucket index, element offset)})."""

    def __init__(self, model, layout, max_grad_norm=None):
        self.params = dict(model.named_parameters())
        self.layout, self.max_grad_norm, self.step_count = layout, max_grad_norm, 0
        self.master = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.m = {n: torch.zeros(p.numel(), dtype=torch.bfloat16) for n, p in self.params.items()}
        self.v = {n: torch.zeros(p.numel(), dtype=torch.bfloat16) for n, p in self.params.items()}

    def step(self, grad_scale: float = 1.0):
        self.step_count += 1
        hp = dict(step=self.step_count, lr=HYP["lr"], beta1=HYP["betas"][0], beta2=HYP["betas"][1], eps=HYP["eps"],
                  weight_decay=HYP["weight_decay"], grad_scale=grad_scale)
        for name, p in self.params.items():
            bucket, offset = self.layout[name]
            g = p.grad.detach().reshape(-1).float()
            p1, m1, v1 = emulate_fp32(self.master[name].reshape(-1), g, self.m[name].float(), self.v[name].float(),
                                      **hp)
            r = round_bits(round_seed(bucket, self.step_count, offset), p.numel())
            self.master[name] = p1.reshape(p.shape)
            self.m[name], self.v[name] = stochastic_bf16(m1, r), stochastic_bf16(v1, r >> np.uint32(16))
            with torch.no_grad():
                p.copy_(self.master[name])   # a bf16 parameter: rounded to nearest, as the kernel's copy
            p.grad = None

    def grad_norm(self) -> float:
        """The global gradient norm the way socompile computes it (double sum of squares)."""
        return float(sum(p.grad.detach().double().square().sum() for p in self.params.values()) ** 0.5)


def bucket_layout(opt, model) -> dict[str, tuple[int, int]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {name_of[id(p)]: (b.index, b.offsets[i]) for b in opt.buckets for i, p in enumerate(b.params)}


def train_pair(monkeypatch, runtime="cpu", dtype=torch.float32, steps=4, accumulate=1, clip=None, options=None,
               moments=torch.bfloat16, reference=QuantisedAdamW):
    if runtime == "emulated":
        use_emulated_device(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(dtype)
    ref_model = copy.deepcopy(model)
    opt = socompile.AdamW(model.parameters(), **HYP, moment_dtype=moments, max_grad_norm=clip,
                          grad_accumulation_steps=accumulate)
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "64KB",
                                      **(options or {})})
    cmodel = torch.compile(model, backend=backend)
    data = batches(steps * accumulate)
    ref = None
    clipped = 0
    for step in range(steps):
        for x, y in data[step * accumulate:(step + 1) * accumulate]:
            lm_loss(cmodel(x), y).backward()
            lm_loss(ref_model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if ref is None:   # the compiled graph laid the buckets out at its first step
            ref = reference(ref_model, bucket_layout(opt, model))
        scale = 1.0
        if clip is not None:
            assert opt.last_grad_norm == pytest.approx(ref.grad_norm(), rel=1e-12)   # summation order only
            scale = clip_coefficient(opt.last_grad_norm, clip)
            clipped += scale < 1.0
        ref.step(grad_scale=scale)
    opt.wait_uploads()
    return opt, ref, model, ref_model, backend.compiled[0], clipped


def assert_bitwise_equal(opt, ref, model, ref_model):
    with opt.materialized_weights():   # flow buckets hold no device weights between uses
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert torch.equal(p.detach().float().view(torch.int32), q.detach().float().view(torch.int32)), name
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            name = next(n for n, t in model.named_parameters() if t is p)
            m = b.view(b.exp_avg, i).reshape(-1)
            assert m.dtype == torch.bfloat16
            assert torch.equal(m.view(torch.int16), ref.m[name].view(torch.int16)), f"exp_avg of {name}"
            assert torch.equal(b.view(b.exp_avg_sq, i).reshape(-1).view(torch.int16),
                               ref.v[name].view(torch.int16)), f"exp_avg_sq of {name}"


CASES = {   # name: (runtime, parameter dtype, options, micro-batches)
    "cpu fp32 (shared master)": ("cpu", torch.float32, {}, 1),
    "cpu fp32, accumulation": ("cpu", torch.float32, {}, 2),
    "emulated fp32 stationary": ("emulated", torch.float32, {}, 1),
    "emulated bf16, host cast": ("emulated", torch.bfloat16, {"cast_site": "cpu"}, 1),
    "emulated bf16 flow": ("emulated", torch.bfloat16, {"weight_mode": "flow", "prefetch_distance": 1}, 1),
    # device-stepped buckets hold the same format (bucket_buffers): the emulated device's are host tensors,
    # stepped by the CPU kernel; a CUDA device's by torch ops (runtime/device_adam.py, tested alone)
    "emulated bf16, GPU buckets": ("emulated", torch.bfloat16, {"gpu_buckets": 2}, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_moments_train_bit_for_bit_as_the_eager_quantised_reference(monkeypatch, case):
    runtime, dtype, options, micro = CASES[case]
    opt, ref, model, ref_model, _, _ = train_pair(monkeypatch, runtime, dtype, accumulate=micro, options=options)
    assert len(opt.buckets) > 1
    assert any(b.site == "device" for b in opt.buckets) == ("gpu_buckets" in options)
    assert_bitwise_equal(opt, ref, model, ref_model)


def test_a_clipped_speculative_step_is_redone_with_the_same_rounding(monkeypatch):
    """Clipping at validation rolls the speculated bucket steps back (ping-pong: the spare, bf16 like the
    moments) and steps again with the clip coefficient: still bit for bit the reference's clipped step."""
    opt, ref, model, ref_model, _, clipped = train_pair(monkeypatch, "cpu", clip=0.5, steps=3)
    assert clipped >= 2 and opt.speculator.stats.rolled_back > 0   # speculated, then clipped: redone
    assert_bitwise_equal(opt, ref, model, ref_model)


@pytest.mark.parametrize("runtime, dtype", [("cpu", torch.float32), ("emulated", torch.float32),
                                            ("emulated", torch.bfloat16)])
def test_the_ledgers_count_two_byte_moments_as_the_plan_does(monkeypatch, runtime, dtype):
    opt, _, _, _, ctx, _ = train_pair(monkeypatch, runtime, dtype, steps=2, options={"cast_site": "cpu"})
    layout = HostLayout(pins=runtime != "cpu", shared_master=opt.host_master == "shared",
                        moment_dtype="bfloat16")
    planned = runtime_host_bytes(ctx.plan, ctx.ir, layout)
    assert opt.host_memory()["by_purpose"] == planned
    # the moments are 4 B per element of the bucket (2 x bf16), half the fp32 ones
    assert planned["Adam moments"]["pageable"] == 4 * sum(b.exp_avg.numel() for b in opt.buckets)
    assert opt.host_work() == per_step_host_work(ctx.plan, ctx.ir, shared_master=opt.host_master == "shared",
                                                 weight_bytes=torch.finfo(dtype).bits // 8, validating=False,
                                                 host_is_device=runtime == "cpu", moment_bytes=2)


def test_state_dict_is_torchs_fp32_layout_and_loads_into_any_moment_dtype(monkeypatch):
    opt, _, model, _, _, _ = train_pair(monkeypatch, "cpu", steps=2)
    sd = opt.state_dict()
    first = next(iter(sd["state"].values()))
    assert first["exp_avg"].dtype == torch.float32 and first["exp_avg_sq"].dtype == torch.float32
    # opt.state keeps showing the live bf16 buffers (state_dict made fresh entries)
    assert next(iter(opt.state.values()))["exp_avg"].dtype == torch.bfloat16
    # torch.optim.AdamW loads it, and its moments are the bf16 values exactly
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(twin.parameters(), **HYP)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    for k, p in enumerate(twin.parameters()):
        got = torch_opt.state[p]["exp_avg"]
        assert torch.equal(got, sd["state"][k]["exp_avg"])
        assert torch.equal(got.bfloat16().float(), got)   # exactly representable in bf16
    # into fp32 moments and back into bf16 ones: the same values, bit for bit
    fp32_opt = socompile.AdamW(copy.deepcopy(model).parameters(), **HYP)
    fp32_opt.load_state_dict(copy.deepcopy(sd))
    again = socompile.AdamW(copy.deepcopy(model).parameters(), **HYP, moment_dtype=torch.bfloat16)
    again.load_state_dict(fp32_opt.state_dict())
    for k, entry in again.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], sd["state"][k]["exp_avg"])
        assert torch.equal(entry["exp_avg_sq"], sd["state"][k]["exp_avg_sq"])


def test_moment_dtype_errors_name_the_cause_and_the_fix():
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="rollback='inverse'.*cannot undo int8 moments.*moment_dtype='int8'"):
        socompile.AdamW(params, moment_dtype="int8", rollback="inverse")
    with pytest.raises(TypeError, match="moment_dtype must be torch.float32.*or torch.bfloat16, got torch.float16"):
        socompile.AdamW(params, moment_dtype=torch.float16)
    with pytest.raises(ValueError, match="rollback='inverse'.*cannot undo bf16 moments.*rollback='pingpong'"):
        socompile.AdamW(params, moment_dtype=torch.bfloat16, rollback="inverse")


def test_the_rounding_of_an_element_does_not_depend_on_how_its_bucket_is_cut_into_runs():
    """A parameter without a gradient cuts its bucket into two kernel calls (runs); the elements of the others
    must round with the same bits as in one call (the seed is advanced to the run's start), or a parameter's
    update would depend on whether its neighbour had a gradient. Seen failing with the seed not advanced."""
    from socompile.runtime.cpu_adam import step_bucket
    from socompile.runtime.flat_bucket import FlatBucket
    torch.manual_seed(0)
    sizes = (40, 24, 72)
    group = [dict(lr=HYP["lr"], betas=HYP["betas"], eps=HYP["eps"], weight_decay=HYP["weight_decay"],
                  decoupled=True)]
    moments = []
    grads = [torch.randn(n) for n in sizes]
    for has_grad in ([True, True, True], [True, False, True]):
        params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
        bucket = FlatBucket(3, params, moment_dtype=torch.bfloat16)
        bucket.adopt({})
        bucket.group_of = [0, 0, 0]
        bucket.has_grad = list(has_grad)
        for i, g in enumerate(grads):
            bucket.view(bucket.grad, i).copy_(g)
        assert len(bucket.runs(bucket.group_of)) == (1 if all(has_grad) else 2)   # one call, or two
        step_bucket(bucket, group)
        moments.append([bucket.view(bucket.exp_avg_sq, i).view(torch.int16).clone() for i in range(3)])
    for i in (0, 2):
        assert torch.equal(moments[0][i], moments[1][i]), f"parameter {i}"


def test_the_plan_counts_the_owning_optimizers_moment_format(monkeypatch):
    """The compiled plan takes moment_dtype from the optimizer (pipeline.planning_options), as it takes
    clipping: its host memory counts 2-byte moments, and so does its CPU Adam."""
    opt, _, _, _, ctx, _ = train_pair(monkeypatch, "cpu", steps=1)
    assert ctx.plan.prediction("moment_bytes", 4) == 2
    planned = dict(ctx.plan.prediction("host_parts"))
    assert planned["Adam moments"] == sum(v for v in opt.host_memory()["by_purpose"]["Adam moments"].values())


@pytest.mark.parametrize("bf16_weights", [False, True])
def test_an_offline_plan_with_bf16_moments_holds_and_streams_the_bytes_it_says(bf16_weights):
    from socompile.perf.simulate import simulate
    from socompile.plan.planner import plan_with_details
    from test_plan_helpers import options, profile, traced
    ir = traced(bf16=bf16_weights)
    plans = {fmt: plan_with_details(ir, profile(), options(gpu_buckets=0, moment_dtype=fmt))
             for fmt in ("float32", "bfloat16")}
    parts = {fmt: dict(d.plan.prediction("host_parts")) for fmt, d in plans.items()}
    assert parts["bfloat16"]["Adam moments"] * 2 == parts["float32"]["Adam moments"]
    assert parts["bfloat16"]["fp32 master"] == parts["float32"]["fp32 master"]
    d = plans["bfloat16"]
    sim = simulate(d.plan, d.costs, d.cost)
    streamed = sum(t.nbytes for t in sim.tasks if t.kind == "adam")
    from socompile.plan.host_work import ADAM_KERNEL
    predicted = per_step_host_work(d.plan, ir, shared_master=False, weight_bytes=2 if bf16_weights else 4,
                                   validating=False, moment_bytes=2)
    assert streamed == sum(predicted[ADAM_KERNEL])
    fp32 = plans["float32"]
    assert sim.step_time <= simulate(fp32.plan, fp32.costs, fp32.cost).step_time   # fewer bytes, never slower


def test_the_planner_never_gives_bf16_moments_the_inverse_rollback():
    """Short of host memory, an fp32-moment plan drops ping-pong spares for the algebraic inverse; bf16 moments
    have no inverse, so their plan keeps every spare or fails naming why. The host below is chosen between the
    two: with all spares dropped an fp32 plan needs 12 B per CPU parameter less than with ping-pong (master 4 +
    moments 8), a bf16 plan only 8 less (and its ping-pong total is 8 below fp32's); the usable host is set at
    10.8 B per parameter (0.9 of the fp32 spares) below the fp32 ping-pong total, so fp32 fits with inverse
    buckets and bf16 does not fit at all."""
    from socompile.plan.planner import plan_with_details
    from socompile.plan.search_state import HOST_HEADROOM, PlanError
    from test_plan_helpers import options, profile, traced
    ir = traced(bf16=True)
    roomy = plan_with_details(ir, profile(), options(gpu_buckets=0)).plan
    total, spares = roomy.prediction("host_bytes"), dict(roomy.prediction("host_parts"))["ping-pong spares"]
    tight = profile(host_memory=(total - 0.9 * spares) / HOST_HEADROOM)
    fp32 = plan_with_details(ir, tight, options(gpu_buckets=0)).plan
    assert any(b.rollback == "inverse" for b in fp32.buckets)
    with pytest.raises(PlanError, match="bf16 moments cannot use the algebraic inverse"):
        plan_with_details(ir, tight, options(gpu_buckets=0, moment_dtype="bfloat16"))


def _zero_worker(args: dict) -> dict:
    """dp ranks, ZeRO-sharded socompile.AdamW with bf16 moments, against one unsharded socompile.AdamW with bf16
    moments on the global batch (every rank's micro-batch, gradients averaged as the reduce-scatter does)."""
    import torch.nn.functional as F

    import socompile.distributed as sd
    topo = sd.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    ref = copy.deepcopy(model)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6, max_grad_norm=0.5,
                 bucket_size="40KB", moment_dtype=torch.bfloat16)
    opt = socompile.AdamW(model.parameters(), **hyper)
    sd.shard_optimizer(opt, topo.world_group)
    ref_opt = socompile.AdamW(ref.parameters(), **hyper)
    gen = torch.Generator().manual_seed(1)
    for _ in range(args["steps"]):
        tokens = torch.randint(0, 256, (2 * topo.dp, 33), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * topo.dp_rank, 2 * topo.dp_rank + 2)
        F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
        opt.step()
        opt.zero_grad()
        for rank in range(topo.dp):
            rows = slice(2 * rank, 2 * rank + 2)
            F.cross_entropy(ref(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
        for p in ref.parameters():
            p.grad /= topo.dp
        ref_opt.step()
        ref_opt.zero_grad()
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    moments = {str(b.exp_avg.dtype) for b in opt.buckets}
    held = sum(t.numel() * t.element_size() for b in opt.buckets for t in (b.exp_avg, b.exp_avg_sq))
    whole = sum(t.numel() * t.element_size() for b in ref_opt.buckets for t in (b.exp_avg, b.exp_avg_sq))
    digest = [float(p.double().sum()) for p in model.parameters()]
    sd.shutdown()
    return {"err": err, "moments": sorted(moments), "held": held, "whole": whole, "digest": digest}


def test_zero_dp2_with_bf16_moments_equals_one_process_on_the_global_batch():
    """Tolerance 1e-4 on the weights after 8 steps (lr 1e-3): the fp32 ZeRO test's 3e-5 for the gradients'
    summation order (tests/test_dist_zero.py derives it), plus what the stochastic rounding adds. Both runs draw
    the same bits for an element (its place in the bucket; ZeRO windows do not change it), so a moment rounds
    differently only when the two runs' fp32 values straddle the rounding threshold: then it is one bf16 ulp
    (2^-8 relative) apart. A flip in m moves the updates by at most lr * 2^-8 |m| / sqrt(v) ~ lr * 2^-8 per step,
    decaying with beta1 over the remaining steps (sum <= 1 / (1 - 0.9) = 10): 3.9e-5; one in v by half that
    relative (the square root) over <= 8 steps: 1.6e-5. 3e-5 + 3.9e-5 + 1.6e-5 = 8.5e-5 < 1e-4."""
    from socompile.distributed.launch import run_local
    results = run_local(f"{__file__}:_zero_worker", 2, {"steps": 8}, timeout_s=150)
    assert_ranks_ok(results)
    out = [r.result for r in results]
    for r in out:
        assert r["moments"] == ["torch.bfloat16"]
        assert r["err"] < 1e-4, r["err"]
    assert out[0]["digest"] == out[1]["digest"], "ranks must hold bitwise identical weights"
    assert out[0]["held"] + out[1]["held"] == out[0]["whole"]   # each rank holds its shard's bf16 moments


@pytest.mark.parametrize("option, optimizer", [("bfloat16", torch.float32), ("float32", torch.bfloat16)])
def test_a_moment_option_that_contradicts_the_optimizer_is_refused_naming_both(option, optimizer):
    torch._dynamo.reset()
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters(), **HYP, moment_dtype=optimizer)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(
        {"compute": "eager", "gpu_buckets": 0, "moment_dtype": option}))
    x, y = batches(1)[0]
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,   # Dynamo wraps the backend's error
                       match=f"plan counts {option} Adam moments.*optimizer stores them in") as err:
        lm_loss(cmodel(x), y).backward()
    assert isinstance(err.value.inner_exception, ValueError), err.value
    assert opt.state == {} or all("exp_avg" not in s for s in opt.state.values())   # nothing was stepped
