"""Train the tiny Llama preset on several processes: ZeRO-style data parallelism and/or Ulysses sequence
parallelism, over gloo on a CPU (NCCL on GPUs).

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/dist_train.py --dp 2   # each rank: half the batch
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/dist_train.py --sp 2   # each rank: half of each sequence

Every rank reads the same global batch from the same seed and keeps its part of it (rows for dp, a slice of
the sequence for sp), so the run trains on exactly the batches one process would, and prints the global loss.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import socompile
import socompile.distributed as sd
from socompile.data import ByteBatches, stdlib_corpus
from socompile.models import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world size / sp)")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (Ulysses)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (whole, before the sp split)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for a peer")
    ap.add_argument("--compile", action="store_true", help="torch.compile with the superoffload backend")
    args = ap.parse_args()

    torch.set_num_threads(1)   # two ranks on two cores: one thread each avoids oversubscription
    topo = sd.init_distributed(dp=args.dp, sp=args.sp, timeout_s=args.timeout)
    if args.batch % topo.dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by dp={topo.dp}")
    torch.manual_seed(0)
    model = sd.parallelize(build("tiny"), topo.sp_group)
    opt = socompile.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                          max_grad_norm=1.0, bucket_size="256KB")
    sharding = sd.shard_optimizer(opt, topo.world_group)   # over dp x sp: every rank saw different tokens
    run = model
    if args.compile:
        run = torch.compile(model, backend="superoffload",
                            options={"compute": "eager", "gpu_buckets": 0, "bucket_size": "256KB"})
    if topo.rank == 0:
        print(f"{topo.world_size} ranks: dp={topo.dp} x sp={topo.sp}, {sum(p.numel() for p in model.parameters())} "
              f"parameters, global batch {args.batch} x {args.seq} tokens", flush=True)
    print(topo.describe(), flush=True)

    data = ByteBatches(stdlib_corpus(2_000_000), args.batch, args.seq, seed=0)
    rows = args.batch // topo.dp
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        x, y = (t[topo.dp_rank * rows:(topo.dp_rank + 1) * rows] for t in (x, y))
        x, y = sd.shard_sequence(x, topo.sp_group), sd.shard_sequence(y, topo.sp_group)
        with sd.guard(f"training step {step}", timeout_s=args.timeout):
            loss = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            reported = loss.detach().clone()
            dist.all_reduce(reported, group=topo.world_group)   # equal shards: the mean of means is the mean
        if topo.rank == 0 and (step % 10 == 0 or step == 1):
            tokens = step * args.batch * args.seq
            print(f"step {step:4d}  loss {reported.item() / topo.world_size:.4f}  grad-norm {opt.last_grad_norm:.3f}  "
                  f"{tokens / (time.perf_counter() - start):,.0f} tok/s", flush=True)
    if topo.rank == 0:
        c = sharding.stats
        print(f"communicated per step per rank (ring estimate): {c.sent_bytes / max(c.steps, 1) / 1e6:.2f} MB "
              f"(reduce-scatter + all-gather of the optimizer's buckets; Ulysses all-to-all not counted)")
    sd.shutdown()


if __name__ == "__main__":
    main()
