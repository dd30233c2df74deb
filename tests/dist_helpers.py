"""Shared steps of the distributed tests' rank workers (tests/test_dist_*.py, run by socompile.distributed.launch)."""
from __future__ import annotations

from typing import Callable


def save_midway(topo, directory: str, batches: list, save_at: int, build: Callable, train: Callable,
                snapshot: Callable) -> tuple:
    """The run a sharded checkpoint is taken from: ``build(0)`` a model and its socompile.AdamW, shard the optimizer
    over the world, ``train`` on ``batches[:save_at]``, save to ``directory`` (step ``save_at``), ``snapshot(opt)``
    of what was saved, then train on the rest. Returns (model, opt, the snapshot, the norms after the save)."""
    import socompile.distributed as sd
    model, opt = build(0)
    sd.shard_optimizer(opt, topo.world_group)
    train(model, opt, batches[:save_at], topo.rank, topo.world_size)
    sd.save(directory, model, opt, step=save_at)
    saved = snapshot(opt)
    norms = train(model, opt, batches[save_at:], topo.rank, topo.world_size)
    return model, opt, saved, norms


def assert_ranks_ok(results, tail: int = 3000) -> list:
    """Assert every rank exited 0; on failure show every rank's exit code and output tail, not only the first
    failing rank's: a rank that finds its peer dead fails too, and the peer's own error is the cause."""
    if all(r.returncode == 0 for r in results):
        return [r.result for r in results]
    report = "\n".join(f"--- rank {r.rank}: exit {r.returncode} after {r.seconds:.1f} s ---\n{r.output[-tail:]}"
                       for r in results)
    raise AssertionError(f"ranks failed:\n{report}")
