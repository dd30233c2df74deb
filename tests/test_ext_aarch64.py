"""The Arm paths of the CPU Adam kernel (NEON, SVE), checked on an x86 machine.

The kernel sources are cross-compiled for aarch64 together with a C harness
(socompile_ext/csrc/tests/adam_harness.c) and run under qemu-aarch64: with SVE at several vector lengths
and with SVE off (NEON). The harness compares every path against the scalar path bit for bit (p, m, v, the
bf16 copy; sums of squares to 1e-12 relative for SVE, whose lane count follows the vector length) and
1 vs 3 threads. Needs gcc-aarch64-linux-gnu and qemu-user: installed with apt-get when missing and we are
root (about a minute); skipped, saying why, only when they cannot be installed.
"""
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "socompile_ext" / "csrc"
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
KERNEL_SOURCES = ["adam_dispatch.c", "adam_scalar.c", "adam_neon.c", "adam_sve.c"]
# the flags setup.py uses (-ffp-contract=off is what makes every path bitwise equal)
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11"]


def _install_tools():
    """Make the cross compiler and qemu available, or return the reason they are not."""
    if shutil.which(CC) and shutil.which(QEMU):
        return None
    if platform.machine() == "aarch64":
        return "running on aarch64: the native build and tests/test_ext_adam.py cover these paths"
    if not shutil.which("apt-get"):
        return f"{CC} / {QEMU} missing and no apt-get to install them (Debian: gcc-aarch64-linux-gnu qemu-user)"
    if os.geteuid() != 0:
        return f"{CC} / {QEMU} missing and not root; run: apt-get install gcc-aarch64-linux-gnu qemu-user"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=240).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=120)
            out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=240)
            if out.returncode != 0:
                return f"apt-get install failed: {out.stderr.strip()[-300:]}"
    except (subprocess.TimeoutExpired, OSError) as e:
        return f"apt-get install did not finish: {e}"
    if not (shutil.which(CC) and shutil.which(QEMU)):
        return f"{CC} / {QEMU} still missing after apt-get install"
    return None


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    reason = _install_tools()
    if reason:
        pytest.skip(reason)
    exe = tmp_path_factory.mktemp("aarch64") / "adam_harness"
    cmd = [CC, *FLAGS, "-static", "-Wall", f"-I{CSRC}", str(CSRC / "tests" / "adam_harness.c"),
           *[str(CSRC / s) for s in KERNEL_SOURCES], "-lm", "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    # libgomp.a warns about dlopen in static binaries; anything else from our sources is a failure
    warnings = [line for line in out.stderr.splitlines() if "warning" in line and "socompile_ext" in line]
    assert out.returncode == 0, out.stderr
    assert not warnings, "\n".join(warnings)
    return exe


@pytest.mark.parametrize("cpu, expect_paths, vector_bits", [
    # qemu-user's default SVE length, 64 bytes: -m slow (the default suite has the narrowest and the widest)
    pytest.param("max", "neon sve", 512, marks=pytest.mark.slow),
    ("max,sve-max-vq=1", "neon sve", 128),                  # Neoverse V2 / Grace width
    ("max,sve-default-vector-length=256", "neon sve", 2048),  # the architectural maximum
    ("max,sve=off", "neon", None),                          # NEON-only CPUs (e.g. Graviton2, Ampere Altra)
])
def test_arm_paths_match_the_scalar_reference_under_qemu(harness, cpu, expect_paths, vector_bits):
    out = subprocess.run([QEMU, "-cpu", cpu, str(harness)], capture_output=True, text=True, timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-3000:]
    assert f"usable paths: {expect_paths} (best: {expect_paths.split()[-1]})" in report, report
    if vector_bits:
        assert f"sve vector length: {vector_bits} bits" in report, report
    assert " 0 failures" in report and "FAIL" not in report
