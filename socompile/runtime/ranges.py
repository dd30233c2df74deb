"""Named ranges of the runtime's work in a user's ``torch.profiler`` trace.

Each piece of work the runtime does outside the compiled kernels (gradient copies, bucket steps, validation,
weight uploads and prefetches, activation offload copies) runs inside ``record_function(NAME)``, so it shows as
a named range beside the model's own ops in ``prof.events()``, ``prof.key_averages()`` and the exported trace.
The bucket (when there is one) is the range's argument.

NOTE: threads. torch.profiler records the threads it was started on (and those torch itself hands its state
to). The CPU build steps buckets inline, on the training thread, so its ranges always appear; the worker
thread (CUDA, ``cpu_worker="thread"``) and the stream threads of the CPU build appear when the profiler records
every thread: ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``
(docs/runtime.md). Without a profiler running a range costs one flag check, not a record_function call.
"""
from __future__ import annotations

import contextlib
import functools

import torch

GRAD_COPY = "socompile::grad_copy"
BUCKET_STEP = "socompile::bucket_step"
VALIDATE = "socompile::validate"
UPLOAD = "socompile::upload"
PREFETCH = "socompile::prefetch"
PREFETCH_COPY = "socompile::prefetch_copy"
ACTIVATION_OFFLOAD = "socompile::activation_offload"
ACTIVATION_FETCH = "socompile::activation_fetch"
NAMES = (GRAD_COPY, BUCKET_STEP, VALIDATE, UPLOAD, PREFETCH, PREFETCH_COPY, ACTIVATION_OFFLOAD, ACTIVATION_FETCH)


def named(name: str, bucket: int | None = None):
    """A context manager marking its body as range ``name`` (bucket ``bucket``) while a profiler runs."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name, None if bucket is None else f"bucket {bucket}")


def ranged(name: str, bucket_of=None):
    """Decorator: every call of the function is range ``name``; ``bucket_of(*args)`` names its bucket."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not torch.autograd.profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with named(name, bucket_of(*args) if bucket_of is not None else None):
                return fn(*args, **kwargs)
        return inner
    return wrap


def own_bucket(bucket, *_args) -> int:
    """``bucket_of`` of a method of a bucket, or of a function whose first argument is one."""
    return bucket.index
