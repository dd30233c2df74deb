"""The host CPU's work per step under ZeRO (gloo ranks), booked by each rank's runtime (``opt.host_work()``),
equals the plan's for that rank (plan/host_work.py ``per_step_host_work`` with ``rank`` and ``world``), purpose by
purpose, byte for byte. The host path (the CPU build): the kernel over the rank's window only, the whole gradients
landing in fp32, the copies around the reduce-scatter and the all-gather, the commit's exchange of the master's
window with the spare's, and the whole bucket cast to bf16 after the all-gather. Device-side ZeRO (the emulated
CUDA device): the kernel over the window with the gradients as the device reduced them, the commit's exchange,
the master chunk cast into its bf16 stage; no collective copies on the host.

Each case is one run of W ranks (~10 s here); the last of three steps is compared (the first makes one-off
stages). dp 3 pads buckets to 3 equal chunks (the reduce's staging copy); every rank is compared, so unequal
windows (the last rank's is short) are too.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

from socompile.distributed.launch import run_local
from socompile.plan.host_work import GATHER_COPIES, HOST_CAST, REDUCE_COPIES, SPARE_COPY
from dist_helpers import assert_ranks_ok

HERE = str(pathlib.Path(__file__).resolve())

CASES = {   # name: (ranks, dtype, backend options, optimizer arguments, micro-batches, plan's speculation mode)
    "dp2 fp32 shared, clip committed": (2, "float32", {}, {"max_grad_norm": 1e6}, 1, "on"),
    # device-side ZeRO: padded buckets whose last window is shorter than the chunk its spare covers
    "emulated dp3 fp32, clip committed": (3, "float32", {"runtime": "emulated"}, {"max_grad_norm": 1e6}, 1, "on"),
    "emulated dp3 bf16, flow": (3, "bfloat16", {"runtime": "emulated", "weight_mode": "flow", "prefetch_distance": 1},
                                {}, 1, "on"),
    "emulated dp2 bf16, accumulation": (2, "bfloat16", {"runtime": "emulated"}, {"grad_accumulation_steps": 2}, 2,
                                        "on"),
    "emulated dp2 fp32, no speculation, clip": (2, "float32", {"runtime": "emulated", "speculate": False},
                                                {"max_grad_norm": 1e6}, 1, "off"),
    "dp3 bf16 separate, flow": (3, "bfloat16", {"weight_mode": "flow", "prefetch_distance": 1}, {}, 1, "on"),
    "dp2 fp32, clip redone": (2, "float32", {"bucket_size": "64MB"}, {"max_grad_norm": 1e-4, "predict_clipping": False},
                              1, "redo"),
    "dp2 fp32 shared": (2, "float32", {}, {}, 1, "on"),
    "dp2 bf16 separate": (2, "bfloat16", {}, {}, 1, "on"),
    "dp2 fp32 separate": (2, "float32", {}, {"host_master": "separate"}, 1, "on"),
    "dp2 fp32, accumulation": (2, "float32", {}, {"grad_accumulation_steps": 2}, 2, "on"),
    "dp2 fp32, no speculation, clip": (2, "float32", {"speculate": False}, {"max_grad_norm": 1e6}, 1, "off"),
    "dp3 fp32 shared": (3, "float32", {}, {}, 1, "on"),
    # windows of whole 16-element blocks: chunks rounded up, so the padding and the windows differ from fp32's
    "dp3 fp32 shared, int8 moments": (3, "float32", {}, {"moment_dtype": "int8"}, 1, "on"),
}
# The default suite runs the host path (dp 3, bf16, flow) and device-side ZeRO (dp 3, clip committed); int8 moments'
# windows of whole blocks (-m slow: tests/test_int8_moments.py checks them byte for byte at dp 2 in the default
# suite) and the rest,
# a redo included (tests/test_host_work.py has it in one process), run with -m slow.
DEFAULT = ("dp3 bf16 separate, flow", "emulated dp3 fp32, clip committed")


def _host_work_worker(args: dict) -> dict:
    import socompile
    import socompile.distributed as sd
    from socompile.models import build
    from socompile.plan.host_work import per_step_host_work
    from training_helpers import batches, lm_loss

    topo = sd.init_distributed(timeout_s=60)
    world, dtype, options, arguments, micro, speculation = CASES[args["case"]]
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    model = build("tiny", n_layers=2).to(dtype)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **arguments)
    sd.shard_optimizer(opt, topo.world_group)
    runtime = options.get("runtime", "cpu")
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "64KB", "runtime": runtime,
                                      "dp_degree": topo.world_size, **options})
    cmodel = torch.compile(model, backend=backend)
    data = batches(3 * micro)
    for step in range(3):
        for x, y in data[step * micro:(step + 1) * micro]:
            lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    ctx = backend.compiled[0]
    predicted = per_step_host_work(ctx.plan, ctx.ir, shared_master=opt.host_master == "shared",
                                   weight_bytes=torch.finfo(dtype).bits // 8, validating=opt.max_grad_norm is not None,
                                   speculation=speculation, micro_batches=micro, host_is_device=runtime == "cpu",
                                   rank=topo.rank, world=topo.world_size, moment_bytes=opt.buckets[0].moment_bytes)
    planned = {purpose: [r, w] for purpose, r, w in ctx.plan.prediction("host_work_bytes_per_step")}
    out = {"booked": {k: list(v) for k, v in opt.host_work().items()},
           "predicted": {k: list(v) for k, v in predicted.items()}, "planned": planned,
           "clipped": opt.last_step_clipped, "padded": any(b.numel % topo.world_size for b in opt.buckets),
           "device_sharded": all(b.device_shard is not None for b in opt.buckets)}
    sd.shutdown()
    return out


@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_each_ranks_host_cpu_work_under_zero_is_the_plans_for_that_rank(case):
    world, dtype, options, arguments, micro, speculation = CASES[case]
    on_device = options.get("runtime") == "emulated"
    results = assert_ranks_ok(run_local(f"{HERE}:_host_work_worker", world, {"case": case}, timeout_s=240,
                                        env={"SOCOMPILE_RUNTIME": "emulated"} if on_device else None))
    for rank, r in enumerate(results):
        assert r["device_sharded"] == on_device
        # the ZeRO terms are there (so a side that lost them fails), and each rank's books are its plan's
        assert (REDUCE_COPIES in r["predicted"] and GATHER_COPIES in r["predicted"]) != on_device, r["predicted"]
        assert (SPARE_COPY in r["predicted"]) == (speculation == "on"), r["predicted"]
        assert (HOST_CAST in r["predicted"]) == (dtype == "bfloat16"), r["predicted"]
        assert r["booked"] == r["predicted"], (rank, r["booked"], r["predicted"])
        if speculation == "redo":
            assert r["clipped"]   # the case is about a clipped step
    if world == 3:
        assert results[0]["padded"]   # some bucket is padded to 3 chunks: the reduce's staging copy
        assert results[0]["predicted"] != results[-1]["predicted"]   # the last rank's windows are shorter
    # the plan report's own line is rank 0's (the planner knows dp_degree); its step is one micro-batch and, with
    # clipping, the clipped one
    if micro == 1 and (arguments.get("max_grad_norm") is None or speculation != "on"):
        assert results[0]["planned"] == results[0]["booked"]
