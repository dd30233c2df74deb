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
from dist_helpers import assert_ranks_ok

HERE = str(pathlib.Path(__file__).resolve())


# One 2-rank job (one process group) runs every case; each test checks its own. The compiled case uses one
# layer: the compile, not the model, is what it tests, and it is most of the job's time.
CASES = {"gqa": {"heads": 4, "kv_heads": 2, "seq": 32, "layers": 2},
         "kv-repeat": {"heads": 4, "kv_heads": 1, "seq": 16, "layers": 2},
         "compiled": {"heads": 4, "kv_heads": 2, "seq": 32, "layers": 1, "compile": True}}


def _sp_worker(args: dict) -> dict:
    import socompile.distributed as sd

    topo = sd.init_distributed(sp=2, timeout_s=30)
    results = {name: _sp_case(topo, case) for name, case in args["cases"].items()}
    sd.shutdown()
    return results


def _sp_case(topo, args: dict) -> dict:
    import socompile.distributed as sd
    from socompile.models import build

    torch.manual_seed(0)
    model = build("tiny", n_heads=args["heads"], n_kv_heads=args["kv_heads"], n_layers=args["layers"])
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
    return {"logit_err": (full_logits - ref_logits.detach()).abs().max().item(), "grad_err": grad_err,
            "names_same": names_same, "topology": topo.describe(),
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}


def sd_backend():
    import socompile
    return socompile.SuperOffload(compute="eager", gpu_buckets=0)


@pytest.fixture(scope="module")
def sp_runs() -> list[dict]:
    results = run_local(f"{HERE}:_sp_worker", 2, {"cases": CASES}, timeout_s=240)
    assert_ranks_ok(results)
    return [r.result for r in results]


def _check(sp_runs, case: str, logit_atol=2e-5, grad_rtol=1e-5):
    for ranks in sp_runs:
        r = ranks[case]
        assert r["names_same"], "parallelize must keep parameter names"
        assert r["logit_err"] < logit_atol, r
        assert r["grad_err"] < grad_rtol, r


def test_sp2_forward_and_gradients_equal_one_process_gqa(sp_runs):
    # 4 query heads, 2 kv heads: each rank gets 2 query heads and their 1 kv head
    _check(sp_runs, "gqa")


def test_sp2_repeats_kv_heads_when_fewer_than_ranks(sp_runs):
    # 1 kv head over 2 ranks: kv is repeated to 2 heads before the all-to-all
    _check(sp_runs, "kv-repeat")


def test_sp2_through_superoffload_compile_equals_one_process(sp_runs):
    _check(sp_runs, "compiled")
    assert all(ranks["compiled"]["graphs"] >= 1 for ranks in sp_runs), "the compiled case must compile"


def test_heads_not_divisible_by_sp_is_a_clear_error():
    with pytest.raises(SequenceParallelError, match="n_heads=6 is not divisible by sp=4"):
        check_heads(6, 2, 4)


def test_kv_repeat_factor():
    assert check_heads(8, 8, 4) == 1
    assert check_heads(8, 2, 4) == 2
    assert check_heads(12, 4, 6) == 3
