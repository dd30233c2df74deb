"""The machine a plan is made for: shipped and user hardware profiles (profiles.py), this machine measured
(calibrate.py), and a ``target`` option resolved to a profile (targets.py)."""
from .profiles import GB, PROFILES, THIS_MACHINE, HardwareProfile, load_profile, save_profile
from .targets import get_profile

__all__ = ["GB", "PROFILES", "THIS_MACHINE", "HardwareProfile", "get_profile", "load_profile", "save_profile"]
