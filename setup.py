"""Build socompile_ext, the CPU optimizer kernels (C + Cython, OpenMP).

Owned by the kernel work (issue 3): the per-ISA sources and flags live here.
"""
from setuptools import Extension, setup
from Cython.Build import cythonize

# -fno-math-errno: without it gcc keeps a scalar sqrt call for errno and the Adam loop does not vectorise
# (measured ~4x slower). -O3 for the vector loops; OpenMP for the per-thread contiguous ranges.
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-std=c11"]

extensions = [
    Extension(
        "socompile_ext._adam",
        sources=["socompile_ext/_adam.pyx", "socompile_ext/csrc/adam_scalar.c"],
        include_dirs=["socompile_ext/csrc"],
        extra_compile_args=COMMON_FLAGS,
        extra_link_args=["-fopenmp"],
    )
]

setup(ext_modules=cythonize(extensions, language_level=3))
