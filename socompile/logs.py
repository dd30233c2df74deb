"""socompile in PyTorch's logging and compile-time tooling.

- ``logging.getLogger("socompile")`` is registered with ``torch._logging`` under the name ``socompile``, so
  ``TORCH_LOGS=+socompile`` (debug) or ``TORCH_LOGS=socompile`` (info) and
  ``torch._logging.set_logs(modules={"socompile": logging.DEBUG})`` control it like torch's own logs.
- ``artifact(name, payload)`` emits a ``torch._logging.trace_structured`` artifact: with ``TORCH_TRACE=<dir>``
  it lands in the trace log, and ``tlparse`` lists it under the compile that made it (plan, graphs per pass).
- ``timed(phase)`` wraps a compile phase in ``torch._dynamo.utils.dynamo_timed``, so it shows in
  ``torch._dynamo.utils.compile_times()`` and in the chromium trace events of the compile.

All of it uses private torch APIs (present on torch 2.11 through 2.13); when one is missing the helper does
nothing rather than fail a compile.
"""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Callable

LOG_NAME = "socompile"
log = logging.getLogger(LOG_NAME)


def register_with_torch() -> None:
    """Make ``socompile`` a registered torch log name (idempotent; touches no other logger)."""
    try:
        from torch._logging._internal import log_registry, register_log
    except ImportError:
        return
    if not log_registry.is_log(LOG_NAME):
        register_log(LOG_NAME, LOG_NAME)


def artifact(name: str, payload: Callable[[], Any], encoding: str = "string") -> None:
    """Emit a structured-trace artifact named ``name``; ``payload`` is called only when tracing is on.
    ``encoding="json"``: the payload is JSON text, or a JSON-friendly object to serialise."""
    try:
        from torch._logging import trace_structured
    except ImportError:
        return

    def payload_fn():
        value = payload()
        if isinstance(value, str):
            return value
        return json.dumps(value, indent=1, sort_keys=True, default=str) if encoding == "json" else value

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=payload_fn)


def timed(phase: str):
    """Context manager timing one compile phase as ``socompile.<phase>`` in torch's compile-time metrics."""
    try:
        from torch._dynamo.utils import dynamo_timed
    except ImportError:
        return contextlib.nullcontext()
    try:
        return dynamo_timed(f"socompile.{phase}", log_pt2_compile_event=True)
    except TypeError:  # an older signature
        return dynamo_timed(f"socompile.{phase}")
