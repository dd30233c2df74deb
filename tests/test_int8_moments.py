"""socompile.AdamW(moment_dtype="int8"): the CPU buckets' moments stored as blocks of 16 one-byte codes and an
fp32 scale, stochastically rounded by the kernel (docs/kernel.md, "int8 moments").

Reference: an eager AdamW that keeps each parameter's moments in the same packed blocks, decodes them, takes the
kernel's fp32 step (tests/test_ext_adam.py ``emulate_fp32``) and encodes them again with the same random bits
(socompile/runtime/int8_moments.py, torch ops). A parameter's blocks start at its segment in the bucket (segments
start at multiples of 16 elements), and its bits are a hash of (bucket, step count, bucket element), so the
reference needs only where each parameter sits (the optimizer's public ``buckets``). Its gradients are eager
PyTorch's, which the compiled graph with eager compute reproduces bit for bit: so parameters and the packed
moments must agree byte for byte, with no tolerance.
"""
from __future__ import annotations

import copy

import pytest
import torch

import socompile
from socompile.moment_format import moment_bytes
from socompile.runtime.cpu_adam import round_seed
from socompile.runtime.int8_moments import decode, encode_moments
from test_ext_adam import emulate_fp32
from test_moment_dtype import CASES, HYP, QuantisedAdamW, train_pair

pytest.importorskip("socompile_ext")


class Int8AdamW(QuantisedAdamW):
    """Eager AdamW with int8 block moments, encoded as the kernel encodes them, over ``model``'s parameters placed
    in buckets as ``layout`` says ({parameter name: (bucket index, element offset)}); the bf16 reference's global
    gradient norm."""

    def __init__(self, model, layout, max_grad_norm=None):
        self.params = dict(model.named_parameters())
        self.layout, self.step_count = layout, 0
        self.master = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.m = {n: torch.zeros(moment_bytes("int8", p.numel()), dtype=torch.uint8) for n, p in self.params.items()}
        self.v = {n: torch.zeros(moment_bytes("int8", p.numel()), dtype=torch.uint8) for n, p in self.params.items()}

    def step(self, grad_scale: float = 1.0):
        self.step_count += 1
        hp = dict(step=self.step_count, lr=HYP["lr"], beta1=HYP["betas"][0], beta2=HYP["betas"][1], eps=HYP["eps"],
                  weight_decay=HYP["weight_decay"], grad_scale=grad_scale)
        for name, p in self.params.items():
            bucket, offset = self.layout[name]
            n = p.numel()
            g = p.grad.detach().reshape(-1).float()
            p1, m1, v1 = emulate_fp32(self.master[name].reshape(-1), g, decode(self.m[name], n, True),
                                      decode(self.v[name], n, False), **hp)
            self.master[name] = p1.reshape(p.shape)
            self.m[name], self.v[name] = encode_moments(m1, v1, round_seed(bucket, self.step_count, offset))
            with torch.no_grad():
                p.copy_(self.master[name])   # a bf16 parameter: rounded to nearest, as the kernel's copy
            p.grad = None


def assert_bytewise_equal(opt, ref, model, ref_model):
    with opt.materialized_weights():   # flow buckets hold no device weights between uses
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert torch.equal(p.detach().float().view(torch.int32), q.detach().float().view(torch.int32)), name
    names = {id(t): n for n, t in model.named_parameters()}
    for b in opt.buckets:
        assert b.moment_format == "int8"
        for i, p in enumerate(b.params):
            name = names[id(p)]
            assert torch.equal(b.moment_part(b.exp_avg, i), ref.m[name]), f"exp_avg of {name}"
            assert torch.equal(b.moment_part(b.exp_avg_sq, i), ref.v[name]), f"exp_avg_sq of {name}"


def int8_pair(monkeypatch, *args, **kwargs):
    return train_pair(monkeypatch, *args, moments="int8", reference=Int8AdamW, **kwargs)


