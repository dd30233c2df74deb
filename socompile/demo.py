"""`make demo`: train the embedded tiny Llama on the standard library's text through the superoffload backend."""
from __future__ import annotations

import time

import torch


def run_demo(preset: str = "tiny", steps: int = 300, batch: int = 8, seq: int = 128, lr: float = 3e-3,
             compute: str = "inductor", seed: int = 0, log_every: int = 10) -> list[float]:
    from tqdm import tqdm

    import socompile
    from socompile.data import ByteBatches, stdlib_corpus
    from socompile.models import WithLMLoss, build
    from socompile.report import plan_table

    torch.manual_seed(seed)
    model = build(preset)
    n_params = sum(p.numel() for p in model.parameters())
    opt = socompile.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    # The tiny model would fit on any device; pin one device-resident bucket so the demo shows both kinds:
    # CPU buckets stepped during backward, and a device bucket stepped after validation.
    backend = socompile.SuperOffload(compute=compute, bucket_size="1MB", gpu_buckets=1)
    # the loss is compiled with the model, so the plan counts its memory too (socompile.models.WithLMLoss)
    cmodel = torch.compile(WithLMLoss(model), backend=backend)
    data = ByteBatches(stdlib_corpus(), batch=batch, seq=seq, seed=seed)
    print(f"socompile demo: {preset} Llama, {n_params / 1e6:.2f}M parameters, batch {batch} x {seq} bytes of "
          f"Python stdlib source, compute compiled by {compute}, {torch.get_num_threads()} CPU threads")

    losses: list[float] = []
    tokens = 0
    bar = tqdm(range(steps), desc="train", unit="step", dynamic_ncols=True)
    start = None
    for step in bar:
        x, y = next(data)
        loss = cmodel(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0:  # the first step compiles; measure throughput from the second on
            start = time.perf_counter()
            ctx = backend.compiled[0]
            bar.write(plan_table(ctx.plan, len(ctx.ir.bw_order)))
        else:
            tokens += x.numel()
        if step % log_every == 0 or step == steps - 1:
            rate = tokens / (time.perf_counter() - start) if tokens else 0.0
            bar.set_postfix(loss=f"{sum(losses[-log_every:]) / len(losses[-log_every:]):.3f}",
                            tok_s=f"{rate:,.0f}")
    first, last = _mean(losses[:10]), _mean(losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f} (mean of first and last 10 steps); "
          f"{len(opt.events.events())} optimizer events recorded")
    return losses


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
