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
        return _calibrate_and_cache(cached)
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


def _calibrate_and_cache(path) -> HardwareProfile:
    """Measure this machine as ``python -m socompile calibrate --quick`` does and cache the profile at ``path``.

    A compile asks for the profile while AOTAutograd's fake mode (and functionalization) is active, where the
    measuring buffers would be fake tensors with no memory to time: the measurement runs with no mode active."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .calibrate import calibrate
    with _disable_current_modes():
        profile = calibrate(quick=True)
    save_profile(profile, path)
    return profile
