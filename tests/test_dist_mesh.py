"""The (dp, sp) mesh: group membership for DP=1 x SP=2 and DP=2 x SP=1 on 2 gloo ranks, and plain data
parallelism over the dp group equal to one process on the global batch.

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

HERE = str(pathlib.Path(__file__).resolve())
EPS = 1e-6   # Adam's eps: bounds how much it amplifies rounding differences (see the tolerance above)


def _mesh_worker(args: dict) -> dict:
    import torch.distributed as dist

    import socompile.distributed as sd
    from socompile.models import build

    topo = sd.init_distributed(dp=args["dp"], sp=args["sp"], timeout_s=30)
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
    sd.shutdown()
    return out


def _run(dp, sp):
    results = run_local(f"{HERE}:_mesh_worker", dp * sp, {"dp": dp, "sp": sp}, timeout_s=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-3000:]}"
        assert r.result["param_err"] < 1e-5, r.result
        assert r.result["world_ranks"] == list(range(dp * sp))
        assert r.result["mesh_dims"] == ["dp", "sp"] and r.result["mesh_shape"] == [dp, sp]
    return [r.result for r in results]


def test_dp1_sp2_puts_both_ranks_in_the_sequence_group():
    r0, r1 = _run(dp=1, sp=2)
    assert r0["sp_ranks"] == r1["sp_ranks"] == [0, 1]
    assert (r0["dp_ranks"], r1["dp_ranks"]) == ([0], [1])
    assert (r0["coords"], r1["coords"]) == ([0, 0], [0, 1])


def test_dp2_sp1_puts_both_ranks_in_the_data_group():
    r0, r1 = _run(dp=2, sp=1)
    assert r0["dp_ranks"] == r1["dp_ranks"] == [0, 1]
    assert (r0["sp_ranks"], r1["sp_ranks"]) == ([0], [1])
    assert (r0["coords"], r1["coords"]) == ([0, 0], [1, 0])


def test_degrees_that_do_not_match_the_world_are_an_error():
    results = run_local(f"{HERE}:_mesh_worker", 2, {"dp": 2, "sp": 2}, timeout_s=60)
    assert all(r.returncode != 0 for r in results)
    assert "dp * sp = 2 * 2 = 4, but 2 processes were launched" in results[0].output


@pytest.mark.slow
def test_dp2_sp2_on_four_ranks_trains_like_one_process():
    # 4 processes on 2 cores: slow. Ranks (0, 1) and (2, 3) share sequences; (0, 2) and (1, 3) share shards.
    results = _run(dp=2, sp=2)
    assert [r["sp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["coords"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
