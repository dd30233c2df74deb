"""Sharded checkpoints (socompile.distributed.save / load, torch.distributed.checkpoint): saved by 2 ZeRO ranks
in the middle of a run, resumed by 3 ranks and by one process without torch.distributed, each continuing like
the run that never stopped; the gathered torch.optim.AdamW layout; atomic replacement of the directory.

Tolerances: a resume in the same layout is bitwise (the same kernel on the same values). A resume with another
world size sums the ranks' gradients in another order (~1e-9 absolute), which Adam amplifies where gradients
are tiny, by at most 1/eps: with eps 1e-6, <= lr * 1e-9 / eps = 1e-6 per step; weights atol 3e-5 after 3 more
steps at lr 1e-3 (the derivation of test_dist_zero.py, whose 9 steps need the same bound). The gathered moments are
compared with torch.optim.AdamW + clip_grad_norm_ on the global batch at atol 1e-6 (first moments) / 1e-9
(second moments, ~1e-6 in size), and the transfer into torch.optim.AdamW is checked bitwise.
"""
from __future__ import annotations

import copy
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from socompile.distributed.launch import run_local
from dist_helpers import assert_ranks_ok, save_midway

HERE = str(pathlib.Path(__file__).resolve())
ROWS, STEPS, SAVE_AT = 6, 6, 3     # 6 rows: divisible by 1, 2 and 3 ranks
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)   # eps: see the tolerances above


def _data():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (ROWS, 33), generator=gen) for _ in range(STEPS)]


def _build(seed: int):
    import socompile
    from socompile.models import build
    torch.manual_seed(seed)
    model = build("tiny", n_layers=1)
    return model, socompile.AdamW(model.parameters(), max_grad_norm=0.5, bucket_size="40KB", **HYPER)


def _train(model, opt, data, rank: int, world: int) -> list[float]:
    rows = ROWS // world
    norms = []
    for tokens in data:
        mine = tokens[rank * rows:(rank + 1) * rows]
        F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms


def _save_worker(args: dict) -> dict:
    import socompile.distributed as sd

    topo = sd.init_distributed(timeout_s=60)
    model, opt = _build(0)
    ref = copy.deepcopy(model)
    sd.shard_optimizer(opt, topo.world_group)
    data = _data()
    _train(model, opt, data[:SAVE_AT], topo.rank, topo.world_size)
    try:
        opt.state_dict()
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    sd.save(args["dir"], model, opt, step=SAVE_AT)
    full = sd.full_optimizer_state_dict(opt)
    if topo.rank == 0:
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
        for tokens in data[:SAVE_AT]:
            F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        torch.save({"full": full, "ref": ref_opt.state_dict()}, args["full"])
    norms = _train(model, opt, data[SAVE_AT:], topo.rank, topo.world_size)
    if topo.rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, args["final"])
    moments = sum(t.numel() for b in opt.buckets for t in (b.exp_avg, b.exp_avg_sq))
    whole = sum(2 * b.numel for b in opt.buckets)
    sd.shutdown()
    return {"refused": refused, "norms": norms, "moments": moments, "whole": whole}


def _resume_worker(args: dict) -> dict:
    import socompile.distributed as sd

    topo = sd.init_distributed(timeout_s=60)
    model, opt = _build(1)            # other initial values: everything must come from the checkpoint
    sd.shard_optimizer(opt, topo.world_group)
    extra = sd.load(args["dir"], model, opt)
    run = model
    if args.get("compile"):   # compiling lays the buckets out again: the loaded shards must move with them
        import socompile
        run = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0, bucket_size="20KB"))
    norms = _train(run, opt, _data()[SAVE_AT:], topo.rank, topo.world_size)
    if topo.rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, args["final"])
    sd.shutdown()
    return {"extra": extra, "norms": norms}


