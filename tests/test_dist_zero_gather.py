"""Device-side ZeRO (runtime/sharded_bucket.py) on 2 gloo ranks over the emulated CUDA device: the weights'
all-gather overlaps the next forward (distributed/zero_gather.py), and sharded checkpoints of such a run.

Overlap. ``opt.step()`` issues each bucket's all-gather and waits for none; the compiled forward waits for each
bucket's right before its first read (socompile::wait_upload). To make any read that skips its wait visible, the
workers replace gloo's async all-gather with a *late* one: the real all-gather runs into a scratch tensor, the
output (the device weights) is poisoned with NaN when the collective is issued and filled only by ``wait()``.
A reader that did not wait sees NaN; the run still equals torch.

Reference and tolerance: torch.optim.AdamW + clip_grad_norm_ on the ranks' micro-batches one after the other,
gradients summed in rank order and divided by W as the reduce-scatter averages them: TOL = 3e-5 on the weights,
tests/test_dist_zero.py's derivation for the same model, data, hyper-parameters (eps 1e-6) and <= 9 steps
(fp32 sums in another order, ~1e-9, amplified by Adam's 1/eps at most: lr * 1e-9 / eps = 1e-6 per step).
"""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

from socompile.distributed.launch import run_local
from dist_helpers import assert_ranks_ok, save_midway

HERE = str(pathlib.Path(__file__).resolve())
EMULATED = {"SOCOMPILE_RUNTIME": "emulated"}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
CLIP = 0.5
TOL = 3e-5      # fp32 weights vs torch (module docstring)
ROWS = 6        # rows per step, split between the ranks (1, 2 or 3 of them)


def _batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (ROWS, 33), generator=gen) for _ in range(steps)]


def _pending(opt) -> list[int]:
    """Buckets whose weights' all-gather was issued and not waited for (none, before the overlap existed)."""
    return [b.index for b in opt.buckets if b.device_shard is not None
            and getattr(b.device_shard, "gather", None) is not None]


class _LateWork:
    def __init__(self, work, scratch, output):
        self.work, self.scratch, self.output = work, scratch, output

    def wait(self, *args):
        self.work.wait()
        self.output.copy_(self.scratch)
        return True


def _late_all_gathers() -> None:
    """This process's async all-gathers deliver their output only at ``wait()``; NaN until then."""
    import torch.distributed as dist
    real = dist.all_gather_into_tensor

    def late(output, input, group=None, async_op=False):
        if not async_op:
            return real(output, input, group=group)
        scratch = torch.empty_like(output)
        work = real(scratch, input, group=group, async_op=True)
        output.fill_(float("nan"))
        return _LateWork(work, scratch, output)

    dist.all_gather_into_tensor = late


