"""Launching: the rank's device and the groups' backends (init_distributed), a 2-node torchrun job on this
machine, and the torchrun commands of README.md and docs/distributed.md as written.

The 2-node job: two torchrun agents (the "nodes", 2 ranks each) meet through the c10d rendezvous on
127.0.0.1; the 4 ranks form a dp 2 x sp 2 mesh (its groups and plain data parallelism checked as in
tests/test_dist_mesh.py), train the tiny model compiled with superoffload (Ulysses over each node's 2 ranks,
ZeRO over all 4, clipping on) and must end with bitwise identical weights equal to one process's
(torch.optim.AdamW + clip_grad_norm_ on the global batch).

Tolerance (fp32, lr 1e-3, STEPS steps; u = 2^-24): the 4 ranks compute each gradient element as a sum over
other token subsets (2 rows x 2 sequence halves, reduce-scattered in gloo's order) than one process's single
backward over the global batch, so each element is rounded differently: for K <= 128 terms of size ~1e-3 the
typical (random-walk) error is sqrt(K) * u * 1e-3 ~ 1e-9. Adam turns a gradient error dg into an update error
of at most lr * dg / eps where the gradient is near zero; with eps = EPS = 1e-6 that is 1e-6 per step, so
STEPS * 1e-6 = 3e-6, and TOL = 1e-5 leaves 3x. The clipping scale (a norm over the global batch) agrees to
NORM_RTOL = 1e-5: float64 sum of shard partials vs torch's fp32 norm of per-parameter norms (~log2(n) u ~ 1e-6).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from socompile.distributed import mesh
from socompile.distributed.launch import free_port, run_commands

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[1]
STEPS = 3
EPS = 1e-6          # Adam's eps: bounds how much it amplifies rounding differences (module docstring)
TOL = 1e-5          # weights after STEPS steps (module docstring)
NORM_RTOL = 1e-5    # global gradient norm against clip_grad_norm_ (module docstring)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# ------------------------------------------------------------------------- device and backend (no processes)
class _FakeCuda:
    """Stands in for torch.cuda's device calls: ``count`` devices, ``current`` the current one."""

    def __init__(self, count: int, current: int = 0):
        self.count, self.current, self.set_calls = count, current, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, index) -> None:
        self.set_calls.append(index)
        self.current = index


class _Joined(Exception):
    """Raised by the stand-in init_process_group once it has recorded its arguments."""


def _init_recording(monkeypatch, fake: _FakeCuda, local_rank: int, **kwargs) -> dict:
    """Run init_distributed as torchrun's rank with ``local_rank`` and record what it asks of torch."""
    fake.install(monkeypatch)
    for key, value in {"RANK": local_rank, "WORLD_SIZE": 8, "LOCAL_RANK": local_rank,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(key, str(value))
    seen = {}

    def init_process_group(backend, **kw):
        seen.update(backend=backend, device_when_joining=fake.current)
        raise _Joined

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_Joined):
        mesh.init_distributed(timeout_s=5, **kwargs)
    return seen


def test_each_rank_takes_the_cuda_device_of_its_local_rank_and_a_gloo_backend_for_host_tensors(monkeypatch):
    fake = _FakeCuda(count=4)
    seen = _init_recording(monkeypatch, fake, local_rank=2)
    assert fake.set_calls == [2] and seen["device_when_joining"] == 2   # before NCCL binds a device
    # NCCL for device tensors, gloo for the host tensors socompile also reduces (norms, checkpoint metadata)
    assert seen["backend"] == "cpu:gloo,cuda:nccl"


def test_a_device_chosen_by_the_caller_is_kept(monkeypatch):
    fake = _FakeCuda(count=4, current=3)             # torch.cuda.set_device(3) before init_distributed
    assert _init_recording(monkeypatch, fake, local_rank=1)["device_when_joining"] == 3
    assert fake.set_calls == []
    fake = _FakeCuda(count=4)                        # or an explicit argument
    assert _init_recording(monkeypatch, fake, local_rank=1, device="cuda:0")["device_when_joining"] == 0
    assert fake.set_calls == [0]


