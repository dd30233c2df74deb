"""The training matrix on the emulated CUDA device (SOCOMPILE_RUNTIME=emulated, runtime/emulated_cuda.py) with
Inductor compute, against the eager reference: torch.optim.AdamW (+ clip_grad_norm_, + skip-on-overflow).

Under the emulator a CPU model takes the CUDA path: a separate host master, gradients copied to pinned host
memory on the "d2h" stream, uploads on the "h2d" stream, flow fetches and activation copies on side streams,
all of them landing after seeded random delays, with hazards (a buffer rewritten or released while a copy still
reads it, a copy's destination read or written before it landed) raised or poisoned to NaN. A run passes when it
saw no hazard and its parameters match the reference.

Tolerances. fp32 models: 5e-5 absolute, the Inductor tolerance of tests/test_backend_training.py (Inductor
fuses and reorders reductions, so gradients differ from eager in the last bits; Adam's normalised update turns
that into differences far below lr = 1e-3: ~2e-5 worst element measured over 10 steps; these runs take 3-4).
A race the emulator makes visible moves a whole tensor to NaN or by ~lr, far outside it. bf16 models: the fp32
master against an fp32 master copy stepped by torch.optim.AdamW on the upcast bf16 gradients, with the bound of
test_device_mirror's Inductor bf16 test (Inductor rounds bf16 once per fused kernel, eager after every op; an
element whose gradient is near zero may step ~lr either way): worst element <= 2 * lr * steps, mean <= 1e-4.
Accumulated bf16 micro-batches add in bf16 on both sides (the landing buffer has the link dtype, as eager's
``.grad`` has the parameters'), so accumulation adds no error of its own to that bound.

Seeds (different delays, so different interleavings of the copies with the compute and the optimizer's worker
thread, and different data): the default suite runs every case at 3 seeds on one compile per case (compiles
dominate: ~10 s each on 2 cores, a 3-step segment well under one): the device is reseeded and the training goes
on from where the previous seed left it, ours and the reference in step. The fp32 tolerance holds over the 9-12
steps this makes (worst element ~2e-5 measured over 10 steps); the bf16 bound grows with the step count. The
slow tests compile afresh for every seed: each case at 3 seeds and at 20.
"""
import copy

import pytest
import torch

import socompile
from socompile.models import build
from socompile.plan.memory import runtime_device_bytes
from socompile.plan.transfers import per_step_traffic
from socompile.runtime.emulated_cuda import emulated_device
from training_helpers import batches, lm_loss

HYP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
FP32_ATOL = 5e-5
SEEDS = (0, 1, 2)

CASES = {
    "stationary": dict(options=dict(weight_mode="stationary")),
    "flow_d0": dict(options=dict(weight_mode="flow", prefetch_distance=0)),
    "flow_d1": dict(options=dict(weight_mode="flow", prefetch_distance=1)),
    "flow_d3": dict(options=dict(weight_mode="flow", prefetch_distance=3)),
    "gpu_buckets": dict(options=dict(gpu_buckets=3, weight_mode="stationary")),
    "bf16": dict(options=dict(weight_mode="stationary", cast_site="device"), dtype=torch.bfloat16),
    "bf16_cast_cpu_accumulate2": dict(options=dict(weight_mode="stationary", cast_site="cpu"), dtype=torch.bfloat16,
                                      accumulate=2),
    "clip_nonfinite": dict(options=dict(weight_mode="stationary"), clip=0.05, nan_at=(1,)),
    # validation on, never clipping: every speculated step is committed (the worker's steps are the final ones)
    "clip_commits": dict(options=dict(weight_mode="stationary"), clip=1e3),
    "accumulate4": dict(options=dict(weight_mode="stationary"), accumulate=4),
    "activations_offload": dict(options=dict(weight_mode="stationary", activations="offload")),
    "selective_offload": dict(options=dict(weight_mode="stationary", activations="selective_offload")),
    "two_forwards": dict(options=dict(weight_mode="stationary"), accumulate=2, two_forwards=True),
}


def emulate(monkeypatch, seed):
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", str(seed))
    device = emulated_device(seed)
    device.hazards.clear()
    return device


class Reference:
    """Eager torch.optim.AdamW on a copy of the model; for a low-precision model, on an fp32 master copy of its
    parameters (upcast gradients, weights cast back after each step), as socompile's separate master does."""

    def __init__(self, model, clip):
        self.model, self.clip = model, clip
        self.params = list(model.parameters())
        low = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params] if low else self.params
        self.opt = torch.optim.AdamW(self.masters, **HYP)

    def step(self):
        if self.masters is not self.params:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
        finite = all(torch.isfinite(m.grad).all() for m in self.masters if m.grad is not None)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        if finite:                     # skip-on-overflow: socompile skips a step whose gradients are not finite
            self.opt.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        if self.masters is not self.params:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)


