"""The (dp, sp) mesh: group membership for DP=1 x SP=2 and DP=2 x SP=1 on 2 gloo ranks, and plain data
parallelism over the dp group equal to one process on the global batch. One 2-rank job (one process group)
builds both meshes and the wrong one; each test checks its part. DP=2 x SP=2 runs on 4 ranks as two torchrun
"nodes" in tests/test_dist_launch.py (the same checks, ``train_like_one_process``).

Tolerance: the sharded runs sum each gradient element in another order (a batch or sequence split over the
ranks): the typical (random-walk) error of a sum of K <= 64 fp32 terms of size ~1e-3 is sqrt(K) * 2^-24 * 1e-3
~ 1e-9. Adam divides by sqrt(v) + eps, so where a gradient is near zero an absolute error dg moves the update
by up to lr * dg / eps: with eps 1e-6 (EPS; torch's default 1e-8 would amplify it 100x more), <= 1e-6 per
step, 3e-6 after 3 steps at lr 1e-3. We assert atol 1e-5 (3x that; 1% of one step's largest move). Measured:
3.7e-7 (2.9e-6 with eps 1e-8)."""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

from socompile.distributed.launch import run_local
from dist_helpers import assert_ranks_ok

HERE = str(pathlib.Path(__file__).resolve())
EPS = 1e-6   # Adam's eps: bounds how much it amplifies rounding differences (see the tolerance above)


def _mesh_worker(args: dict) -> dict:
    import socompile.distributed as sd

    first, *others = args["meshes"]
    results = {f"{first[0]}x{first[1]}": train_like_one_process(sd.init_distributed(*first, timeout_s=30))}
    for dp, sp in others:
        results[f"{dp}x{sp}"] = train_like_one_process(sd.make_topology(dp, sp, timeout_s=30))
    try:   # every rank raises before any group is made: nothing collective is left half done
        sd.make_topology(*args["wrong"], timeout_s=30)
        results["wrong"] = None
    except ValueError as exc:
        results["wrong"] = str(exc)
    sd.shutdown()
    return results


def train_like_one_process(topo) -> dict:
    """The mesh's groups, and 3 steps of plain data parallelism (torch.optim.AdamW, gradients averaged over the
    world group) against one process on the global batch: the largest weight difference."""
    import torch.distributed as dist

    import socompile.distributed as sd
    from socompile.models import build

    out = {"dp_ranks": dist.get_process_group_ranks(topo.dp_group),
           "sp_ranks": dist.get_process_group_ranks(topo.sp_group),
           "world_ranks": dist.get_process_group_ranks(topo.world_group),
           "coords": [topo.dp_rank, topo.sp_rank], "mesh_dims": list(topo.mesh.mesh_dim_names),
           "mesh_shape": list(topo.mesh.shape)}
    # Train 3 steps: each dp rank takes its half of the global batch; each sp rank its half of the sequence.
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    ref = copy.deepcopy(model)
    sd.parallelize(model, topo.sp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=EPS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 17), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(topo.dp_rank * 4 // topo.dp, (topo.dp_rank + 1) * 4 // topo.dp)
        xs, ys = (sd.shard_sequence(t[mine], topo.sp_group) for t in (x, y))
        F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
        sd.average_gradients(model.parameters(), topo.world_group)
        opt.step(), opt.zero_grad()
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        ref_opt.step(), ref_opt.zero_grad()
    out["param_err"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out


def check_mesh(results: list[dict], dp: int, sp: int) -> None:
    for r in results:
        assert r["param_err"] < 1e-5, r
        assert r["world_ranks"] == list(range(dp * sp))
        assert r["mesh_dims"] == ["dp", "sp"] and r["mesh_shape"] == [dp, sp]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    results = run_local(f"{HERE}:_mesh_worker", 2, {"meshes": [[1, 2], [2, 1]], "wrong": [2, 2]}, timeout_s=120)
    assert_ranks_ok(results)
    return [r.result for r in results]


def _mesh(two_ranks, dp, sp) -> list[dict]:
    results = [r[f"{dp}x{sp}"] for r in two_ranks]
    check_mesh(results, dp, sp)
    return results


def test_dp1_sp2_puts_both_ranks_in_the_sequence_group(two_ranks):
    r0, r1 = _mesh(two_ranks, dp=1, sp=2)
    assert r0["sp_ranks"] == r1["sp_ranks"] == [0, 1]
    assert (r0["dp_ranks"], r1["dp_ranks"]) == ([0], [1])
    assert (r0["coords"], r1["coords"]) == ([0, 0], [0, 1])


def test_dp2_sp1_puts_both_ranks_in_the_data_group(two_ranks):
    r0, r1 = _mesh(two_ranks, dp=2, sp=1)
    assert r0["dp_ranks"] == r1["dp_ranks"] == [0, 1]
    assert (r0["sp_ranks"], r1["sp_ranks"]) == ([0], [1])
    assert (r0["coords"], r1["coords"]) == ([0, 0], [1, 0])


def test_degrees_that_do_not_match_the_world_are_an_error(two_ranks):
    for r in two_ranks:   # on every rank
        assert r["wrong"] and "dp * sp = 2 * 2 = 4, but 2 processes were launched" in r["wrong"], r["wrong"]
