# Two commands do all the set-up: `make demo` and `make test`. Both create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.socompile-installed
# torch==2.13.0 is the local CPU wheel on our machines; any other spec downloads a multi-GB CUDA build.
# A venv that already has torch (a user's own CUDA build, 2.11+) keeps it.
TORCH_SPEC ?= torch==2.13.0
EXT_SOURCES := $(wildcard socompile_ext/*.pyx socompile_ext/*.pxd socompile_ext/csrc/*.c socompile_ext/csrc/*.h)

.PHONY: demo test test-slow bench venv clean

venv: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements-dev.txt $(EXT_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	$(PY) -m socompile demo

# Test processes (pytest-xdist); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf build socompile_ext/*.so socompile_ext/_*.c *.egg-info
