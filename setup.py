"""Builds the one compiled hot spot, `atombatch/_blocks.pyx`.

`ATOMBATCH_DEBUG=1` at build time keeps bounds checks on and enables the invariant checks.
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = bool(os.environ.get("ATOMBATCH_DEBUG"))

extensions = [
    Extension(
        "atombatch._blocks",
        ["atombatch/_blocks.pyx"],
        include_dirs=[np.get_include(), "atombatch/_vendor/xxhash"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "embedsignature": True,
        },
        compile_time_env={"ATOMBATCH_DEBUG": DEBUG},
        # cythonize only regenerates C when the .pyx is newer than it, so a debug and a release
        # build must not share one generated file.
        build_dir=os.path.join("build", "cython-debug" if DEBUG else "cython-release"),
    )
)
