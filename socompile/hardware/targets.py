"""Resolve a ``target`` option to a hardware profile: a shipped name, ``this-machine`` or a profile file.

``this-machine`` is read from the profile cache; measuring it (socompile/calibrate.py) needs the runtime, an upper
layer, so a compile that finds no cache measures first (``socompile.calibrate.profile_for_target``).
"""
from __future__ import annotations

import os

from .profiles import PROFILES, THIS_MACHINE, HardwareProfile, load_profile, profile_cache_path


def get_profile(name: str) -> HardwareProfile:
    """A shipped profile by name, ``this-machine`` (measured once, then cached), or a profile file path."""
    if name in PROFILES:
        return PROFILES[name]
    if name == THIS_MACHINE:
        cached = profile_cache_path()
        if not cached.exists():
            raise ValueError(f"target {THIS_MACHINE!r}: no measured profile of this machine at {cached}; measure it "
                             f"with `python -m socompile calibrate` (a compile measures it itself when uncached)")
        return load_profile(cached)
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
