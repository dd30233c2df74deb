"""Hugging Face decoder models (small configs, random weights, nothing downloaded) trained through the
superoffload backend with socompile.AdamW equal eager PyTorch with torch.optim.AdamW.

Tolerance: atol 1e-6 after 3 steps, the argument of test_backend_training.py (compute="eager": the same aten
ops as eager, so gradients are equal up to reduction order; the kernel's sqrt is correctly rounded, torch's
is not, ~1 ulp per step). One exception, GPT-2's key bias (the middle third of ``c_attn.bias``): softmax
ignores a per-query constant, so its true gradient is exactly zero and the computed one is rounding noise
(~1e-10). Adam normalises that noise (m / (sqrt(v) + eps) with |g| ~ eps), so two different summation
orders of the same zero give updates that differ by up to lr * 3 steps; we measure ~3e-6 and allow 3e-5.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")

import socompile  # noqa: E402
from socompile.compat.hf import FAMILIES, build_causal_lm, check_model, logits_loss  # noqa: E402
from training_helpers import run_pair  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_trains_equal_to_eager_adamw(family):
    ours, ref, backend, opt = run_pair(lambda: build_causal_lm(family), steps=3, loss_fn=logits_loss,
                                       options={"bucket_size": "64KB"})
    assert check_model(ours) == []
    assert len(backend.compiled) == 1                      # one graph: no graph break inside the model
    assert len(backend.compiled[0].plan.buckets) > 1
    assert sum(e.kind == "grads_ready" for e in opt.events.events()) == 3 * len(backend.compiled[0].plan.buckets)
    # Read as docs/runtime.md says a user reads weights between steps: on CUDA (or SOCOMPILE_RUNTIME=emulated)
    # the last step's uploads may still be in flight.
    with opt.materialized_weights():
        for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            p, q = p.detach(), q.detach()
            if family == "gpt2" and name.endswith("attn.c_attn.bias"):
                hidden = p.numel() // 3
                key = slice(hidden, 2 * hidden)   # see the module docstring
                torch.testing.assert_close(p[key], q[key], atol=3e-5, rtol=0, msg=lambda m: f"{name}[key]: {m}")
                p, q = torch.cat([p[:hidden], p[2 * hidden:]]), torch.cat([q[:hidden], q[2 * hidden:]])
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def test_check_model_names_what_would_go_wrong():
    model = build_causal_lm("gpt2", resid_pdrop=0.1, use_cache=True).to(torch.bfloat16)
    problems = " | ".join(check_model(model))
    assert "use_cache" in problems and "resid_pdrop" in problems
    assert "fp32" not in problems and "bfloat16" not in problems   # bf16 trains: a separate fp32 host master


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def test_hf_trainer_recipe_from_docs_hf_md(tmp_path, monkeypatch):
    """The recipe of docs/hf.md: options from SOCOMPILE_* variables, model.compile(backend=...), our optimizer
    through optimizers=(opt, None), Trainer's own clipping off (max_grad_norm=0; the optimizer clips)."""
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    monkeypatch.setenv("SOCOMPILE_COMPUTE", "eager")
    monkeypatch.setenv("SOCOMPILE_GPU_BUCKETS", "0")
    monkeypatch.setenv("SOCOMPILE_BUCKET_SIZE", "64KB")
    torch.manual_seed(0)
    model = build_causal_lm("llama")
    before = [p.detach().clone() for p in model.parameters()]
    opt = socompile.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)
    model.compile(backend="superoffload")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, max_grad_norm=0.0,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    ready = [e for e in opt.events.events() if e.kind == "grads_ready"]
    assert ready, "gradients did not reach the optimizer through the compiled backward graph"
    assert opt.state_dict()["state"][0]["step"].item() == 3.0
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert os.environ["SOCOMPILE_BUCKET_SIZE"] == "64KB"


def test_accelerate_rejects_unknown_backend_names_as_docs_hf_md_says(tmp_path):
    """Why the recipe compiles the model itself: TrainingArguments(torch_compile_backend="superoffload")
    goes through accelerate's DynamoBackend enum, which lists torch's own backends only."""
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True,
                                          torch_compile_backend="superoffload", report_to=[], use_cpu=True)
    try:
        transformers.Trainer(model=build_causal_lm("llama"), args=args, train_dataset=_Tokens())
    except ValueError as err:
        assert "SUPEROFFLOAD" in str(err)
    else:   # a newer accelerate accepts any registered backend: then the plain recipe works too
        pytest.skip("this accelerate accepts torch_compile_backend='superoffload'; docs/hf.md may say so")
