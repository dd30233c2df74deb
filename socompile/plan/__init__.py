"""Planning: decide, per bucket of parameters, where state lives and when work runs."""
from ..hardware import PROFILES, HardwareProfile, get_profile
from .plan import BucketPlan, Plan
from .planner import plan

__all__ = ["PROFILES", "BucketPlan", "HardwareProfile", "Plan", "get_profile", "plan"]
