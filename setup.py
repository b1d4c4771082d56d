"""The compiled parts: the pair program's label search (umopt/solvers/_pair_program.cpp), the
population evaluators the GA scores with (umopt/_evaluate.cpp) and the fast bound's one-stage
programs (umopt/solvers/_stage_programs.cpp).

Optional: where they do not build (no C++ compiler), umopt installs without them and runs the
same code in Python, slower (umopt.solvers.pair_program.COMPILED, umopt.vectorized.COMPILED and
umopt.solvers.bounds.COMPILED say which runs).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension("umopt.solvers._pair_program", ["umopt/solvers/_pair_program.cpp"], cxx_std=17, extra_compile_args=["-O2"], optional=True),
        Pybind11Extension("umopt._evaluate", ["umopt/_evaluate.cpp"], cxx_std=17, extra_compile_args=["-O2"], optional=True),
        Pybind11Extension("umopt.solvers._stage_programs", ["umopt/solvers/_stage_programs.cpp"], cxx_std=17, extra_compile_args=["-O2"], optional=True),
    ]
)