def _ok(results):
    assert_ranks_ok(results)
    return [r.result for r in results]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by 2 ZeRO ranks after 3 of 6 steps, and where that run ended."""
    root = tmp_path_factory.mktemp("dcp")
    args = {"dir": str(root / "ckpt"), "full": str(root / "full.pt"), "final": str(root / "final2.pt")}
    results = _ok(run_local(f"{HERE}:_save_worker", 2, args, timeout_s=150))
    return args, results


def test_sharded_optimizer_refuses_state_dict_and_each_rank_saves_its_shards(saved):
    args, results = saved
    for r in results:
        assert r["refused"] and "socompile.distributed.save" in r["refused"]
    assert results[0]["moments"] + results[1]["moments"] == results[0]["whole"]   # each holds its half
    assert max(r["moments"] for r in results) <= results[0]["whole"] / 2 + 2 * 16 * 2
    written = sorted(p.name for p in pathlib.Path(args["dir"]).iterdir())
    assert ".metadata" in written and sum(name.endswith(".distcp") for name in written) == 2, written
    assert not list(pathlib.Path(args["dir"]).parent.glob(".ckpt.*")), "temp directories must be gone"


def test_gathered_state_is_torch_adamw_layout_and_loads_into_torch(saved):
    args, _ = saved
    data = torch.load(args["full"], weights_only=True)
    full, ref = data["full"], data["ref"]
    assert full["state"].keys() == ref["state"].keys()
    assert [set(g) for g in full["param_groups"]] == [set(g) for g in ref["param_groups"]]
    for k, state in full["state"].items():
        assert state["step"].item() == SAVE_AT
        torch.testing.assert_close(state["exp_avg"], ref["state"][k]["exp_avg"], atol=1e-6, rtol=0)
        torch.testing.assert_close(state["exp_avg_sq"], ref["state"][k]["exp_avg_sq"], atol=1e-9, rtol=0)
    model, _ = _build(0)
    torch_opt = torch.optim.AdamW(model.parameters(), **HYPER)
    torch_opt.load_state_dict(full)
    for k, state in torch_opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], full["state"][k][key])


def _assert_close_to(final_path, expected_path, atol):
    got, want = torch.load(final_path, weights_only=True), torch.load(expected_path, weights_only=True)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


def test_saved_by_2_ranks_resumes_on_3_ranks(saved, tmp_path):
    args, results = saved
    final3 = str(tmp_path / "final3.pt")
    resumed = _ok(run_local(f"{HERE}:_resume_worker", 3, {"dir": args["dir"], "final": final3}, timeout_s=150))
    for r in resumed:
        assert r["extra"] == {"step": SAVE_AT}
        for ours, theirs in zip(r["norms"], results[0]["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
    _assert_close_to(final3, args["final"], atol=3e-5)


def test_resumed_then_compiled_moves_the_loaded_shards_to_the_new_bucket_layout(saved, tmp_path):
    args, results = saved
    final = str(tmp_path / "final2c.pt")
    resumed = _ok(run_local(f"{HERE}:_resume_worker", 2, {"dir": args["dir"], "final": final, "compile": True},
                            timeout_s=200))
    for ours, theirs in zip(resumed[0]["norms"], results[0]["norms"]):
        assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
    _assert_close_to(final, args["final"], atol=3e-5)


def test_saved_by_2_ranks_resumes_in_one_process_without_torch_distributed(saved, tmp_path):
    import socompile.distributed as sd

    args, results = saved
    model, opt = _build(1)
    assert sd.load(args["dir"], model, opt) == {"step": SAVE_AT}
    norms = _train(model, opt, _data()[SAVE_AT:], 0, 1)
    for ours, theirs in zip(norms, results[0]["norms"]):
        assert abs(ours - theirs) <= 1e-5 * theirs
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, tmp_path / "final1.pt")
    _assert_close_to(tmp_path / "final1.pt", args["final"], atol=3e-5)
    # Unsharded, the optimizer shows torch's layout again, with the loaded step counts.
    assert all(s["step"].item() == STEPS for s in opt.state_dict()["state"].values())


def test_one_process_round_trip_is_bitwise_and_an_interrupted_save_keeps_the_previous(tmp_path):
    import socompile.distributed as sd

    data = _data()
    model, opt = _build(0)
    _train(model, opt, data[:2], 0, 1)
    path = tmp_path / "ckpt"
    sd.save(path, model, opt, step=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = torch.load(_bytes(opt.state_dict()), weights_only=True)
    _train(model, opt, data[2:3], 0, 1)

    def killed():
        raise KeyboardInterrupt("killed mid-save")
    with pytest.raises(KeyboardInterrupt):
        sd.save(path, model, opt, step=3, _before_rename=killed)
    fresh, fresh_opt = _build(1)
    assert sd.load(path, fresh, fresh_opt) == {"step": 2}
    for n, p in fresh.named_parameters():
        assert torch.equal(p, before[n]), n
    after = fresh_opt.state_dict()
    for k, state in state_before["state"].items():
        for key in state:
            assert torch.equal(after["state"][k][key], state[key]), (k, key)

    # Killed between the two renames: the old directory is only at .ckpt.prev; load finds it, and the next
    # save puts things right.
    path.rename(tmp_path / ".ckpt.prev")
    assert sd.load(path, fresh, fresh_opt) == {"step": 2}
    sd.save(path, fresh, fresh_opt, step=2)
    assert path.exists() and not (tmp_path / ".ckpt.prev").exists() and not (tmp_path / ".ckpt.tmp").exists()


def _bytes(obj):
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


# ------------------------------------------------------------- separate host master (bf16 device weights)
def _build_bf16(seed: int):
    import socompile
    from socompile.models import build
    torch.manual_seed(seed)
    model = build("tiny", n_layers=1).to(torch.bfloat16)
    return model, socompile.AdamW(model.parameters(), max_grad_norm=0.5, bucket_size="40KB", **HYPER)


def _master(opt) -> torch.Tensor:
    return torch.cat([b.view(b.master, i).reshape(-1) for b in opt.buckets for i in range(len(b.params))
                      ]).clone()


def _separate_worker(args: dict) -> dict:
    import socompile.distributed as sd

    topo = sd.init_distributed(timeout_s=60)
    data = _data()
    model, opt, saved_master, norms = save_midway(topo, args["dir"], data, SAVE_AT, _build_bf16, _train, _master)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    final_master = _master(opt)

    fresh, fresh_opt = _build_bf16(1)      # other initial values: everything must come from the checkpoint
    sd.shard_optimizer(fresh_opt, topo.world_group)
    extra = sd.load(args["dir"], fresh, fresh_opt)
    loaded_master = _master(fresh_opt)
    resumed = _train(fresh, fresh_opt, data[SAVE_AT:], topo.rank, topo.world_size)
    same = all(torch.equal(p, final[n]) for n, p in fresh.named_parameters())
    if topo.rank == 0:
        torch.save(saved_master, args["master"])
    sd.shutdown()
    return {"extra": extra, "norms": norms, "resumed": resumed, "same_weights": same,
            "loaded_master_bitwise": torch.equal(loaded_master, saved_master),
            "same_master": torch.equal(_master(fresh_opt), final_master),
            "mirror": all(b.mirror and b.sharded for b in opt.buckets)}


def test_separate_host_master_bf16_saved_by_2_ranks_resumes_bitwise_with_its_fp32_master(tmp_path):
    # bf16 parameters, host_master="separate", ZeRO over 2 ranks: the fp32 master (not only its bf16 rounding)
    # is in the checkpoint, so a resume in the same layout continues bitwise (weights, master, global norms).
    import socompile.distributed as sd

    args = {"dir": str(tmp_path / "ckpt"), "master": str(tmp_path / "master.pt")}
    results = _ok(run_local(f"{HERE}:_separate_worker", 2, args, timeout_s=150))
    for r in results:
        assert r["mirror"] and r["extra"] == {"step": SAVE_AT}
        assert r["loaded_master_bitwise"] and r["same_master"] and r["same_weights"]
        assert r["resumed"] == r["norms"]
    # One process without torch.distributed: the same fp32 master, and bf16 weights that are its rounding.
    saved_master = torch.load(args["master"], weights_only=True)
    model, opt = _build_bf16(1)
    assert sd.load(args["dir"], model, opt) == {"step": SAVE_AT}
    assert torch.equal(_master(opt), saved_master)
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            assert torch.equal(p.detach(), b.view(b.master, i).to(torch.bfloat16))
    assert all(s["step"].item() == SAVE_AT for s in opt.state_dict()["state"].values())
