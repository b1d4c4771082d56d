"""The compiled parts: the pair program's label search (umopt/search/bounds/_pair_program.cpp), the
population evaluators the GA scores with (umopt/schedules/_population_sim.cpp) and the fast bound's one-stage
programs (umopt/search/bounds/_stage_programs.cpp).

Optional: where they do not build (no C++ compiler), umopt installs without them and runs the
same code in Python, slower (umopt.search.bounds.pair_program.COMPILED, umopt.schedules.population_sim.COMPILED and
umopt.search.bounds.heads.COMPILED say which runs).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "umopt.search.bounds._pair_program",
            ["umopt/search/bounds/_pair_program.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Pybind11Extension(
            "umopt.schedules._population_sim",
            ["umopt/schedules/_population_sim.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Pybind11Extension(
            "umopt.search.bounds._stage_programs",
            ["umopt/search/bounds/_stage_programs.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
