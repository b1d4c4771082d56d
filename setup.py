"""The compiled parts: the pair program's label search (umopt/bounds/_pair_program.cpp), the
population evaluators the GA scores with (umopt/_population_sim.cpp) and the fast bound's one-stage
programs (umopt/bounds/_stage_programs.cpp).

Optional: where they do not build (no C++ compiler), umopt installs without them and runs the
same code in Python, slower (umopt.bounds.pair_program.COMPILED, umopt.population_sim.COMPILED and
umopt.bounds.heads.COMPILED say which runs).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "umopt.bounds._pair_program",
            ["umopt/bounds/_pair_program.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Pybind11Extension(
            "umopt._population_sim",
            ["umopt/_population_sim.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Pybind11Extension(
            "umopt.bounds._stage_programs",
            ["umopt/bounds/_stage_programs.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
