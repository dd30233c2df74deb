"""No undefined names in the shipped Python (package, benches, examples): pyflakes finds them without running
the code, which matters for benches and examples that no default test runs end to end."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_undefined_names_in_the_package_benches_and_examples():
    api = pytest.importorskip("pyflakes.api")
    messages = pytest.importorskip("pyflakes.messages")
    from pyflakes.reporter import Reporter

    class Collect(Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.undefined = []

        def flake(self, message):
            if isinstance(message, messages.UndefinedName):
                self.undefined.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.undefined.append(f"{filename}:{lineno}: syntax error {msg}")

        def unexpectedError(self, filename, msg):
            self.undefined.append(f"{filename}: {msg}")

    report = Collect()
    for folder in ("socompile", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            api.checkPath(str(path), report)
    assert report.undefined == []
