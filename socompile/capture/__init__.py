"""Capture: from Dynamo/AOTAutograd graphs to the planner's IR."""
from .ir import IR, build_ir
from .params import ParamInfo, describe, find_parameters, source_to_name

__all__ = ["IR", "ParamInfo", "build_ir", "describe", "find_parameters", "source_to_name"]
