"""Where host threads wait (opt.host_blocks(), runtime/traffic.py HostBlockLedger): every wait on a device event,
on the CPU worker or on a device value is booked per step with its thread and site, and the counts show what the
runtime serialises: without validation the training thread waits for each CPU bucket once, at that bucket's first
read in the next forward, and never in step(); with validation step() settles every CPU bucket; a device-stepped
bucket's norm is read from the device once per step when a step is validated, and never otherwise."""
import types

import pytest
import torch

import socompile
from socompile.models import build
from socompile.runtime.device_adam import DeviceStats, _device_blocks
from socompile.runtime.traffic import DEVICE_READ, EVENT_WAIT, WORKER_WAIT, HostBlockLedger
from training_helpers import batches, lm_loss, use_emulated_device


def trained(monkeypatch, max_grad_norm, steps=3):
    use_emulated_device(monkeypatch)
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(torch.bfloat16)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, bucket_size="256KB", max_grad_norm=max_grad_norm)
    backend = socompile.SuperOffload(compute="eager", bucket_size="256KB", runtime="emulated", gpu_buckets=0,
                                     weight_mode="stationary", cast_site="cpu")
    cmodel = torch.compile(model, backend=backend)
    for x, y in batches(steps):
        lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def training_waits(opt, kind):
    return {site: n for (thread, k, site), n in opt.host_blocks().items() if thread == "training" and k == kind}


def test_without_validation_the_training_thread_waits_for_each_cpu_bucket_once_at_its_first_read(monkeypatch):
    opt = trained(monkeypatch, max_grad_norm=None)
    cpu_buckets = sum(b.site == "cpu" for b in opt.buckets)
    assert cpu_buckets > 1
    waits = training_waits(opt, WORKER_WAIT)
    # step() and zero_grad() waited for no CPU job; the next forward waited once per bucket, before its first read
    assert set(waits) == {"forward: the bucket's first read"}
    assert waits["forward: the bucket's first read"]["calls"] == cpu_buckets
    assert DEVICE_READ not in {k for (_, k, _) in opt.host_blocks()}


def test_with_validation_step_settles_every_cpu_bucket(monkeypatch):
    opt = trained(monkeypatch, max_grad_norm=1.0)
    cpu_buckets = sum(b.site == "cpu" for b in opt.buckets)
    waits = training_waits(opt, WORKER_WAIT)
    assert waits["step: the buckets it settles"]["calls"] == cpu_buckets
    # every wait booked is one the runtime made: the gradient copies the CPU jobs read, on the worker's thread
    worker_events = {site for (thread, k, site) in opt.host_blocks() if thread == "worker" and k == EVENT_WAIT}
    assert "gradient copy to the host" in worker_events


class _Event:
    def __init__(self, done):
        self.done, self.waited = done, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1


def test_a_wait_on_finished_work_is_a_call_and_on_unfinished_work_a_block():
    ledger = HostBlockLedger()
    ledger.event(_Event(done=True), "site a")
    ledger.event(_Event(done=False), "site a")
    ledger.event(_Event(done=False), "site b")
    ledger.end_step()
    assert ledger.by_site() == {("training", EVENT_WAIT, "site a"): {"calls": 2, "blocked": 1},
                                ("training", EVENT_WAIT, "site b"): {"calls": 1, "blocked": 1}}


@pytest.mark.parametrize("reads", [0, 1, 3])
def test_a_device_bucket_norm_is_read_from_the_device_once_and_only_when_asked(reads):
    # The step queues its norm on the device; validation reads it (one device->host wait), a step nobody validates
    # never does. DeviceStats books the read in the bucket's ledger when its state is device memory.
    ledger = HostBlockLedger()
    bucket = types.SimpleNamespace(site="device", separate_device=True, host_blocks=ledger)
    stats = DeviceStats([torch.ones(4), torch.full((3,), 2.0)], 1.0, _device_blocks(bucket))
    for _ in range(reads):
        assert tuple(stats) == (4 + 12.0, False)
    ledger.end_step()
    expected = {("training", DEVICE_READ, "device-stepped bucket's gradient norm"): {"calls": 1, "blocked": 1}}
    assert ledger.by_site() == (expected if reads else {})
    host = types.SimpleNamespace(site="cpu", separate_device=False, host_blocks=ledger)
    assert _device_blocks(host) is None   # host memory: nothing to wait for


PLAN_SHAPES = {   # name: (runtime, dtype, max_grad_norm, backend options)
    "emulated fp32 stationary": ("emulated", torch.float32, None, dict(weight_mode="stationary", gpu_buckets=0)),
    "emulated bf16 flow": ("emulated", torch.bfloat16, None, dict(weight_mode="flow", prefetch_distance=1,
                                                                  gpu_buckets=0)),
    "emulated fp32 gpu buckets, clip": ("emulated", torch.float32, 1.0, dict(weight_mode="stationary",
                                                                            gpu_buckets=2)),
    "emulated bf16 flow, clip": ("emulated", torch.bfloat16, 1.0, dict(weight_mode="flow", gpu_buckets=0)),
    "cpu fp32 flow": ("cpu", torch.float32, None, dict(weight_mode="flow", gpu_buckets=0)),
}


@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_the_training_threads_waits_for_cpu_jobs_are_the_plans(monkeypatch, shape):
    """The plan's ``cpu_job_waits_per_step`` (plan/host_waits.py: the rule opt.step() applies, counted per
    CPU-stepped bucket) equals the "CPU worker job" waits opt.host_blocks() books on the training thread, site by
    site: without validation at each bucket's first read (stationary: wait_upload; flowing: its fetch), with
    validation in step(), none on the CPU build (it steps inline)."""
    runtime, dtype, clip, options = PLAN_SHAPES[shape]
    if runtime == "emulated":
        use_emulated_device(monkeypatch)
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(dtype)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, max_grad_norm=clip)
    backend = socompile.SuperOffload(compute="eager", bucket_size="256KB", runtime=runtime, **options)
    cmodel = torch.compile(model, backend=backend)
    for x, y in batches(3):
        lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    predicted = dict(backend.compiled[0].plan.prediction("cpu_job_waits_per_step"))
    booked = {site: n["calls"] for site, n in training_waits(opt, WORKER_WAIT).items()}
    assert booked == predicted
    cpu = sum(b.site == "cpu" for b in opt.buckets)
    assert sum(predicted.values()) == (cpu if runtime == "emulated" else 0)