def train(case, steps=3, seeds=(None,), device=None):
    """Train ``case`` for ``steps`` steps per seed of ``seeds`` on one compile (None: the device's own seed; any
    other: ``device`` reseeded, and that seed's data)."""
    spec = CASES[case]
    accumulate = spec.get("accumulate", 1)
    torch.manual_seed(0)
    ours = build("tiny", n_layers=1).to(spec.get("dtype", torch.float32))
    ref = Reference(copy.deepcopy(ours), spec.get("clip"))
    opt = socompile.AdamW(ours.parameters(), max_grad_norm=spec.get("clip"), grad_accumulation_steps=accumulate,
                          **HYP)
    backend = socompile.SuperOffload({"compute": "inductor", "gpu_buckets": 0, "bucket_size": "128KB",
                                      **spec["options"]})
    cmodel = torch.compile(ours, backend=backend)
    history = []        # (skipped, clipped) of each step
    for seed in seeds:
        if seed is not None:
            device.reseed(seed)
        data = batches(steps * accumulate, seed=seed or 0)
        train_segment(spec, cmodel, ref, opt, data, steps, accumulate, history)
    return ours, ref, opt, backend, history


def train_segment(spec, cmodel, ref, opt, data, steps, accumulate, history):
    for step in range(steps):
        micro = data[step * accumulate:(step + 1) * accumulate]
        scale = float("nan") if step in spec.get("nan_at", ()) else 1.0
        if spec.get("two_forwards"):    # every forward of the step first, then their backwards
            losses = [lm_loss(cmodel(x).float(), y) * scale for x, y in micro]
            for loss in losses:
                loss.backward()
        else:
            for x, y in micro:
                (lm_loss(cmodel(x).float(), y) * scale).backward()
        for x, y in micro:
            (lm_loss(ref.model(x).float(), y) * scale).backward()
        opt.step()
        history.append((opt.last_step_skipped, opt.last_step_clipped))
        opt.zero_grad()
        ref.step()


