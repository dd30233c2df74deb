"""A bucket's buffers come from one derivation (plan/bucket_buffers.py ``bucket_buffers``): the runtime makes each
buffer from its entry (dtype, elements, pinned or pageable, host or device), and the planner's host memory is the
sum of the same entries. Checked for bucket shapes the runtime has (shared or separate master, CPU or device
step, stationary or flow, fp32 / bf16 / fp16 / fp64 weights, bf16 moments, host or device cast, ZeRO windows and
device chunks, accumulation), on the CPU runtime and the emulated CUDA device (pins through its seam); and a rule
over the sources that nothing else allocates or books a bucket's buffers."""
import pathlib
import re

import pytest
import torch

from socompile.plan.bucket_buffers import BucketStorage, bucket_buffers, host_entries
from socompile.plan.memory import HostLayout, bucket_host_buffers
from socompile.plan.plan import BucketPlan
from socompile.runtime import device as dev
from socompile.runtime.flat_bucket import FlatBucket
from socompile.runtime.host_master import UploadStaging
from socompile.runtime.memory import HostLedger

# Parameter shapes that are not multiples of the alignment (padding between segments) and of different ranks.
SHAPES = [(37, 5), (20,), (3, 4, 7)]

CASES = {
    # name: (weight dtype, FlatBucket keywords, runtime ("cpu" | "emulated"), ZeRO (rank, world) or None)
    "shared fp32": (torch.float32, {}, "cpu", None),
    "shared fp64": (torch.float64, {}, "cpu", None),
    "shared fp32, bf16 moments": (torch.float32, {"moment_dtype": torch.bfloat16}, "cpu", None),
    "shared fp32, ZeRO rank 0 of 2": (torch.float32, {}, "cpu", (0, 2)),
    "shared fp32, ZeRO rank 2 of 3": (torch.float32, {}, "cpu", (2, 3)),
    "shared fp32, device step": (torch.float32, {"site": "device"}, "cpu", None),
    "separate bf16, CPU runtime": (torch.bfloat16, {"host_master": "separate", "link_dtype": "bfloat16"}, "cpu", None),
    "separate bf16 flow, CPU runtime": (torch.bfloat16, {"host_master": "separate", "flow": True,
                                                         "link_dtype": "bfloat16"}, "cpu", None),
    "separate bf16, CPU runtime, ZeRO rank 1 of 2": (torch.bfloat16, {"host_master": "separate"}, "cpu", (1, 2)),
    "emulated fp32": (torch.float32, {"host_master": "separate", "link_dtype": "float32"}, "emulated", None),
    "emulated bf16 host cast": (torch.bfloat16, {"host_master": "separate", "link_dtype": "bfloat16"},
                                "emulated", None),
    "emulated bf16 device cast": (torch.bfloat16, {"host_master": "separate", "link_dtype": "bfloat16",
                                                   "cast_site": "device"}, "emulated", None),
    "emulated bf16 flow": (torch.bfloat16, {"host_master": "separate", "flow": True, "link_dtype": "bfloat16"},
                           "emulated", None),
    "emulated fp16 flow": (torch.float16, {"host_master": "separate", "flow": True, "link_dtype": "float32"},
                           "emulated", None),
    "emulated bf16, bf16 moments": (torch.bfloat16, {"host_master": "separate", "link_dtype": "bfloat16",
                                                     "moment_dtype": torch.bfloat16}, "emulated", None),
    "emulated bf16 device step": (torch.bfloat16, {"host_master": "separate", "site": "device"}, "emulated", None),
    "emulated bf16, device ZeRO rank 1 of 2": (torch.bfloat16, {"host_master": "separate",
                                                                "link_dtype": "bfloat16"}, "emulated", (1, 2)),
    "emulated fp32, device ZeRO rank 0 of 2": (torch.float32, {"host_master": "separate",
                                                               "link_dtype": "float32"}, "emulated", (0, 2)),
}


def made_bucket(name):
    """The bucket of case ``name`` with every buffer it can make made: adopted, sharded, its spare taken (a
    CPU-stepped one), one
    upload (the low-precision stage), and on a CUDA runtime two micro-batches of gradients (the accumulation
    stage)."""
    dtype, kwargs, runtime, shard = CASES[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in SHAPES]
    rt = dev.device_runtime("cpu", "emulated") if runtime == "emulated" else (
        dev.CPURuntime() if kwargs.get("host_master") == "separate" else None)
    ledger = HostLedger()
    bucket = FlatBucket(0, params, shard=shard, runtime=rt, host_ledger=ledger, **kwargs)
    bucket.group_of = [0] * len(params)
    if bucket.storage.device_cast:   # the compiled graph hands its device casts their staging
        bucket.use_upload_staging(UploadStaging(rt, bucket.numel))
    bucket.adopt({})
    if shard is not None:
        bucket.shard(*shard)
    if bucket.site == "cpu":   # a device-stepped bucket is stepped after validation only: it has no spare
        bucket.spare_buffers()
    if bucket.device_shard is None and bucket.site == "cpu":
        grads = [torch.ones_like(p) for p in params]
        bucket.receive_many(list(range(len(params))), grads, accumulate=False)
        bucket.receive_many(list(range(len(params))), grads, accumulate=True)
        bucket.wait_grads()
        bucket.upload()
    return bucket, ledger, rt


