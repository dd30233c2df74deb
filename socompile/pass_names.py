"""The names ``options={"disable_passes": [...]}`` accepts: every graph pass and compile hook, in table order.

A leaf module (it imports nothing), so options.py can check the names without importing the passes (which import
the planner, which imports the options). The pass table, socompile/passes/table.py, is the source of truth;
tests/test_pass_table.py checks that these names are its names, in its order.
"""
from __future__ import annotations

PASS_NAMES = (
    "insert_optimizer_steps",
    "weight_flow_forward",
    "weight_flow_backward",
    "wait_uploads",
    "cast_gradients",
    "activation_offload_forward",
    "activation_offload_backward",
)
HOOK_NAMES = ("check_plan_across_ranks",)
DISABLEABLE = PASS_NAMES + HOOK_NAMES