# The default suite trains the CPU build (shared master) and the emulated device's bf16 flow buckets; the other
# three shapes (-m slow) run in the default suite with bf16 moments (tests/test_moment_dtype.py), through the same
# bucket code, and the ledger test below trains the emulated bf16 host cast with int8 moments.
DEFAULT_CASES = ("cpu fp32 (shared master)", "emulated bf16 flow")


@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_int8_moments_train_byte_for_byte_as_the_eager_quantised_reference(monkeypatch, case):
    runtime, dtype, options, micro = CASES[case]
    opt, ref, model, ref_model, _, _ = int8_pair(monkeypatch, runtime, dtype, accumulate=micro, options=options)
    assert len(opt.buckets) > 1
    assert any(b.site == "device" for b in opt.buckets) == ("gpu_buckets" in options)
    assert_bytewise_equal(opt, ref, model, ref_model)


def test_a_clipped_speculative_int8_step_is_redone_with_the_same_rounding(monkeypatch):
    """Clipping at validation rolls the speculated steps back (ping-pong: the spare holds int8 blocks too) and
    steps again with the clip coefficient: still byte for byte the reference's clipped step."""
    opt, ref, model, ref_model, _, clipped = int8_pair(monkeypatch, "cpu", clip=0.5, steps=3)
    assert clipped >= 2 and opt.speculator.stats.rolled_back > 0
    spares = [b.spare for b in opt.buckets if b.spare is not None]
    assert spares and all(s[1].dtype == s[2].dtype == torch.uint8 for s in spares)
    assert_bytewise_equal(opt, ref, model, ref_model)


