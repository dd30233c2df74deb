"""Reports: plan tables (text, JSON) and graph dumps."""
from .dump import graph_to_dot, write_dumps
from .html import plan_html, timeline_svg
from .table import human_bytes, human_formula, plan_json, plan_table

__all__ = ["graph_to_dot", "human_bytes", "human_formula", "plan_html", "plan_json", "plan_table", "timeline_svg",
           "write_dumps"]
