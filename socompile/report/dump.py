"""Graph dumps: the forward/backward graphs before and after every pass, as readable FX code and as DOT
(and SVG where Graphviz's ``dot`` is installed)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

from torch import fx

from .table import plan_json, plan_table


def graph_to_dot(gm: fx.GraphModule, title: str) -> str:
    """DOT text of an FX graph; nodes inserted by socompile passes are highlighted."""
    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"digraph {quote(title)} {{", "  rankdir=TB; node [shape=box, fontsize=10, fontname=monospace];"]
    for node in gm.graph.nodes:
        label = node.name if node.op in ("placeholder", "output") else f"{node.name}\\n{node.target}"
        style = ', style=filled, fillcolor="#ffd480"' if "socompile" in node.meta else ""
        lines.append(f"  {quote(node.name)} [label={quote(label)}{style}];")
        for inp in node.all_input_nodes:
            lines.append(f"  {quote(inp.name)} -> {quote(node.name)};")
    lines.append("}")
    return "\n".join(lines)


def write_dumps(ctx, out_dir: str | pathlib.Path, index: int = 0) -> list[pathlib.Path]:
    """Write every recorded before/after pair of ``ctx`` (a CompileContext) and its plan into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    prefix = f"graph{index}"
    if ctx.forward_graph is not None:
        written.append(_write(out / f"{prefix}_fw_captured.py", ctx.forward_graph.code))
    for number, dump in enumerate(ctx.dumps):
        stem = f"{prefix}_{dump.phase}_{number:02d}_{dump.pass_name}"
        written.append(_write(out / f"{stem}_before.py", dump.before))
        written.append(_write(out / f"{stem}_after.py", dump.after))
        if dump.graph_module is not None:
            dot = out / f"{stem}_after.dot"
            written.append(_write(dot, graph_to_dot(dump.graph_module, f"{stem}_after")))
            if shutil.which("dot"):
                svg = dot.with_suffix(".svg")
                subprocess.run(["dot", "-Tsvg", str(dot), "-o", str(svg)], check=False, timeout=120)
                if svg.exists():
                    written.append(svg)
    if ctx.plan is not None:
        written.append(_write(out / f"{prefix}_plan.txt", plan_table(ctx.plan)))
        written.append(_write(out / f"{prefix}_plan.json", plan_json(ctx.plan)))
    return written


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path
