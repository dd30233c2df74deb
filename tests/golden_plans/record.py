"""Records the plans that tests/test_plan_golden.py compares against (run it only on purpose: the files are the
reference that a reshaping of the code must reproduce byte for byte).

    python tests/golden_plans/record.py
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

# name -> (model, plan_model keyword arguments). Chosen to cover each planner branch cheaply: a small
# model, flow with prefetch on a Superchip, GPU-resident buckets, activation choices (auto, pinned, offload),
# sequence and data parallel degrees, a PCIe profile, a fold-free trace.
CASES: dict[str, tuple[str, dict]] = {
    "tiny-h100": ("tiny", dict(batch=2, seq=64, options={"target": "h100-pcie"})),
    "tiny-gh200-fp32-nofold": ("tiny", dict(batch=2, seq=64, fold=False, options={"target": "gh200"})),
    "small-gh200-bf16-1MB": ("small", dict(batch=4, seq=256, dtype=torch.bfloat16,
                                           options={"target": "gh200", "bucket_size": "1MB",
                                                    "device_memory_budget": "40MB"})),
    "small-selective-offload": ("small", dict(batch=4, seq=512, dtype=torch.bfloat16,
                                              options={"target": "h100-pcie", "bucket_size": "1MB",
                                                       "activations": "selective_offload"})),
    "llama-7b-gh200": ("llama-7b", dict(batch=4, seq=4096, dtype=torch.bfloat16, options={"target": "gh200"})),
    "llama-13b-pcie-recompute": ("llama-13b", dict(batch=2, seq=4096, dtype=torch.bfloat16,
                                                   options={"target": "a100-pcie", "activations": "recompute"})),
    # gpu_buckets pinned: the planner's own choice keeps every bucket on the GPU here, and the case is what
    # covers the host side under ZeRO (CPU buckets sharded over dp x sp, their per-rank host memory)
    "llama-7b-dp2-sp2": ("llama-7b", dict(batch=2, seq=4096, dtype=torch.bfloat16,
                                          options={"target": "gh200", "dp_degree": 2, "sp_degree": 2,
                                                   "gpu_buckets": 8})),
}


def plan_json(name: str) -> str:
    from socompile.offline import plan_model
    model, kwargs = CASES[name]
    return plan_model(model, run_passes=False, **kwargs).plan.to_json()


if __name__ == "__main__":
    for case in CASES:
        (HERE / f"{case}.json").write_text(plan_json(case) + "\n")
        print("recorded", case)
