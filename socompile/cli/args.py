"""Argument checks shared by the ``python -m socompile`` commands: bad input ends as one line on stderr that
names the cause and the fix, never as a traceback.

Range checks are argparse types (argparse prints the usage and the error, exit 2); output paths are checked
before any work is done, so a long plan or compile is not lost to an unwritable ``--out`` at the end.
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile


class CommandError(Exception):
    """A command cannot run as asked; ``str()`` is the one line to print, ``exit_code`` the status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (batch, sequence length, steps, degrees)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (counts that may be zero, e.g. --gpu-buckets)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def writable_folder(path: str, flag: str) -> pathlib.Path:
    """Create ``path`` (a folder) if needed and check, by writing a probe file, that files can be written into
    it (permission bits do not tell: root passes them on read-only file systems and /proc)."""
    folder = pathlib.Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise CommandError(f"{flag} {path}: cannot write files into this folder ({err.strerror or err}); "
                           f"pass a folder you can write to, e.g. {flag} ./dumps") from None
    return folder


def writable_file(path: str | None, flag: str) -> str | None:
    """Check that ``path`` (a file to write later; None: not asked for) can be written, by opening it for
    appending (a file that did not exist is removed again)."""
    if path is None:
        return None
    target = pathlib.Path(path)
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as err:
        raise CommandError(f"{flag} {path}: cannot write this file ({err.strerror or err}); "
                           f"pass a path you can write to, e.g. {flag} ./{target.name or 'out'}") from None
    if not existed:
        target.unlink()
    return path
