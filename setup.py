"""The one compiled part: the pair program's label search (umopt/solvers/_pair_program.cpp).

Optional: where it does not build (no C++ compiler), umopt installs without it and runs the same
program in Python, slower (umopt.solvers.pair_program.COMPILED says which runs).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension("umopt.solvers._pair_program", ["umopt/solvers/_pair_program.cpp"], cxx_std=17, extra_compile_args=["-O2"], optional=True)
    ]
)