# bf16 weights: -m slow (the bf16-moment twin runs both in the default suite; the int8 bytes are weight-independent)
@pytest.mark.parametrize("bf16_weights", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_offline_plan_with_int8_moments_holds_and_streams_the_bytes_it_says(bf16_weights):
    """Host memory: 2.5 B of moments per element (16 codes + a 4-byte scale per 16, twice) against fp32's 8, to
    the byte (every bucket is a whole number of 16-element blocks); CPU Adam: 4 + 4 + 2.5 read and 4 + 2.5
    written per element with fp32 gradients, as the simulator streams them."""
    from socompile.perf.simulate import simulate
    from socompile.plan.host_work import ADAM_KERNEL, per_step_host_work
    from socompile.plan.planner import plan_with_details
    from socompile.report.table import plan_table
    from test_plan_helpers import options, profile, traced
    ir = traced(bf16=bf16_weights)
    plans = {fmt: plan_with_details(ir, profile(), options(gpu_buckets=0, moment_dtype=fmt))
             for fmt in ("float32", "int8")}
    parts = {fmt: dict(d.plan.prediction("host_parts")) for fmt, d in plans.items()}
    assert parts["int8"]["Adam moments"] * 8 == parts["float32"]["Adam moments"] * 2.5
    assert parts["int8"]["fp32 master"] == parts["float32"]["fp32 master"]
    d = plans["int8"]
    assert d.plan.prediction("moment_bytes") == 1.25
    sim = simulate(d.plan, d.costs, d.cost)
    streamed = sum(t.nbytes for t in sim.tasks if t.kind == "adam")
    predicted = per_step_host_work(d.plan, ir, shared_master=False, weight_bytes=2 if bf16_weights else 4,
                                   validating=False, moment_bytes=1.25)
    assert streamed == sum(predicted[ADAM_KERNEL])
    fp32 = plans["float32"]
    assert sim.step_time <= simulate(fp32.plan, fp32.costs, fp32.cost).step_time   # fewer bytes, never slower
    text = plan_table(d.plan)   # the report names the format and its bytes
    assert "Adam moments: int8, 2.5 B per CPU-stepped parameter (fp32: 8)" in text
    # read p 4, g 4, m 1.25, v 1.25; write p 4, m 1.25, v 1.25 (codes 1 + scale 0.25 per element and moment)
    assert "CPU Adam reads and writes 17 B per parameter with fp32 gradients (fp32 moments: 28)" in text


def test_the_planner_never_gives_int8_moments_the_inverse_rollback():
    """As for bf16 moments (tests/test_moment_dtype.py): with host memory set between the fp32 plan with inverse
    buckets and the int8 plan with every spare, fp32 fits and int8 fails naming why. The int8 ping-pong total is
    5.5 B per CPU parameter below fp32's (held moments 8 -> 2.5) plus as much again for its spares; the usable host
    is set at 0.9 of the fp32 spares (10.8 B per parameter) below the fp32 ping-pong total: 11 B below, so it
    does not fit."""
    from socompile.plan.planner import plan_with_details
    from socompile.plan.search_state import HOST_HEADROOM, PlanError
    from test_plan_helpers import options, profile, traced
    ir = traced(bf16=True)
    roomy = plan_with_details(ir, profile(), options(gpu_buckets=0)).plan
    total, spares = roomy.prediction("host_bytes"), dict(roomy.prediction("host_parts"))["ping-pong spares"]
    tight = profile(host_memory=(total - 0.99 * spares) / HOST_HEADROOM)
    fp32 = plan_with_details(ir, tight, options(gpu_buckets=0)).plan
    assert any(b.rollback == "inverse" for b in fp32.buckets)
    with pytest.raises(PlanError, match="int8 moments cannot use the algebraic inverse"):
        plan_with_details(ir, tight, options(gpu_buckets=0, moment_dtype="int8"))


@pytest.mark.parametrize("runtime, dtype", [("cpu", torch.float32), ("emulated", torch.bfloat16)])
def test_the_ledgers_count_int8_moments_as_the_plan_does(monkeypatch, runtime, dtype):
    """The host ledger books the packed buffers the plan's layout lists (codes and scales, 1.25 B per element and
    moment), and the host-work ledger the bytes the kernel moved, equal to the plan's per-step prediction."""
    from socompile.plan.host_work import per_step_host_work
    from socompile.plan.memory import HostLayout, runtime_host_bytes
    opt, _, _, _, ctx, _ = int8_pair(monkeypatch, runtime, dtype, steps=2, options={"cast_site": "cpu"})
    layout = HostLayout(pins=runtime != "cpu", shared_master=opt.host_master == "shared", moment_dtype="int8")
    planned = runtime_host_bytes(ctx.plan, ctx.ir, layout)
    assert opt.host_memory()["by_purpose"] == planned
    assert planned["Adam moments"]["pageable"] == sum(2 * moment_bytes("int8", b.numel) for b in opt.buckets)
    assert opt.host_work() == per_step_host_work(ctx.plan, ctx.ir, shared_master=opt.host_master == "shared",
                                                 weight_bytes=torch.finfo(dtype).bits // 8, validating=False,
                                                 host_is_device=runtime == "cpu", moment_bytes=1.25)


# bf16: -m slow (its GPU buckets train in the default suite, tests/test_moment_dtype.py, with the same layout code)
@pytest.mark.parametrize("moments", ["int8", pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_device_stepped_buckets_hold_the_moment_format_the_plan_counts(monkeypatch, moments):
    """GPU buckets (device-stepped, emulated device) keep their moments in the optimizer's format: the device
    ledger holds what the plan's runtime walk predicts, and the planner's device estimate counts the same master
    and moment bytes per device bucket (fp32: 12 B per parameter; bf16: 8; int8: 4 + 2 x 1.25, whole blocks)."""
    from socompile.moment_format import moment_bytes as buffer_bytes
    from socompile.plan.memory import device_memory, runtime_device_bytes
    fmt = "int8" if moments == "int8" else "bfloat16"
    opt, _, _, _, ctx, _ = train_pair(monkeypatch, "emulated", torch.bfloat16, steps=2, options={"gpu_buckets": 2},
                                      moments=moments, reference=Int8AdamW if moments == "int8" else QuantisedAdamW)
    device = [b for b in opt.buckets if b.site == "device"]
    assert device and all(b.moment_format == fmt for b in device)
    assert ctx.offload.ledger.summary()["current"] == runtime_device_bytes(ctx.plan, ctx.ir)["fixed"]
    held = sum(b.exp_avg.numel() * b.exp_avg.element_size() * 2 + b.master.numel() * 4 for b in device)
    assert held == sum(4 * b.numel + 2 * buffer_bytes(fmt, b.numel) for b in device)
    estimate = dict(device_memory(ctx.plan.buckets, 2, 0, 0, 0, moment_dtype=fmt).device_parts)
    grads = sum(b.numel for b in ctx.plan.buckets if b.optimizer_site == "device") * 2
    assert estimate["GPU optimizer state"] - grads == sum(4 * b.numel + 2 * buffer_bytes(fmt, b.numel)
                                                         for b in ctx.plan.buckets if b.optimizer_site == "device")


def test_state_dict_is_torchs_fp32_layout_and_round_trips_through_torch(monkeypatch):
    """state_dict() decodes the blocks into torch's fp32 exp_avg / exp_avg_sq (what the next step reads), which
    torch.optim.AdamW loads; loading them back into int8 moments encodes blocks that decode to values within the
    rounding of one encode (each code moves by less than one step of its block's scale), and into fp32 moments
    keeps them exactly."""
    opt, _, model, _, _, _ = int8_pair(monkeypatch, "cpu", steps=2)
    sd = opt.state_dict()
    first = next(iter(sd["state"].values()))
    assert first["exp_avg"].dtype == torch.float32 and first["exp_avg_sq"].dtype == torch.float32
    names = list(dict(model.named_parameters()))
    for k, p in enumerate(model.parameters()):
        assert sd["state"][k]["exp_avg"].shape == p.shape, names[k]
    assert next(iter(opt.state.values()))["exp_avg"].dtype == torch.uint8   # opt.state shows the live blocks
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(twin.parameters(), **HYP)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    for k, p in enumerate(twin.parameters()):
        assert torch.equal(torch_opt.state[p]["exp_avg"], sd["state"][k]["exp_avg"])
    fp32_opt = socompile.AdamW(copy.deepcopy(model).parameters(), **HYP)
    fp32_opt.load_state_dict(copy.deepcopy(sd))
    again = socompile.AdamW(copy.deepcopy(model).parameters(), **HYP, moment_dtype="int8")
    again.load_state_dict(fp32_opt.state_dict())
    for k, entry in again.state_dict()["state"].items():
        for key, top in (("exp_avg", 127), ("exp_avg_sq", 255)):
            want, got = sd["state"][k][key].reshape(-1), entry[key].reshape(-1)
            if key == "exp_avg_sq":   # the codes are of sqrt(v)
                want, got = want.sqrt(), got.sqrt()
            blocks = -(-want.numel() // 16)
            padded = torch.zeros(blocks * 16)
            padded[:want.numel()] = want.abs()
            step = (padded.view(blocks, 16).amax(1) / top).repeat_interleave(16)[:want.numel()]
            # stochastic rounding moves a code by less than one step of the new block's scale; the slack is the
            # fp32 rounding of sqrt(w * w) on both sides: 1 ulp of w <= 2**-23 * 255 steps each, < 1e-4 step
            assert torch.all((got - want).abs() <= step * (1 + 1e-4)), (names[k], key)


ZERO_HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6, max_grad_norm=1e6, bucket_size="1KB",
                  moment_dtype="int8")


def _odd_mlp() -> torch.nn.Module:
    """Layers of odd widths: buckets of 256 elements or one parameter, whose halves mostly do not end at a block."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 29), torch.nn.Tanh(),
                               torch.nn.Linear(29, 3))


def _same_windows(sharded, whole) -> bool:
    """Each of ``sharded``'s windows holds the blocks ``whole`` holds there."""
    return all(torch.equal(a.exp_avg, b.moment_range(b.exp_avg, slice(*a.window)))
               and torch.equal(a.exp_avg_sq, b.moment_range(b.exp_avg_sq, slice(*a.window)))
               for a, b in zip(sharded.buckets, whole.buckets))


def _zero_worker(args: dict) -> dict:
    """dp ranks, ZeRO-sharded socompile.AdamW with int8 moments, every rank on the same micro-batch, beside one
    unsharded socompile.AdamW with int8 moments on it. The reduce-scatter sums W equal fp32 gradients and divides
    by W: exact (W = 2), so both optimizers see the same gradients bit for bit. No clip is taken (the norm bound
    is far above the norm: the clip coefficient, summed over windows in another order, would differ in its last
    bit). Each element draws its rounding bits from its place in the bucket, and a window starts at a block, so the
    sharded run must equal the unsharded one byte for byte. Then: the gathered torch-layout state, and a
    socompile.distributed checkpoint of the sharded state."""
    import socompile.distributed as sd
    from socompile.distributed.checkpoint import full_optimizer_state_dict, load
    topo = sd.init_distributed(timeout_s=60)
    model = _odd_mlp()
    ref = copy.deepcopy(model)
    opt = socompile.AdamW(model.parameters(), **ZERO_HYPER)
    sd.shard_optimizer(opt, topo.world_group)
    ref_opt = socompile.AdamW(ref.parameters(), **ZERO_HYPER)
    gen = torch.Generator().manual_seed(1)
    for _ in range(args["steps"]):
        x = torch.randn(8, 7, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    same_weights = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    same_blocks, straddling = True, 0
    for mine, whole in zip(opt.buckets, ref_opt.buckets):
        lo, hi = mine.window
        straddling += sum(0 < lo - o < n or 0 < hi - o < n for o, n in zip(mine.offsets, mine.sizes))
        for a, b in ((mine.exp_avg, whole.exp_avg), (mine.exp_avg_sq, whole.exp_avg_sq)):
            same_blocks &= torch.equal(a, whole.moment_range(b, slice(lo, hi)))
    gathered = full_optimizer_state_dict(opt)
    if topo.dp_rank == 0:
        expected = ref_opt.state_dict()["state"]
        same_gathered = all(torch.equal(gathered["state"][k][key], expected[k][key])
                            for k in expected for key in ("exp_avg", "exp_avg_sq"))
        same_gathered &= sorted(gathered["state"]) == sorted(expected)
        torch.save(gathered, args["gathered"])
    sd.save(args["checkpoint"], model, opt)   # (its barriers: rank 0's torch.save is done too)
    # the sharded checkpoint loaded by two ranks encodes each window's piece as one process encodes the whole
    # parameter from the gathered torch-layout state
    sharded = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)
    sd.shard_optimizer(sharded, topo.world_group)
    load(args["checkpoint"], None, sharded)
    whole = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)
    whole.load_state_dict(torch.load(args["gathered"]))
    same_loaded = _same_windows(sharded, whole)
    # the same from fp32 moments (not on an int8 grid, so the rounding bits decide codes): a checkpoint and the
    # state_dict() of one process with torch.float32 moments
    sharded = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)
    sd.shard_optimizer(sharded, topo.world_group)
    load(args["fp32 checkpoint"], None, sharded)
    whole = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)
    whole.load_state_dict(torch.load(args["fp32 state"]))
    same_loaded &= _same_windows(sharded, whole)
    unaligned = sum(-(-b.numel // 2) % 16 != 0 for b in opt.buckets)
    held = sum(t.numel() for b in opt.buckets for t in (b.exp_avg, b.exp_avg_sq))
    whole = sum(t.numel() for b in ref_opt.buckets for t in (b.exp_avg, b.exp_avg_sq))
    digest = [float(p.double().sum()) for p in model.parameters()]
    # a compile lays the buckets out again (its plan's buckets): the ranks gather the blocks (unshard_state) and
    # the new windows take theirs, so the state in torch's layout is unchanged
    layout = [(b.numel, tuple(b.offsets)) for b in opt.buckets]
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "2KB",
                                      "dp_degree": topo.world_size})
    torch.compile(model, backend=backend)(torch.randn(8, 7, generator=gen)).square().mean().backward()
    relaid = [(b.numel, tuple(b.offsets)) for b in opt.buckets] != layout
    again = full_optimizer_state_dict(opt)
    if topo.dp_rank == 0:
        same_relaid = all(torch.equal(again["state"][k][key], gathered["state"][k][key])
                          for k in gathered["state"] for key in ("exp_avg", "exp_avg_sq"))
    opt.zero_grad()
    sd.shutdown()
    return {"same_weights": same_weights, "same_blocks": bool(same_blocks), "straddling": straddling,
            "same_loaded": same_loaded, "unaligned": unaligned, "relaid": relaid,
            "same_relaid": same_relaid if topo.dp_rank == 0 else True,
            "same_gathered": same_gathered if topo.dp_rank == 0 else True, "held": held, "whole": whole,
            "digest": digest, "formats": sorted({b.moment_format for b in opt.buckets})}


