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

HERE = str(pathlib.Path(__file__).resolve())
EMULATED = {"SOCOMPILE_RUNTIME": "emulated"}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
CLIP = 0.5
TOL = 3e-5      # fp32 weights vs torch (module docstring)
ROWS = 4        # rows per step, split between the ranks


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
    model = build("tiny", n_layers=1)
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
            with torch.no_grad():
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
    with opt.materialized_weights():
        weights = [p.detach().clone() for p in model.parameters()]
    ref = _torch_reference(start, batches, topo.world_size)
    out["err"] = max((w - r).abs().max().item() for w, r in zip(weights, ref))
    out["weights_sum"] = [float(w.double().sum()) for w in weights]
    sd.shutdown()
    return out


def _ok(runs) -> list[dict]:
    for r in runs:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-3000:]}"
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
        # reads outside the compiled forward waited first (a late all-gather leaves NaN until waited)
        assert overlapped["eager_finite"] and overlapped["pending_after_eager"] == []
        assert all(pending == [] for _, pending in state["waits"]), \
            "the eager forward after step 1 already waited for every all-gather"
        assert state["state_finite"] and state["pending_after_state_dict"] == [] and state["state_is_gathered"]
        assert all(pending == [] for _, pending in after["waits"]), \
            "model.state_dict() after step 2 already waited for every all-gather"
        assert all(s["loss"] == s["loss"] for s in r["steps"]), "no forward read NaN weights"
        assert r["err"] < TOL, r["err"]
    assert results[0]["weights_sum"] == results[1]["weights_sum"], "the gathered weights are equal on every rank"
