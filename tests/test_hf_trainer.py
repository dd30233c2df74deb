"""The Hugging Face Trainer in one switch: ``socompile.hf.Trainer`` trains equal to ``transformers.Trainer`` with
its default optimizer (fused AdamW) and its own clipping (max_grad_norm, set to 0.5 here so that every run
clips: the models' norms are 0.8-1.5), on a small Llama with random
weights (nothing downloaded).

Tolerance: 1e-5 relative on every loss and every logged grad_norm, the bar the adoption promise sets. Why it
holds: compute="eager" runs the same aten ops as eager, so gradients differ only by reduction order (~1e-7
relative in fp32); Adam's update m / (sqrt(v) + eps) divides such a relative error out (it stays ~1e-7 of the
step, lr 1e-3), and over 6 steps the parameters drift ~1e-9 absolute, far below what moves a loss of ~5.5 by
1e-5 relative. The clip coefficient max_norm / (norm + 1e-6) carries the norm's ~1e-7 relative error.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")

import socompile  # noqa: E402
import socompile.hf  # noqa: E402
from socompile.compat.hf import build_causal_lm  # noqa: E402

RTOL = 1e-5   # see the module docstring
OFFLOADED = {"compute": "eager", "gpu_buckets": 0, "bucket_size": "64KB"}   # every bucket steps on the CPU
DEFAULT_PLAN = {"compute": "eager"}


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _recording(trainer_cls):
    """``trainer_cls`` that records the loss of every training_step (the logged loss is a mean over steps)."""
    class Recording(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.losses = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.detach().item())
            return loss
    return Recording


def _model():
    torch.manual_seed(0)
    return build_causal_lm("llama")


def _args(tmp_path, name, **overrides):
    settings = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=6,
                    learning_rate=1e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear",
                    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                    disable_tqdm=True, seed=7, max_grad_norm=0.5)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _train(trainer_cls, args, resume=None, **kwargs):
    trainer = _recording(trainer_cls)(model=_model(), args=args, train_dataset=_Tokens(), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    return trainer, trainer.losses, norms


def _assert_equal_runs(ours, ref, what):
    assert len(ours) == len(ref) and ref, (what, ours, ref)
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=RTOL, atol=0, msg=lambda m: f"{what}: {m}")


# without accumulation: -m slow (the default suite has both plans with accumulation, and the save-and-resume test
# below trains without)
@pytest.mark.parametrize("plan, accumulation", [pytest.param("offloaded", 1, marks=pytest.mark.slow), ("offloaded", 2),
                                                pytest.param("default", 1, marks=pytest.mark.slow), ("default", 2)])
def test_one_switch_trains_equal_to_the_trainer(tmp_path, accumulation, plan):
    options = OFFLOADED if plan == "offloaded" else DEFAULT_PLAN
    ref_trainer, ref_losses, ref_norms = _train(
        transformers.Trainer, _args(tmp_path, "ref", gradient_accumulation_steps=accumulation))
    assert ref_trainer.args.optim == "adamw_torch_fused"   # the Trainer's default optimizer
    trainer, losses, norms = _train(socompile.hf.Trainer,
                                    _args(tmp_path, "ours", gradient_accumulation_steps=accumulation),
                                    socompile_options=options)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, socompile.AdamW)
    assert opt.max_grad_norm == 0.5 and opt.grad_accumulation_steps == accumulation
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # Clipping happened at every step, once, by the optimizer (the Trainer's own clip did not change the
    # gradients): Adam's update is nearly invariant to a constant scale, so losses alone would barely show
    # a clip missed or applied twice.
    assert min(ref_norms) > 0.5
    stats = opt.stats
    assert stats["clipped_steps"] == stats["steps"] == 6 and stats["script_changed_steps"] == 0
    assert sum(e.kind == "grads_ready" for e in opt.events.events()) > 0   # the compiled backward fed it
    _assert_equal_runs(losses, ref_losses, "losses")
    _assert_equal_runs(norms, ref_norms, "grad_norm")


def test_one_switch_saves_and_resumes_equal_to_the_trainer(tmp_path):
    _, ref_losses, _ = _train(transformers.Trainer, _args(tmp_path, "ref"))
    saving = _args(tmp_path, "ours", save_strategy="steps", save_steps=3)
    _, first, _ = _train(socompile.hf.Trainer, saving, socompile_options=OFFLOADED)
    _assert_equal_runs(first, ref_losses, "uninterrupted")
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()
    _, resumed, _ = _train(socompile.hf.Trainer, _args(tmp_path, "resumed"), resume=str(checkpoint),
                           socompile_options=OFFLOADED)
    _assert_equal_runs(resumed, ref_losses[3:], "resumed at step 3")


def test_the_trainers_compile_switch_means_ours(tmp_path):
    args = _args(tmp_path, "ours", max_steps=2, torch_compile=True, torch_compile_backend="superoffload")
    trainer, losses, _ = _train(socompile.hf.Trainer, args, socompile_options=OFFLOADED)
    assert len(losses) == 2 and not trainer.args.torch_compile


def test_what_the_one_switch_cannot_take(tmp_path):
    with pytest.raises(ValueError, match="optim='adamw_torch_fused'"):
        socompile.hf.Trainer(model=_model(), args=_args(tmp_path, "a", optim="adafactor"))
    with pytest.raises(ValueError, match="torch_compile_backend='inductor'"):
        socompile.hf.Trainer(model=_model(), args=_args(tmp_path, "b", torch_compile_backend="inductor"))
    model = _model()
    with pytest.raises(TypeError, match="needs a socompile.AdamW"):
        socompile.hf.Trainer(model=model, args=_args(tmp_path, "c"),
                             optimizers=(torch.optim.AdamW(model.parameters()), None))


def test_a_compile_without_our_optimizer_points_to_the_one_switch(caplog):
    """Where the backend's name reaches us without socompile.AdamW (a launcher that compiles with
    backend='superoffload' and builds torch's AdamW, as the Trainer's torch_compile switch would), the warning
    names socompile.hf.Trainer."""
    model = _model()
    compiled = torch.compile(model, backend="superoffload", options={"compute": "eager"})
    ids = torch.randint(0, 256, (2, 16))
    with caplog.at_level("WARNING", logger="socompile"):
        compiled(input_ids=ids, labels=ids).loss.backward()
    assert "socompile.hf.Trainer" in caplog.text
