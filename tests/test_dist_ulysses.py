"""Ulysses sequence parallelism: with the sequence split over 2 gloo ranks, the logits and the (reduced)
gradients equal those of one process on the whole sequence.

Tolerance: fp32 throughout; the sharded run sums the same products in a different order (attention over the
whole sequence is the same sdpa call, but projections run on half the rows and gradients are summed across
ranks), so values agree to ~1e-6 relative. We assert atol 2e-5 on logits and 1e-5 (relative to the gradient's
max magnitude) on gradients.
"""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

from socompile.distributed.launch import run_local
from socompile.distributed.ulysses import SequenceParallelError, check_heads

HERE = str(pathlib.Path(__file__).resolve())


def _sp_worker(args: dict) -> dict:
    import socompile.distributed as sd
    from socompile.models import build

    topo = sd.init_distributed(sp=2, timeout_s=30)
    torch.manual_seed(0)
    model = build("tiny", n_heads=args["heads"], n_kv_heads=args["kv_heads"], n_layers=2)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, args["seq"] + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    sd.parallelize(model, topo.sp_group)
    run = torch.compile(model, backend=sd_backend()) if args.get("compile") else model
    logits = run(sd.shard_sequence(x, topo.sp_group))
    F.cross_entropy(logits.flatten(0, 1), sd.shard_sequence(y, topo.sp_group).flatten()).backward()
    sd.average_gradients(model.parameters(), topo.world_group)   # local-mean losses of equal shards: average
    full_logits = sd.gather_sequence(logits.detach(), topo.sp_group)

    ref_logits = ref(x)
    F.cross_entropy(ref_logits.flatten(0, 1), y.flatten()).backward()
    grad_err = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
                   for p, q in zip(model.parameters(), ref.parameters()))
    names_same = [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    sd.shutdown()
    return {"logit_err": (full_logits - ref_logits.detach()).abs().max().item(), "grad_err": grad_err,
            "names_same": names_same, "topology": topo.describe()}


def sd_backend():
    import socompile
    return socompile.SuperOffload(compute="eager", gpu_buckets=0)


def _check(results, logit_atol=2e-5, grad_rtol=1e-5):
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.output[-3000:]}"
        assert r.result["names_same"], "parallelize must keep parameter names"
        assert r.result["logit_err"] < logit_atol, r.result
        assert r.result["grad_err"] < grad_rtol, r.result


def test_sp2_forward_and_gradients_equal_one_process_gqa():
    # 4 query heads, 2 kv heads: each rank gets 2 query heads and their 1 kv head
    _check(run_local(f"{HERE}:_sp_worker", 2, {"heads": 4, "kv_heads": 2, "seq": 32}, timeout_s=60))


def test_sp2_repeats_kv_heads_when_fewer_than_ranks():
    # 1 kv head over 2 ranks: kv is repeated to 2 heads before the all-to-all
    _check(run_local(f"{HERE}:_sp_worker", 2, {"heads": 4, "kv_heads": 1, "seq": 16}, timeout_s=60))


@pytest.mark.slow
def test_sp2_through_superoffload_compile_equals_one_process():
    _check(run_local(f"{HERE}:_sp_worker", 2, {"heads": 4, "kv_heads": 2, "seq": 32, "compile": True},
                     timeout_s=180))


def test_heads_not_divisible_by_sp_is_a_clear_error():
    with pytest.raises(SequenceParallelError, match="n_heads=6 is not divisible by sp=4"):
        check_heads(6, 2, 4)


def test_kv_repeat_factor():
    assert check_heads(8, 8, 4) == 1
    assert check_heads(8, 2, 4) == 2
    assert check_heads(12, 4, 6) == 3
