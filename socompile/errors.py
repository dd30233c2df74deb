"""Errors that name their cause and fix, and the checks the backend runs on what Dynamo hands it.

Each failure mode socompile knows is listed in docs/errors.md with the test that triggers it. Exception
classes live next to their callers; the ones a user meets:

    OffloadError  (here) the backend cannot compile this model as asked: graph break with
                  on_graph_break="error", no parameters, CUDA graphs mode
    OptionError   (options.py) an option is unknown, of the wrong type or out of range
    PlanError     (plan/planner.py) no plan fits: memory budget, pinned gpu_buckets

The checks read what Dynamo attaches to the graph it passes to a backend (``gm.compile_subgraph_reason``,
``gm.meta["dynamo_compile_id"]``); on a torch that lacks them they find nothing and stay silent.
"""
from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("socompile")

RESUME_PREFIX = "torch_dynamo_resume_in_"   # Dynamo's name for the function that continues after a break


class OffloadError(RuntimeError):
    """The superoffload backend cannot compile this model as asked; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo split the compiled region, and why (first line of Dynamo's reason)."""

    filename: str
    lineno: int
    function: str
    line: str
    reason: str

    def where(self) -> str:
        text = f"{self.filename}:{self.lineno} in {self.function}"
        return text + (f"\n    {self.line}" if self.line else "")


def graph_break_of(gm) -> GraphBreak | None:
    """The graph break that ended this graph, or None when the graph ends at the function's return."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = list(getattr(reason, "user_stack", None) or [])
    frame = stack[-1] if stack else None
    first = str(getattr(reason, "reason", "")).strip().splitlines()
    return GraphBreak(filename=getattr(frame, "filename", "?"), lineno=getattr(frame, "lineno", 0) or 0,
                      function=getattr(frame, "name", "?"), line=(getattr(frame, "line", "") or "").strip(),
                      reason=first[0] if first else "unknown reason")


def is_resumed_piece(gm) -> bool:
    """True for the graph Dynamo compiled for the code *after* a graph break."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = list(getattr(reason, "user_stack", None) or [])
    return bool(stack) and str(getattr(stack[0], "name", "")).startswith(RESUME_PREFIX)


def graph_break_message(brk: GraphBreak) -> str:
    return (f"superoffload: graph break inside the compiled region at {brk.where()}\n"
            f"  Dynamo's reason: {brk.reason}\n"
            "  The model is compiled as several graphs, each planned on its own: buckets cannot span the "
            "break, and a parameter used on both sides of it cannot be stepped from one backward graph. "
            "Remove the break (compile with fullgraph=True to get Dynamo's full explanation), or set "
            "options={'on_graph_break': 'ignore'} if the split is intended.")


def compile_count(gm) -> tuple[int | None, int]:
    """(frame id, how many times this frame was compiled before this graph) from Dynamo's compile id."""
    cid = None
    meta = getattr(gm, "meta", None)
    if isinstance(meta, dict):
        cid = meta.get("dynamo_compile_id")
    if cid is None:
        try:
            import torch._guards
            cid = torch._guards.CompileContext.current_compile_id()
        except Exception:  # noqa: BLE001  (private API; absent means "cannot tell")
            cid = None
    frame = getattr(cid, "frame_id", None)
    count = getattr(cid, "frame_compile_id", None)
    return frame, int(count or 0)


def recompile_message(count: int) -> str:
    return (f"superoffload: this code was compiled {count + 1} times (recompile storm). Every recompile "
            "captures, plans and rewrites the graph again; usually the input shapes change from step to step "
            "while the compile is static. Compile with torch.compile(..., dynamic=True), or mark the varying "
            "dimension with torch._dynamo.mark_dynamic(x, dim), or pad inputs to a few fixed lengths. "
            "TORCH_LOGS=recompiles prints the guard that failed each time.")


def unowned_parameters_message(count: int, total: int, shown: str) -> str:
    text = f"socompile: {count} of {total} parameter(s) have no socompile optimizer and keep ordinary .grad ({shown})"
    if count == total:
        text += (". If you made a socompile.AdamW for this model, it holds other Parameter objects: the "
                 "module was copied (copy.deepcopy), re-created or replaced after the optimizer was built, "
                 "so that optimizer will never see a gradient. Build the optimizer from the parameters of "
                 "the module you compile. Under the Hugging Face Trainer (whose own optimizer is torch's), "
                 "use socompile.hf.Trainer: it builds socompile.AdamW from TrainingArguments and compiles the "
                 "model with this backend.")
    return text