@pytest.mark.parametrize("name", list(CASES))
def test_each_buffer_is_made_as_its_entry_says(name):
    bucket, ledger, rt = made_bucket(name)
    specs = {s.name: s for s in bucket_buffers(bucket.storage, bucket.numel, *bucket.rank_world)}
    held = bucket.held_buffers()
    made_on_use = {"spare master", "spare exp_avg", "spare exp_avg_sq", "low-precision stage", "accumulation stage"}
    if bucket.site == "device":
        assert not {"spare master", "spare exp_avg", "spare exp_avg_sq"} & set(specs)
    # every buffer the layout lists that is not made on first use exists, and nothing exists that it does not list
    assert set(specs) - made_on_use <= set(held) <= set(specs)
    for key, tensor in held.items():
        spec = specs[key]
        assert (tensor.dtype, tensor.numel()) == (getattr(torch, spec.dtype), spec.elements), key
        if spec.where == "host" and rt is not None and hasattr(rt, "api"):   # the emulated seam knows its pins
            assert (not rt.api.is_device(tensor)) == spec.pinned, key
    # the host ledger booked exactly the host entries of the buffers the bucket holds
    booked = {}
    for purpose, nbytes, pinned in host_entries(specs[k] for k in held):
        key = (purpose, "pinned" if pinned else "pageable")
        booked[key] = booked.get(key, 0) + nbytes
    if bucket.site == "device":
        booked = {}   # a device-stepped bucket's state is device memory (the CPU build's device is the host)
    assert {k: v for k, v in ledger.summary()["by_category"].items() if v} == booked


PLANNED = {   # the cases a plan describes: (case, HostLayout of the runtime, the plan's BucketPlan fields)
    "shared fp32, ZeRO rank 0 of 2": (HostLayout(pins=False, shared_master=True), {}),
    "separate bf16, CPU runtime": (HostLayout(pins=False), {"link_dtype": "bfloat16", "cast_site": "cpu"}),
    "separate bf16 flow, CPU runtime": (HostLayout(pins=False), {"link_dtype": "bfloat16", "cast_site": "cpu",
                                                                 "weight_mode": "flow"}),
    "emulated bf16 host cast": (HostLayout(pins=True, accumulation=True), {"link_dtype": "bfloat16", "cast_site": "cpu"}),
    "emulated bf16 device cast": (HostLayout(pins=True, accumulation=True), {"link_dtype": "bfloat16", "cast_site": "device"}),
    "emulated bf16, device ZeRO rank 1 of 2": (HostLayout(pins=True), {"link_dtype": "bfloat16"}),
}


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_plan_counts_the_buffers_the_runtime_holds(name):
    # The host path of ZeRO keeps the master and the gradients whole (the parameters alias the master): a plan
    # that counted them as 1/world of the bucket was short by half of them at world 2.
    bucket, ledger, _ = made_bucket(name)
    layout, fields = PLANNED[name]
    dtype, _, _, shard = CASES[name]
    plan = BucketPlan(index=0, params=(), numel=bucket.numel, grad_bytes=4 * bucket.numel, optimizer_site="cpu",
                      ready_after="", ready_position=0, **fields)
    rank, world = shard or (0, 1)
    planned = {}
    for purpose, nbytes, pinned in bucket_host_buffers(plan, bucket.numel, dtype.itemsize, world, layout,
                                                       str(dtype).removeprefix("torch.")):
        key = (purpose, "pinned" if pinned else "pageable")
        planned[key] = planned.get(key, 0) + nbytes
    if rank == 0:   # the plan counts rank 0, the largest shard
        assert {k: v for k, v in ledger.summary()["by_category"].items() if v} == planned
    else:           # the last rank's window may be short; its buffers are the same list at its own window
        storage = bucket.storage
        assert [s.name for s in bucket_buffers(storage, bucket.numel, rank, world)] == \
            [s.name for s in bucket_buffers(storage, bucket.numel, 0, world)]


def test_a_device_stepped_bucket_has_no_spare_to_make():
    bucket, _, _ = made_bucket("emulated bf16 device step")
    with pytest.raises(RuntimeError, match="no 'spare master' buffer"):
        bucket.spare_buffers()


def test_the_last_rank_of_an_uneven_zero_window_holds_a_short_window():
    storage = BucketStorage()
    numel = 100   # 3 ranks: windows of 34, 34, 32
    windows = [{s.name: s.elements for s in bucket_buffers(storage, numel, r, 3)}["exp_avg"] for r in range(3)]
    assert windows == [34, 34, 32]
    assert {s.name: s.elements for s in bucket_buffers(storage, numel, 2, 3)}["master"] == numel   # whole


SOURCES = pathlib.Path(__file__).resolve().parents[1] / "socompile"


def test_nothing_but_make_buffer_allocates_or_books_a_bucket_buffer():
    # One derivation: a bucket's host buffers are booked at one site (FlatBucket.make_buffer, from its
    # bucket_buffers entry); pinned host memory is asked of the runtime there and for offloaded activations only.
    books, pins = [], []
    for path in SOURCES.rglob("*.py"):
        text = path.read_text()
        rel = str(path.relative_to(SOURCES))
        books += [rel for _ in re.finditer(r"\.book_host\(", text)]
        pins += [rel for _ in re.finditer(r"\.host_buffer\(", text)]
    assert books == ["runtime/flat_bucket.py"]
    assert sorted(pins) == ["runtime/activation_offload.py", "runtime/flat_bucket.py"]
