"""Resolve a ``target`` option to a hardware profile: a shipped name, ``this-machine`` or a profile file.

Separate from profiles.py because ``this-machine`` measures the machine (calibrate.py), and calibrate.py builds
its profile from profiles.py: with get_profile beside the profiles the two modules imported each other.
"""
from __future__ import annotations

import os

from .profiles import PROFILES, THIS_MACHINE, HardwareProfile, load_profile, profile_cache_path, save_profile


def get_profile(name: str) -> HardwareProfile:
    """A shipped profile by name, ``this-machine`` (measured once, then cached), or a profile file path."""
    if name in PROFILES:
        return PROFILES[name]
    if name == THIS_MACHINE:
        cached = profile_cache_path()
        if cached.exists():
            return load_profile(cached)
        from .calibrate import calibrate
        profile = calibrate(quick=True)
        save_profile(profile, cached)
        return profile
    if name.endswith((".json", ".toml")) or os.sep in name:
        if not os.path.exists(name):
            raise ValueError(f"hardware profile file {name!r} does not exist")
        return load_profile(name)
    import difflib
    known = [*PROFILES, THIS_MACHINE]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown target {name!r}{hint}; known targets: {', '.join(known)}, or a .json/.toml "
                     f"profile file")