def test_zero_dp2_with_int8_moments_equals_one_process_byte_for_byte(tmp_path):
    """Windows start at 16-element blocks (plan/bucket_buffers.py zero_block), so ZeRO steps, gathers and saves
    whole blocks: the sharded weights and blocks equal one process's byte for byte (the worker says why no
    tolerance is needed); the gathered torch-layout state is the unsharded state_dict(); a sharded checkpoint,
    loaded by two ranks or one process, encodes the saved fp32 moments as loading that torch-layout state does;
    a compile's new bucket layout keeps the state."""
    from socompile.distributed.checkpoint import load, save
    from socompile.distributed.launch import run_local
    from dist_helpers import assert_ranks_ok
    args = {"steps": 4, "gathered": str(tmp_path / "gathered.pt"), "checkpoint": str(tmp_path / "ckpt"),
            "fp32 checkpoint": str(tmp_path / "fp32"), "fp32 state": str(tmp_path / "fp32.pt")}
    model = _odd_mlp()
    fp32 = socompile.AdamW(model.parameters(), **{**ZERO_HYPER, "moment_dtype": torch.float32})
    for _ in range(3):
        model(torch.randn(8, 7)).square().mean().backward()
        fp32.step()
        fp32.zero_grad()
    save(args["fp32 checkpoint"], model, fp32)
    torch.save(fp32.state_dict(), args["fp32 state"])
    results = run_local(f"{__file__}:_zero_worker", 2, args, timeout_s=150)
    assert_ranks_ok(results)
    out = [r.result for r in results]
    for r in out:
        assert r["formats"] == ["int8"]
        assert r["same_weights"] and r["same_blocks"] and r["same_gathered"] and r["same_loaded"], r
        assert r["relaid"] and r["same_relaid"], r
    assert out[0]["straddling"] > 0, "the test needs a parameter cut between the two ranks' windows"
    assert out[0]["unaligned"] > 0, "the test needs a bucket whose half is not whole blocks"
    assert out[0]["digest"] == out[1]["digest"], "ranks must hold bitwise identical weights"
    assert out[0]["held"] + out[1]["held"] == out[0]["whole"]   # whole blocks, each held by one rank

    opt_a = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)   # one process loads the sharded checkpoint
    load(args["checkpoint"], None, opt_a)
    opt_b = socompile.AdamW(_odd_mlp().parameters(), **ZERO_HYPER)
    opt_b.load_state_dict(torch.load(args["gathered"]))
    assert all(torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
               for a, b in zip(opt_a.buckets, opt_b.buckets))
    assert any(bool(b.exp_avg.any()) for b in opt_a.buckets)


def test_device_side_zero_of_int8_moments_is_refused_naming_the_fix():
    """Device-side ZeRO (a separate fp32 host master on a CUDA runtime) cuts master and moments to chunks on the
    device path, which int8 blocks do not take yet: planner and runtime refuse it with the same error."""
    from socompile.plan.bucket_buffers import BucketStorage, bucket_buffers
    storage = BucketStorage(separate=True, weight_dtype="bfloat16", pins=True, moment_dtype="int8")
    with pytest.raises(NotImplementedError, match="int8 moments.*moment_dtype=torch.bfloat16"):
        bucket_buffers(storage, 4096, 0, 2)
    assert bucket_buffers(storage, 4096, 0, 1)   # one rank: nothing is cut