def test_cpu_only_ranks_use_gloo_and_set_no_device(monkeypatch):
    fake = _FakeCuda(count=0)
    assert _init_recording(monkeypatch, fake, local_rank=1)["backend"] == "gloo"
    assert fake.set_calls == []


def test_more_local_ranks_than_devices_is_a_clear_error_before_joining(monkeypatch):
    fake = _FakeCuda(count=2)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 asks for cuda:2, but this process sees 2 CUDA "
                                           r"device\(s\).*torchrun --nproc-per-node 2"):
        _init_recording(monkeypatch, fake, local_rank=2)
    assert fake.set_calls == []


def test_a_local_rank_that_is_not_an_integer_is_a_clear_error(monkeypatch):
    fake = _FakeCuda(count=2)
    fake.install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        mesh.select_device()
    assert fake.set_calls == []


def test_a_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    with pytest.raises(RuntimeError, match="device='cuda:1', but CUDA is not available"):
        _init_recording(monkeypatch, _FakeCuda(count=0), local_rank=0, device="cuda:1")


# ------------------------------------------------------------------------------------- 2 nodes x 2 ranks
def _zero_train(args: dict) -> dict:
    """One rank of the 2-node job (run by torchrun through ``python -m socompile.distributed.launch``)."""
    import socompile
    import socompile.distributed as sd
    from socompile.models import build

    from test_dist_mesh import train_like_one_process

    topo = sd.init_distributed(sp=2, timeout_s=60)
    mesh_check = train_like_one_process(topo)    # the mesh's groups, and plain data parallelism (torch AdamW)
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    ref = copy.deepcopy(model) if topo.rank == 0 else None
    sd.parallelize(model, topo.sp_group)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=EPS)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=0.5, bucket_size="40KB", **hyper)
    sd.shard_optimizer(opt, topo.world_group)
    run = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0, bucket_size="40KB"))
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper) if ref is not None else None
    gen = torch.Generator().manual_seed(1)
    norms, ref_norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (topo.dp, 33), generator=gen)     # one row per dp rank
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(topo.dp_rank, topo.dp_rank + 1)
        xs, ys = (sd.shard_sequence(t[mine], topo.sp_group) for t in (x, y))
        F.cross_entropy(run(xs).flatten(0, 1), ys.flatten()).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
        if ref is not None:   # one process, the global batch, one backward
            F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
            ref_opt.step()
            ref_opt.zero_grad()
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    out = {key: int(os.environ[key]) for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")}
    out.update(sha=hashlib.sha256(weights).hexdigest(), norms=norms, ref_norms=ref_norms,
               err=max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
               if ref is not None else None,
               backend=dist.get_backend(), device=str(topo.device), steps=opt.stats["steps"],
               graphs=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
               mesh=mesh_check)
    sd.shutdown()
    return out


def _node_command(node: int, port: int, out: pathlib.Path) -> list[str]:
    # is_host: node 0's agent serves the rendezvous store (as on the first of two machines); join_timeout
    # bounds the wait for the other node.
    return [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"socompile-test-{port}",
            "--rdzv-conf", f"join_timeout=60,is_host={int(node == 0)}", "--max-restarts", "0",
            "-m", "socompile.distributed.launch", f"{HERE}:_zero_train", "{}", str(out / "rank{rank}.json")]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def two_nodes() -> list[dict]:
    """The 2-node job, run once for the tests below: each rank's result, in rank order."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="socompile-2nodes-"))
    try:
        port = free_port()
        nodes = run_commands([_node_command(n, port, out) for n in (0, 1)], timeout_s=300, env=_env(), cwd=ROOT)
        for node in nodes:
            assert node.returncode == 0, f"{node.argv}\n{node.output[-4000:]}"
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_two_nodes_of_two_ranks_train_compiled_dp2_sp2_like_one_process(two_nodes):
    ranks = two_nodes
    # two nodes of two ranks each, joined by the rendezvous into one world of 4
    assert sorted((r["GROUP_RANK"], r["LOCAL_RANK"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["WORLD_SIZE"] == 4 and r["backend"] == "gloo" and r["device"] == "cpu" for r in ranks)
    assert all(r["steps"] == STEPS and r["graphs"] >= 1 for r in ranks), "every rank trains through a compile"
    assert len({r["sha"] for r in ranks}) == 1, "every rank must hold bitwise the same weights"
    assert all(r["norms"] == ranks[0]["norms"] for r in ranks), "every rank must clip by the same global norm"
    for ours, theirs in zip(ranks[0]["norms"], ranks[0]["ref_norms"]):
        assert math.isfinite(ours) and abs(ours - theirs) <= NORM_RTOL * theirs, (ours, theirs)
    assert ranks[0]["err"] < TOL, ranks[0]["err"]


def test_dp2_sp2_on_four_ranks_trains_like_one_process(two_nodes):
    # (was tests/test_dist_mesh.py's 4-rank case) Ranks (0, 1) and (2, 3) share sequences; (0, 2) and (1, 3)
    # share shards.
    from test_dist_mesh import check_mesh

    results = [r["mesh"] for r in two_nodes]
    check_mesh(results, dp=2, sp=2)
    assert [r["sp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["coords"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]


# --------------------------------------------------------------------------- the documented torchrun commands
def documented_torchrun_commands(multi_node: bool = False) -> list[str]:
    """Every torchrun command in the code blocks of README.md and docs/distributed.md (lines joined at a trailing
    backslash), an optional ``[--flag]`` expanded both ways: the single-node ones, or (``multi_node``) those
    with --nnodes."""
    found = []
    for doc in ("README.md", "docs/distributed.md"):
        blocks = (ROOT / doc).read_text().replace("\\\n", " ").split("```")[1::2]   # inside code fences
        for line in "\n".join(blocks).splitlines():
            line = " ".join(line.split("#")[0].split())
            if not line.startswith("torchrun ") or ("--nnodes" in line) != multi_node:
                continue
            optional = re.search(r"\s*\[([^\]]+)\]", line)
            variants = [line] if not optional else [line.replace(optional.group(0), ""),
                                                      line.replace(optional.group(0), " " + optional.group(1))]
            found += [v for v in variants if v not in found]
    return found


def test_the_docs_name_the_three_quick_start_runs():
    assert [c.split("examples/dist_train.py")[1].strip() for c in documented_torchrun_commands()] == \
        ["--dp 2", "--sp 2", "--sp 2 --compile"]


def test_the_documented_multi_node_command_has_the_shape_the_two_node_test_runs():
    (command,) = documented_torchrun_commands(multi_node=True)
    documented = command.split()
    ours = _node_command(0, 29400, ROOT)
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend"):
        assert documented[documented.index(flag) + 1] == ours[ours.index(flag) + 1], flag
    assert documented[documented.index("--rdzv-endpoint") + 1] == "HOST:29400"
    assert documented[documented.index("examples/dist_train.py") + 1:] == ["--dp", "2", "--sp", "2"]


@pytest.mark.parametrize("command", documented_torchrun_commands())   # every one, --compile too
def test_documented_torchrun_command_runs_and_prints_the_documented_first_loss(command):
    # As written, but on a free port and for 1 step: docs/distributed.md says every variant prints loss 5.5831
    # at step 1 (the same global batch, the same initial weights).
    argv = command.split()
    argv[argv.index("--master-port") + 1] = str(free_port())
    argv = [*TORCHRUN, *argv[1:], "--steps", "1"]
    (result,) = run_commands([argv], timeout_s=300, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.output[-4000:]
    assert re.search(r"step +1 +loss 5\.5831 ", result.output), result.output[-2000:]
