"""Build socompile_ext, the CPU optimizer kernels (C + Cython, OpenMP).

One extension module; every ISA's kernel is a separate C file in
socompile_ext/csrc/ that enables its own instructions with `#pragma GCC target`, so the whole build uses
the target's baseline flags (no -march): the wheel runs on any x86-64 / AArch64 CPU and picks the best
path at run time (socompile_ext/csrc/adam_dispatch.c). torch is not needed to build.
"""
import platform

from Cython.Build import cythonize
from setuptools import Extension, setup

# -fno-math-errno: without it gcc keeps a scalar sqrt call for errno and the loops do not vectorise
#   (measured ~4x slower).
# -ffp-contract=off: no fused multiply-add contraction, so every ISA path (and the scalar reference)
#   performs the same roundings and gives bitwise-identical results (see csrc/adam_internal.h).
# -O3 for the vector loops; -fopenmp for the per-thread contiguous ranges; gnu11 for getauxval & co.
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11"]

CSRC = "socompile_ext/csrc/"
SOURCES = ["socompile_ext/_adam.pyx"] + [
    CSRC + name
    for name in ("adam_dispatch.c", "adam_scalar.c", "adam_avx2.c", "adam_avx512.c", "adam_neon.c", "adam_sve.c")
]

extensions = [
    Extension(
        "socompile_ext._adam",
        sources=SOURCES,
        include_dirs=["socompile_ext/csrc"],
        extra_compile_args=COMMON_FLAGS,
        extra_link_args=["-fopenmp"],
        # reported by socompile_ext.build_info() and the doctor
        define_macros=[("SOCX_BUILD_FLAGS", '"%s (%s)"' % (" ".join(COMMON_FLAGS), platform.machine()))],
    )
]

setup(ext_modules=cythonize(extensions, language_level=3))
