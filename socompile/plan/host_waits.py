"""Where the training thread waits for the CPU optimizer's jobs in a step: the rule the runtime applies
(``socompile.AdamW`` decides with ``step_returns_before``) and the counts the plan predicts from the same rule.

Each CPU-stepped bucket's step runs as a job on the CPU worker (the CUDA runtime and the emulated device; the
CPU build steps inline, between backward nodes, and has no job to wait for). The training thread waits for each
job once per step, at one of two sites (``opt.host_blocks()`` keys, thread "training", kind "CPU worker job"):

    step: the buckets it settles          ``opt.step()`` waits before it returns: validation needs every
                                          bucket's norm partial, ZeRO all-gathers after the step, or nothing
                                          else will wait for the bucket (no compiled graph reads it first)
    forward: the bucket's first read      ``opt.step()`` returned before the job ended (a final step with
                                          nothing to validate, taken into the ping-pong spare and swapped in by
                                          the job), and the next forward waits for that bucket alone, right
                                          before it first reads it (``socompile::wait_upload``) or fetches it
                                          (a flowing bucket's ``socompile::prefetch``)
"""
from __future__ import annotations

SETTLED = "step: the buckets it settles"
FIRST_READ = "forward: the bucket's first read"


def step_returns_before(*, validating: bool, sharded: bool, mirror: bool, graph_waits: bool,
                        pingpong: bool) -> bool:
    """Whether ``opt.step()`` may return before a bucket's CPU job ends: nothing to validate, no ZeRO
    all-gather after the step, a separate host master (``mirror``: the job uploads or the fetch reads the
    master it wrote), a compiled graph that waits for the bucket before its first read (``graph_waits``), and a
    ping-pong step (final as the job runs: the job swaps the spare in)."""
    return not validating and not sharded and mirror and graph_waits and pingpong


def per_step_job_waits(plan, ir, *, validating: bool, sharded: bool, shared_master: bool,
                       host_is_device: bool) -> dict[str, int]:
    """{site: waits} of the training thread for CPU jobs in one step of ``plan`` (one per CPU-stepped bucket;
    none on the CPU build). A stationary bucket is waited for by the forward when the forward reads it
    (passes/wait_uploads.py puts its wait there), a flowing one by its fetch."""
    if host_is_device:
        return {}
    out: dict[str, int] = {}
    for b in plan.buckets:
        if b.optimizer_site != "cpu":
            continue
        graph_waits = b.weight_mode == "flow" or any(ir.fw_readers.get(p) for p in b.params)
        early = step_returns_before(validating=validating, sharded=sharded, mirror=not shared_master,
                                    graph_waits=graph_waits, pingpong=b.rollback == "exact")
        site = FIRST_READ if early else SETTLED
        out[site] = out.get(site, 0) + 1
    return out