def assert_matches_reference(ours, ref, opt):
    masters = [opt.param_slots[id(p)][0].view(opt.param_slots[id(p)][0].master, opt.param_slots[id(p)][1]).reshape(p.shape)
               for p in ours.parameters()]
    if ref.masters is ref.params:
        with opt.materialized_weights():
            for (name, p), q in zip(ours.named_parameters(), ref.params):
                torch.testing.assert_close(p.detach(), q.detach(), atol=FP32_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        return
    steps = max(max(b.steps) for b in opt.buckets)
    diff = torch.cat([(m - r.detach()).abs().flatten() for m, r in zip(masters, ref.masters)])
    assert diff.max() <= 2 * HYP["lr"] * steps and diff.mean() <= 1e-4, (diff.max(), diff.mean())


def check_case(monkeypatch, case, seed, reseeds=(None,)):
    torch._dynamo.reset()     # a fresh compile per call (the slow test loops; Dynamo stops compiling after 8)
    device = emulate(monkeypatch, seed)
    ours, ref, opt, backend, history = train(case, seeds=reseeds, device=device)
    opt.wait_uploads()
    for b in opt.buckets:
        b.wait_grads()
        if b.upload_event is not None:
            b.upload_event.synchronize()
    device.check()                                    # no race seen
    assert opt.host_master == "separate" and opt.cpu_worker == "thread"   # the CUDA treatment
    assert device.counts["copies"] > 0 and device.counts["record_stream"] > 0
    # as in production, the optimizer's runtime and the graph's are two (two h2d streams) on one device
    graph_runtime = backend.compiled[0].offload.device
    assert all(b.runtime is not graph_runtime and b.runtime.api is graph_runtime.api is device for b in opt.buckets)
    assert_matches_reference(ours, ref, opt)
    check_features(case, opt, backend, history, len(reseeds))
    assert_traffic_as_planned(case, opt, backend)


def assert_traffic_as_planned(case, opt, backend):
    """The link traffic of the last step (opt.traffic(), counted at the runtime's copy sites) is the plan's
    per-bucket transfer list summed over one step, byte for byte, per direction, dtype and purpose; and the
    runtime's device ledger holds what the plan predicts (the fp32 upload staging of device casts included)."""
    ctx = backend.compiled[0]
    planned = per_step_traffic(ctx.plan, ctx.ir, CASES[case].get("accumulate", 1))
    assert opt.traffic() == planned, (opt.traffic(), planned)
    assert ctx.offload.ledger.summary()["current"] == runtime_device_bytes(ctx.plan, ctx.ir)["fixed"]


def check_features(case, opt, backend, history, segments=1):
    """The case exercised what it names."""
    ctx = backend.compiled[0]
    if case.startswith("flow"):
        assert all(b.flow for b in opt.buckets if b.site == "cpu")
    if case == "gpu_buckets":
        assert any(b.site == "device" for b in opt.buckets)
    if case == "clip_nonfinite":
        assert [skipped for skipped, _ in history] == [False, True, False] * segments
        assert all(clipped for skipped, clipped in history if not skipped)   # clipped every finite step
    if case == "clip_commits":   # validated and committed: the speculated steps were kept
        assert not any(skipped or clipped for skipped, clipped in history)
        assert opt.speculator.stats.committed > 0 and opt.speculator.stats.redone == 0
    if "offload" in case:
        assert ctx.activation_offload.stats["fetched_tensors"] > 0
    if case.startswith("bf16"):   # gradients land as they crossed (bf16); the kernel reads them directly
        assert all(b.link_dtype == "bfloat16" for b in ctx.plan.buckets)
        assert all(b.grad.dtype == torch.bfloat16 and b.master.dtype == torch.float32 for b in opt.buckets)
        staging = ctx.offload.ledger.summary()["by_category"].get("upload staging", 0)
        if CASES[case]["options"]["cast_site"] == "device":   # the fp32 master crosses; the device casts it
            assert staging == 2 * 4 * max(b.numel for b in opt.buckets) and all(b.device_casts for b in opt.buckets)
            assert all(b._stage16 is None for b in opt.buckets)   # no host bf16 copy was made
        else:
            assert staging == 0 and not any(b.device_casts for b in opt.buckets)


@pytest.mark.parametrize("case", list(CASES))
def test_emulated_training_matches_eager_adamw_at_3_seeds(monkeypatch, case):
    """Every case, 3 seeds (interleavings and data) on one compile: the default suite's matrix."""
    check_case(monkeypatch, case, SEEDS[0], reseeds=SEEDS)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_training_matches_eager_adamw_every_case_3_seeds(monkeypatch, case, seed):
    check_case(monkeypatch, case, seed)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_training_matches_eager_adamw_over_20_seeds(monkeypatch, case):
    for seed in range(100, 120):
        check_case(monkeypatch, case, seed)


def test_without_the_keep_alive_inductor_reuses_a_gradient_buffer_under_its_d2h_copy(monkeypatch):
    """The gradient D2H copy against Inductor's buffer reuse (docs/runtime.md, the emulated device's first risk),
    both ways. The backward hands a bucket's gradients to bucket_grads_ready, whose D2H copy is asynchronous;
    Inductor reuses a dead buffer for a later kernel ("bufN = bufM; del bufM  # reuse").
    Without socompile::grads_copied (today's code before the fix) the copy reads a rewritten buffer: a hazard.
    Each queued operation waits 20 ms here, far longer than the few kernels between the hand-over and the
    reuse, so the copy always runs after it."""
    from socompile.passes import insert_optimizer_steps
    device = emulate(monkeypatch, 7)
    monkeypatch.setattr(device, "_delay", lambda: 0.02)
    monkeypatch.setattr(insert_optimizer_steps, "_grads_copied_async", lambda ctx: False)
    with pytest.raises(Exception, match="rewritten after the copy was queued"):
        _, _, opt, _, _ = train("stationary", steps=1)
        opt.wait_uploads()   # step() returned before the CPU job; the next call that needs its bucket raises
    torch._dynamo.reset()


def test_with_the_keep_alive_each_bucket_waits_for_its_gradient_copy_in_the_graph(monkeypatch):
    device = emulate(monkeypatch, 8)
    monkeypatch.setattr(device, "_delay", lambda: 0.02)
    ours, ref, opt, backend, _ = train("stationary", steps=1)
    ctx = backend.compiled[0]
    kept = [n.args[3] for n in ctx.backward_graph.graph.nodes
            if n.target is torch.ops.socompile.grads_copied.default]
    assert sorted(kept) == [b.index for b in ctx.plan.buckets]
    for b in opt.buckets:
        b.wait_grads()
    device.check()
