"""docs/options.md is generated from the Options dataclass and must be up to date."""
import dataclasses
import os
import subprocess
import sys

from socompile.options import Options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_options_doc_is_up_to_date():
    out = subprocess.run([sys.executable, "docs/gen_options.py", "--check"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr + "\nrun: python docs/gen_options.py"


def test_every_option_has_a_docstring():
    sys.path.insert(0, os.path.join(REPO, "docs"))
    try:
        from gen_options import field_docs
    finally:
        sys.path.pop(0)
    documented = field_docs(Options)
    assert [f.name for f in dataclasses.fields(Options) if f.name not in documented] == []
