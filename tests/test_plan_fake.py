import resource

import torch

from socompile.offline import plan_model


def test_a_1b_model_is_planned_under_fake_tensor_mode_without_its_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ctx = plan_model("llama-1b", batch=4, seq=4096, options={"target": "gh200"}, dtype=torch.bfloat16,
                     run_passes=False)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1000       # 1.3B bf16 weights alone would be 2.6 GB
    assert ctx.plan.prediction("device_peak_bytes") <= ctx.plan.prediction("device_budget_bytes")
    assert sum(b.numel for b in ctx.plan.buckets) > 1_000_000_000
