"""Failing clearly instead of hanging: collective errors that name the cause, and a check, at compile time,
that every rank made the same plan.

A peer that died closes its sockets, so gloo raises at once ("Connection closed by peer"); a peer that hangs
makes gloo raise when the group's timeout passes ("Timed out waiting ...ms"). NCCL behaves alike with its
watchdog. ``guard`` turns either into a ``CollectiveError`` that says which collective, on which rank, and
what to look at; the process then exits non-zero instead of waiting forever.

Plans must agree across ranks: a rank that buckets differently reduce-scatters different tensors, and the job
computes garbage or deadlocks much later. ``check_plan_across_ranks`` gathers a small fingerprint of every
rank's options and plan (one hash per field) and names the fields that differ; ``shard_optimizer`` checks the
optimizers' bucket layouts the same way before its first collective.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or disagreed about what to exchange."""


class PlanMismatchError(CollectiveError):
    """Ranks compiled different plans (different options or models); the message lists the fields."""


@contextlib.contextmanager
def guard(what: str, group=None, timeout_s: float | None = None):
    """Run a collective; on failure raise CollectiveError naming it, this rank and the likely cause.

    The collective runs with torch's Python dispatcher turned off. NOTE: inside a compile (AOTAutograd's
    partitioner, where the backend lays out buckets and the re-layout all-gathers and the plan check talk to
    the other ranks) the Python dispatcher is on, and it calls a c10d op's kernel while holding the GIL. The
    kernel then locks gloo's work queue, while a gloo worker thread holds that lock and waits for the GIL to
    free the previous collective's tensors: a deadlock on that rank. The other rank waits for it in the
    collective until the timeout. This hung resume-then-compile runs about one time in three (timing
    decides). Every socompile collective goes through this guard, so none runs under the Python dispatcher."""
    from torch._dispatch.python import no_python_dispatcher

    start = time.monotonic()
    try:
        with no_python_dispatcher():
            yield
    except CollectiveError:
        raise
    except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError (a RuntimeError subclass)
        waited = time.monotonic() - start
        text = str(exc)
        if "Timed out" in text or "timeout" in text.lower():
            cause = "a peer rank is hung or too slow (no answer within the timeout)"
        elif "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
            cause = "a peer rank died (its connection closed)"
        else:
            cause = "the collective failed"
        rank = dist.get_rank() if dist.is_initialized() else -1
        limit = f"; timeout {timeout_s:g}s" if timeout_s else ""
        raise CollectiveError(
            f"socompile.distributed: {what} failed on rank {rank} after {waited:.1f}s{limit}: {cause}. "
            f"Check the other ranks' logs for the first error. Backend said: {text.splitlines()[0][:300]}"
        ) from exc


def fingerprint(plan: Any, options: Any = None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Field name -> short hash, for the plan's top-level fields, each bucket, and each option."""
    fields: dict[str, Any] = {}
    plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    for key, value in plan_dict.items():
        if key == "buckets":
            fields["plan.buckets.count"] = len(value)
            for b in value:
                fields[f"plan.buckets[{b['index']}]"] = b
        else:
            fields[f"plan.{key}"] = value
    if options is not None:
        opt_dict = options.to_dict() if hasattr(options, "to_dict") else dict(options)
        for key, value in opt_dict.items():
            fields[f"options.{key}"] = value
    for key, value in (extra or {}).items():
        fields[key] = value
    return field_hashes(fields)


def field_hashes(fields: Mapping[str, Any]) -> dict[str, str]:
    """Field name -> short hash of its value (JSON, keys sorted), names sorted."""
    return {k: _hash(v) for k, v in sorted(fields.items())}


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_hash(fp: Mapping[str, str]) -> str:
    return _hash(dict(fp))


def check_plan_across_ranks(plan: Any, options: Any = None, group=None, extra: Mapping[str, Any] | None = None,
                            values: Mapping[str, Any] | None = None) -> str:
    """Compare this rank's plan and options with every other rank's; return the common hash or raise
    PlanMismatchError listing the fields that differ (with the values, for options and small fields).

    Call it on every rank at the same point (it is a collective). ``values`` may give human-readable
    values for fields (defaults to options and scalar plan fields)."""
    fp = fingerprint(plan, options, extra)
    readable = dict(values or {})
    if options is not None and not values:
        opt_dict = options.to_dict() if hasattr(options, "to_dict") else dict(options)
        readable.update({f"options.{k}": v for k, v in opt_dict.items()})
        plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
        readable.update({f"plan.{k}": v for k, v in plan_dict.items() if isinstance(v, (int, float, str))})
        readable["plan.buckets.count"] = len(plan_dict.get("buckets", ()))
    return agree_across_ranks("plan check", fp, readable, group,
                              "ranks compiled different plans (different options, model or input shapes?). Every "
                              "rank must run the same model with the same options.")


def agree_across_ranks(what: str, fields: Mapping[str, str], readable: Mapping[str, Any], group,
                       headline: str) -> str:
    """Check that every rank has the same ``fields`` (name -> short hash); return their common hash, or raise
    PlanMismatchError on every rank: ``headline``, then per rank the fields that differ from rank 0, with
    their ``readable`` values where given.

    First a fixed-size collective (each rank's 60-bit hash, all-gathered as int64), so ranks that disagree about
    sizes cannot make it fail (gloo aborts a collective whose ranks pass different sizes); only on a mismatch,
    which every rank then knows, are the fields themselves gathered (all_gather_object exchanges sizes first)."""
    digest = plan_hash(fields)
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend(group) == "nccl" else "cpu"   # NCCL: GPU only
    hashes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=device)
    with guard(f"{what} (all_gather of the hashes)", group):
        dist.all_gather_into_tensor(hashes, mine, group=group)
    if len(set(hashes.tolist())) == 1:
        return digest
    details = {"hash": digest, "fields": dict(fields), "values": {k: repr(v)[:80] for k, v in readable.items()}}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with guard(f"{what} (all_gather_object of the differing fields)", group):
        dist.all_gather_object(gathered, details, group=group)
    raise PlanMismatchError(f"socompile.distributed: {headline}\n  " + "\n  ".join(_differences(gathered)))


def _differences(gathered: list[dict]) -> list[str]:
    """One line per rank whose fields differ from rank 0's, naming up to 12 fields with both values."""
    lines = []
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        if other["hash"] == reference["hash"]:
            continue
        keys = sorted(set(reference["fields"]) | set(other["fields"]))
        differ = [k for k in keys if reference["fields"].get(k) != other["fields"].get(k)]
        shown = []
        for k in differ[:12]:
            a, b = reference["values"].get(k), other["values"].get(k)
            shown.append(f"{k} (rank 0: {a}, rank {rank}: {b})" if a is not None or b is not None else k)
        more = f" and {len(differ) - 12} more" if len(differ) > 12 else ""
        lines.append(f"rank {rank} differs from rank 0 in: {', '.join(shown)}{more}")
    return lines
