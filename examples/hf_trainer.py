"""Train a small Hugging Face Llama with the HF Trainer through the superoffload backend (docs/hf.md).

    python examples/hf_trainer.py --steps 20 --out /tmp/hf_trainer

Random weights from a small config (nothing downloaded), random token data; options come from SOCOMPILE_*
environment variables, as they would for any launcher that passes no options. Saves an atomic checkpoint at
the end with socompile.save.
"""
from __future__ import annotations

import argparse
import os

import torch


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral", "gpt2"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="hf_trainer_out")
    args = parser.parse_args()
    os.environ.setdefault("SOCOMPILE_COMPUTE", "eager")     # fast compile on a CPU; "inductor" for speed
    os.environ.setdefault("SOCOMPILE_GPU_BUCKETS", "0")     # every bucket stepped by the CPU worker
    os.environ.setdefault("SOCOMPILE_BUCKET_SIZE", "64KB")  # several buckets even for a tiny model

    import transformers

    import socompile
    from socompile.compat.hf import build_causal_lm, check_model

    torch.manual_seed(0)
    model = build_causal_lm(args.family)
    for problem in check_model(model):
        print("warning:", problem)
    opt = socompile.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    model.compile(backend="superoffload")
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps, max_grad_norm=0.0,
        lr_scheduler_type="cosine", warmup_steps=2, logging_steps=5, report_to=[], save_strategy="no",
        use_cpu=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=RandomTokens(4 * args.steps, 64),
                                   optimizers=(opt, None))
    result = trainer.train()
    path = socompile.save(os.path.join(args.out, "final.pt"), model, opt, step=args.steps)
    print(f"loss {result.training_loss:.4f}; speculation {opt.stats}; checkpoint {path}")


if __name__ == "__main__":
    main()
