#!/usr/bin/env bash
# One-GPU check of socompile, for a machine with torch 2.11+ (CUDA) and no network; expected 3-5 minutes,
# at most 10 (each stage under its own timeout: build 120 s, tests 240 s, step times 240 s).
#   bench/gpu_check.sh            (uses `python`; PY=/path/to/python to choose)
# 1. environment: torch >= 2.11 with a visible GPU; 2. builds the CPU Adam kernel from source (no downloads);
# 3. runs the CUDA tests (and the runtime tests whose CUDA logic is checked on the CPU), including offloaded
#    training on the GPU against the eager reference (tests/test_device_mirror.py -k cuda: fp32 and bf16 models,
#    stationary / flow / GPU-stepped buckets, clipping) and the host-memory and link-traffic ledgers against the
#    plan for every single-GPU plan shape (tests/test_host_memory.py -k cuda);
# 4. times a step of a 4-layer llama-1b (0.37B; the layer count keeps the three Inductor compiles short) without
#    offload (Inductor + fused AdamW on the GPU) and with socompile (bf16 weights, then fp32 weights under bf16
#    autocast; each with every bucket stepped on the CPU and with the planner's choice of GPU-stepped buckets,
#    each printing one step's per-bucket timeline), plus the runtime's copy stream (pinned h2d bandwidth and
#    overlap with compute).
# Run on an H200 (bench/results/gpu_check_h200_2026-12-04.md: the runs and what they found; docs/runtime.md, "On a GPU"). Exit 1 when any assertion of
# bench/gpu_step.py fails (copy time hidden under compute, equality with eager, the loss falls, device peak
# within 10% of the plan), or a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
START=$SECONDS
STATUS=0
section() { echo; echo "== $1 (t=$((SECONDS - START)) s)"; }

section "environment"
if ! $PY - <<'PYEOF'
import sys
import torch
major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if (major, minor) < (2, 11):
    sys.exit(f"torch {torch.__version__} is older than 2.11")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU is visible to torch")
p = torch.cuda.get_device_properties(0)
print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible")
PYEOF
then
    echo "environment check failed"; exit 1
fi

section "build the CPU Adam kernel (socompile_ext) from source"
# --no-build-isolation --no-deps: use the image's setuptools/Cython/compiler, download nothing.
if ! timeout 120 $PY -m pip install -q --no-build-isolation --no-deps -e . ; then
    echo "pip install -e . failed; building in place instead"
    timeout 120 $PY setup.py build_ext --inplace || { echo "extension build failed"; exit 1; }
fi
$PY -c "import socompile_ext, socompile; print('socompile_ext built:', socompile_ext.__file__)" || exit 1
$PY -m socompile doctor || true

section "CUDA tests"
if $PY -c "import pytest" 2>/dev/null; then
    timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_runtime_cuda.py tests/test_runtime_device.py \
        tests/test_runtime_device_adam.py "tests/test_device_mirror.py" tests/test_host_memory.py \
        -k "cuda or not (test_device_mirror or test_host_memory)" \
        || STATUS=1
else
    echo "pytest is not installed in this environment (no network to install it): CUDA tests skipped"
    STATUS=1
fi

section "step time, llama-1b with 4 layers, one GPU"
# GPU_STEP_TARGET: the profile the plans are made for and simulated on (e.g. a file from `socompile calibrate`
# on this machine, for simulated vs measured step times); default gh200.
timeout 240 $PY bench/gpu_step.py --preset llama-1b --layers 4 --batch 2 --seq 1024 --steps 6 --warmup 2 \
    --offload-dtype both --target "${GPU_STEP_TARGET:-gh200}" || STATUS=1

section "done in $((SECONDS - START)) s, status $STATUS"
exit $STATUS