def _torch_reference(model, batches, world: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    rows = ROWS // world
    for tokens in batches:
        for rank in range(world):
            mine = tokens[rank * rows:(rank + 1) * rows]
            F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten()).backward()
        for p in model.parameters():
            p.grad /= world
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _overlap_worker(args: dict) -> dict:
    import socompile
    import socompile.distributed as sd
    from socompile.models import build
    from socompile.optim.graph_claim import GraphClaim

    topo = sd.init_distributed(timeout_s=60)
    _late_all_gathers()
    torch.manual_seed(0)
    model = build("tiny-tied", n_layers=1)   # lm_head's weight is tok_emb's: one parameter, two modules' reads
    start = copy.deepcopy(model)
    opt = socompile.AdamW(model.parameters(), max_grad_norm=CLIP, bucket_size="40KB", **HYPER)
    sd.shard_optimizer(opt, topo.world_group)
    run = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0, bucket_size="40KB"))
    waits: list[tuple[int, list[int]]] = []   # (bucket the forward waits for, buckets pending just before)
    real_wait = GraphClaim.wait_upload

    def recording_wait(claim, bucket):
        waits.append((claim.buckets[bucket].index, _pending(opt)))
        return real_wait(claim, bucket)

    GraphClaim.wait_upload = recording_wait
    batches = _batches(4)
    rows = ROWS // topo.world_size
    out = {"steps": []}
    for step, tokens in enumerate(batches):
        mine = tokens[rows * topo.rank: rows * (topo.rank + 1)]
        waits.clear()
        loss = F.cross_entropy(run(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
        record = {"waits": list(waits), "pending_after_forward": _pending(opt), "loss": float(loss)}
        loss.backward()
        opt.step()
        opt.zero_grad()
        record["pending_after_step"] = _pending(opt)
        if step == 1:   # a plain eager forward of the module reads the weights: it waits for every all-gather
            with torch.no_grad():   # ... first lm_head alone: only for the bucket of its (tied) weight
                logits = model.lm_head(torch.ones(2, model.lm_head.in_features))
                record["lm_head_finite"] = bool(logits.isfinite().all())
                record["pending_after_lm_head"] = _pending(opt)
                eager = model(mine[:, :-1])
            record["eager_finite"] = bool(eager.isfinite().all())
            record["pending_after_eager"] = _pending(opt)
        if step == 2:   # the model's state_dict waits too
            state = {k: v.clone() for k, v in model.state_dict().items()}
            record["state_finite"] = all(bool(v.isfinite().all()) for v in state.values())
            record["pending_after_state_dict"] = _pending(opt)
            opt.wait_uploads()
            record["state_is_gathered"] = all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
        out["steps"].append(record)
    out["fw_rank"] = [(b.index, b.fw_rank) for b in opt.buckets]
    out["lm_head_buckets"] = [b.index for b in opt.buckets if any(p is model.lm_head.weight for p in b.params)]
    with opt.materialized_weights():
        weights = [p.detach().clone() for p in model.parameters()]
    ref = _torch_reference(start, batches, topo.world_size)
    out["err"] = max((w - r).abs().max().item() for w, r in zip(weights, ref))
    out["weights_sum"] = [float(w.double().sum()) for w in weights]
    sd.shutdown()
    return out


def _ok(runs) -> list[dict]:
    assert_ranks_ok(runs)
    return [r.result for r in runs]


def test_weight_all_gathers_overlap_the_next_forward_each_waited_right_before_its_first_read():
    results = _ok(run_local(f"{HERE}:_overlap_worker", 2, {}, timeout_s=240, env=EMULATED))
    for r in results:
        assert all(rank is not None for _, rank in r["fw_rank"]) and len(r["fw_rank"]) > 1, r["fw_rank"]
        order = [index for index, _ in sorted(r["fw_rank"], key=lambda pair: pair[1])]
        first, overlapped, state, after = r["steps"]
        for step in r["steps"]:
            assert [w for w, _ in step["waits"]] == order, "the forward waits in the order it reads the buckets"
            assert sorted(step["pending_after_step"]) == sorted(order), \
                "step() issues every bucket's all-gather and waits for none"
            assert step["pending_after_forward"] == [], "the forward waited for every bucket it reads"
        assert all(pending == [] for _, pending in first["waits"]), "nothing was gathered before the first step"
        # the forward after a step: each bucket waited right before its first read, while the later ones are
        # still in flight (the overlap) and every earlier one is done
        for k, (bucket, pending) in enumerate(overlapped["waits"]):
            assert sorted(pending) == sorted(order[k:]), (bucket, pending)
        # reads outside the compiled forward waited first (a late all-gather leaves NaN until waited): an eager
        # call of one module waits for the buckets of its parameters only (its tied weight's), the whole model's
        # for the rest
        assert len(r["lm_head_buckets"]) == 1 and len(order) > 1, (r["lm_head_buckets"], order)
        assert sorted(overlapped["pending_after_lm_head"]) == sorted(set(order) - set(r["lm_head_buckets"])), \
            "lm_head waited for the all-gather of its tied weight's bucket and for no other"
        assert overlapped["lm_head_finite"], "lm_head read its tied weight only after that bucket's all-gather"
        assert overlapped["eager_finite"] and overlapped["pending_after_eager"] == []
        assert all(pending == [] for _, pending in state["waits"]), \
            "the eager forward after step 1 already waited for every all-gather"
        assert state["state_finite"] and state["pending_after_state_dict"] == [] and state["state_is_gathered"]
        assert all(pending == [] for _, pending in after["waits"]), \
            "model.state_dict() after step 2 already waited for every all-gather"
        assert all(s["loss"] == s["loss"] for s in r["steps"]), "no forward read NaN weights"
        assert r["err"] < TOL, r["err"]
    assert results[0]["weights_sum"] == results[1]["weights_sum"], "the gathered weights are equal on every rank"


# ------------------------------------------------------------------ sharded checkpoints of a device-sharded run
# bf16 weights (their fp32 master is in the checkpoint, as each rank's piece), 2 ranks, eager, clipping.
SAVE_AT, STEPS = 2, 4


def _build_bf16(seed: int):
    import socompile
    from socompile.models import build
    torch.manual_seed(seed)
    model = build("tiny", n_layers=1).to(torch.bfloat16)
    return model, socompile.AdamW(model.parameters(), max_grad_norm=CLIP, bucket_size="40KB", **HYPER)


def _train(model, opt, batches, rank: int, world: int) -> list[float]:
    rows = ROWS // world
    norms = []
    for tokens in batches:
        mine = tokens[rank * rows:(rank + 1) * rows]
        F.cross_entropy(model(mine[:, :-1]).float().flatten(0, 1), mine[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms


def _master_pieces(opt) -> dict[int, tuple[int, torch.Tensor]]:
    """Parameter index (in the optimizer) -> (first element, this rank's piece of its flat fp32 master)."""
    index_of = {id(p): k for k, p in enumerate(opt.all_params())}
    out = {}
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            a, c = b.held(i) or (0, 0)
            start = b.offsets[i] + a
            out[index_of[id(p)]] = (a, b.master[b.host(start, start + c - a)].clone())
    return out


def _weights(model, opt) -> dict[str, torch.Tensor]:
    with opt.materialized_weights():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_worker(args: dict) -> dict:
    import socompile.distributed as sd
    topo = sd.init_distributed(timeout_s=60)
    batches = _batches(STEPS)
    model, opt, saved, norms = save_midway(topo, args["dir"], batches, SAVE_AT, _build_bf16, _train, _master_pieces)
    run = {"saved": saved, "final": _master_pieces(opt), "weights": _weights(model, opt), "norms": norms}
    device_sharded = all(b.device_shard is not None for b in opt.buckets)
    del model, opt
    resumed = _resume(args["dir"], topo)   # new model and optimizer in the same processes (new processes: test_..._on_restarted_ranks)
    torch.save({**run, "resumed": resumed, "from_host_path": _load_a_host_path_checkpoint(args["dir"] + "-host", topo)},
               f"{args['out']}.{topo.rank}")
    sd.shutdown()
    return {"device_sharded": device_sharded}


def _load_a_host_path_checkpoint(path: str, topo) -> bool:
    """A checkpoint of the host path (CPU runtime: every rank's master whole, saved whole) loaded by a device-sharded
    run: True when each rank's master shard is its window of the saved master, bit for bit."""
    import os

    import socompile.distributed as sd
    os.environ["SOCOMPILE_RUNTIME"] = "cpu"
    model, opt = _build_bf16(0)
    os.environ["SOCOMPILE_RUNTIME"] = "emulated"
    sd.shard_optimizer(opt, topo.world_group)
    _train(model, opt, _batches(SAVE_AT), topo.rank, topo.world_size)
    sd.save(path, model, opt, step=SAVE_AT)
    index_of = {id(p): k for k, p in enumerate(opt.all_params())}
    whole = {index_of[id(p)]: b.view(b.master, i).reshape(-1).clone() for b in opt.buckets
             for i, p in enumerate(b.params)}
    assert not any(b.device_shard for b in opt.buckets)
    fresh, fresh_opt = _build_bf16(1)
    sd.shard_optimizer(fresh_opt, topo.world_group)
    sd.load(path, fresh, fresh_opt)
    assert all(b.device_shard for b in fresh_opt.buckets)
    return all(torch.equal(piece, whole[k][offset:offset + piece.numel()])
               for k, (offset, piece) in _master_pieces(fresh_opt).items())


def _resume(path: str, topo) -> dict:
    """Other initial values, the checkpoint loaded, the rest of the run."""
    import socompile.distributed as sd
    model, opt = _build_bf16(1)
    sd.shard_optimizer(opt, topo.world_group)
    extra = sd.load(path, model, opt)
    loaded = _master_pieces(opt)
    norms = _train(model, opt, _batches(STEPS)[SAVE_AT:], topo.rank, topo.world_size)
    return {"extra": extra, "loaded": loaded, "final": _master_pieces(opt), "weights": _weights(model, opt),
            "norms": norms}


def _resume_worker(args: dict) -> dict:
    """A restarted rank: a new process loads the checkpoint and runs the rest."""
    import socompile.distributed as sd
    topo = sd.init_distributed(timeout_s=60)
    resumed = _resume(args["dir"], topo)
    torch.save(resumed, f"{args['out']}.{topo.rank}")
    sd.shutdown()
    return {"extra": resumed["extra"]}


@pytest.fixture(scope="module")
def device_saved(tmp_path_factory):
    """A checkpoint written by 2 device-sharded ranks after SAVE_AT of STEPS steps, and how that run went on."""
    root = tmp_path_factory.mktemp("device-dcp")
    args = {"dir": str(root / "ckpt"), "out": str(root / "uninterrupted")}
    results = _ok(run_local(f"{HERE}:_save_worker", 2, args, timeout_s=240, env=EMULATED))
    assert all(r["device_sharded"] for r in results)
    return args, [torch.load(f"{args['out']}.{rank}", weights_only=True) for rank in range(2)]


def _whole(pieces_of_ranks: list[dict], index: int) -> torch.Tensor:
    parts = sorted(pieces_of_ranks[rank][index] for rank in range(len(pieces_of_ranks)))
    return torch.cat([piece for _, piece in parts])


def _check_resumed_bitwise(resumed: dict, run: dict) -> None:
    assert resumed["extra"] == {"step": SAVE_AT}
    for k, (offset, piece) in run["saved"].items():   # this rank's master shard, as saved, bit for bit
        assert resumed["loaded"][k][0] == offset and torch.equal(resumed["loaded"][k][1], piece), k
    # the same layout continues bitwise: norms, fp32 master shards, gathered bf16 weights
    assert resumed["norms"] == run["norms"]
    for k, (_, piece) in run["final"].items():
        assert torch.equal(resumed["final"][k][1], piece), k
    assert all(torch.equal(w, run["weights"][n]) for n, w in resumed["weights"].items())




def test_device_sharded_checkpoint_resumes_bitwise_on_restarted_ranks(device_saved, tmp_path):
    args, runs = device_saved
    out = str(tmp_path / "resumed")
    _ok(run_local(f"{HERE}:_resume_worker", 2, {"dir": args["dir"], "out": out}, timeout_s=240, env=EMULATED))
    for rank, run in enumerate(runs):
        _check_resumed_bitwise(torch.load(f"{out}.{rank}", weights_only=True), run)


def test_device_sharded_checkpoint_resumes_bitwise_loads_into_one_process_and_refuses_a_corrupt_piece(
        device_saved, tmp_path, monkeypatch):
    # one test on the fixture's one launch (2 tests would make it launch once per xdist worker)
    import shutil

    import socompile.distributed as sd
    args, runs = device_saved
    for run in runs:   # resumed at the same world size, by new objects in the saving processes
        _check_resumed_bitwise(run["resumed"], run)
        assert run["from_host_path"], "a whole master saved by the host path loads into the device shards exactly"
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    model, opt = _build_bf16(1)
    assert sd.load(args["dir"], model, opt) == {"step": SAVE_AT}
    # the ranks' pieces of every master, whole in one process (another world size: the pieces re-shard)
    index_of = {id(p): k for k, p in enumerate(opt.all_params())}
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            master = b.view(b.master, i).reshape(-1)
            assert torch.equal(master, _whole([r["saved"] for r in runs], index_of[id(p)]))
            assert torch.equal(p.detach().reshape(-1), master.to(torch.bfloat16)), "weights: the master rounded"
    # a flipped byte in rank 1's piece of a master: the load names the entry and the piece
    k, (offset, piece) = next((k, v) for k, v in runs[1]["saved"].items() if v[1].numel() > 8)
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(args["dir"], copy_dir)
    data = copy_dir / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    start = raw.find(piece.numpy().tobytes())
    assert start > 0
    raw[start + 4 * (piece.numel() // 2) + 1] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match=rf"sharded checkpoint {copy_dir} is corrupt: the bytes of "
                                           rf"optim\.state\.{k}\.master@{offset} do not match the checksum"):
        sd.load(copy_dir, *_build_bf16(1))


# bf16 weights resumed on another world size: each rank's gradients are summed in another order in bf16, so the run
# after the resume differs from the uninterrupted one by bf16 rounding of the gradients (a few 2^-9 relative):
# norms within 2% (tests/test_dist_zero_device.py's BF16_NORM_RTOL derivation, the same model and data).
BF16_NORM_RTOL = 2e-2


def test_device_sharded_checkpoint_saved_by_2_ranks_resumes_on_3(device_saved, tmp_path):
    args, runs = device_saved
    out = str(tmp_path / "resumed3")
    results = _ok(run_local(f"{HERE}:_resume_worker", 3, {"dir": args["dir"], "out": out}, timeout_s=300,
                            env=EMULATED))
    assert all(r["extra"] == {"step": SAVE_AT} for r in results)
    resumed = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(3)]
    for k in runs[0]["saved"]:   # re-sharded exactly: the 3 ranks' pieces are the 2 ranks' pieces, bit for bit
        assert torch.equal(_whole([r["loaded"] for r in resumed], k), _whole([r["saved"] for r in runs], k)), k
    for r in resumed:
        assert r["norms"] == resumed[0]["norms"], "every rank sees the same global norm"
        for ours, theirs in zip(r["norms"], runs[0]["norms"]):
            assert abs(ours - theirs) <= BF16_NORM_RTOL * theirs, (ours, theirs)
