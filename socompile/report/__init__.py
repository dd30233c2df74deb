"""Reports: plan tables (text, JSON) and graph dumps."""
from .dump import graph_to_dot, write_dumps
from .table import human_bytes, plan_json, plan_table

__all__ = ["graph_to_dot", "human_bytes", "plan_json", "plan_table", "write_dumps"]
