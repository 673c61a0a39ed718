"""Builds the one compiled hot spot, `atombatch/kernel/_blocks.pyx`.

`ATOMBATCH_DEBUG=1` at build time keeps bounds checks on and enables the invariant checks.

A re-install (`pip install -e ".[extra]"`, or `pip install .` from the same tree) does not
compile the extension again when nothing it is built from has changed. pip builds every install in
a fresh build environment and temporary directory, so neither cythonize's nor setuptools' own
up-to-date checks see a previous build (cythonize even regenerates the C, because Cython's own
`.pxd` files in the new environment are newer than the `.pyx`). So a build keeps the module it
made under `build/extension-cache/<digest>/`, the digest covering everything the module is made
from: the sources below, the flags, the Python ABI, the Cython and the NumPy versions. A build
with the same digest copies that module and skips cythonize and the compiler.
`python setup.py build_ext --force` (or deleting `build/`) compiles regardless.
"""

import hashlib
import json
import os
import shutil
import sysconfig
from pathlib import Path

import Cython
import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = bool(os.environ.get("ATOMBATCH_DEBUG"))
HERE = Path(__file__).resolve().parent
CACHE = HERE / "build" / "extension-cache"

extensions = [
    Extension(
        "atombatch.kernel._blocks",
        ["atombatch/kernel/_blocks.pyx"],
        include_dirs=[np.get_include(), "atombatch/_vendor/xxhash"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
        depends=["atombatch/kernel/_blocks.pxd", "atombatch/_vendor/xxhash/xxhash.h"],
    )
]
SOURCES = ("atombatch/kernel/_blocks.pyx", "atombatch/kernel/_blocks.pxd", "atombatch/_vendor/xxhash/xxhash.h",
           "setup.py")


def _digest() -> str:
    """Everything the compiled module is made from (not the generated C: it embeds the paths of
    the temporary build environment)."""
    ext = extensions[0]
    record = {
        "files": {name: hashlib.sha256((HERE / name).read_bytes()).hexdigest() for name in SOURCES},
        "macros": ext.define_macros, "args": ext.extra_compile_args, "debug": DEBUG,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "cython": Cython.__version__, "numpy": np.__version__,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


DIGEST = _digest()
MODULE = "_blocks" + sysconfig.get_config_var("EXT_SUFFIX")
CACHED = CACHE / DIGEST / MODULE


class ReusingBuildExt(build_ext):
    """`build_ext` that copies the module built before from the same inputs instead of compiling."""

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        if CACHED.is_file() and not self.force:
            print(f"reusing {CACHED.relative_to(HERE)} (built before from the same inputs)")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CACHED, target)
            return
        if not ext.sources[0].endswith(".c"):  # cythonize was skipped for a cached module
            (ext,) = cythonize([ext], **CYTHONIZE)
        super().build_extension(ext)
        # Keep only the newest build: a changed .pyx makes the older ones dead weight.
        shutil.rmtree(CACHE, ignore_errors=True)
        CACHED.parent.mkdir(parents=True)
        partial = CACHED.with_name(MODULE + ".partial")
        shutil.copy2(target, partial)
        os.replace(partial, CACHED)  # a killed build leaves no half module


CYTHONIZE = {
    "compiler_directives": {
        "language_level": 3,
        "embedsignature": True,
    },
    "compile_time_env": {"ATOMBATCH_DEBUG": DEBUG},
    # cythonize only regenerates C when the .pyx is newer than it, so a debug and a release
    # build must not share one generated file.
    "build_dir": os.path.join("build", "cython-debug" if DEBUG else "cython-release"),
}

setup(
    # A cached module needs no C: cythonize (seconds, and it rewrites build/) runs only to compile.
    ext_modules=extensions if CACHED.is_file() else cythonize(extensions, **CYTHONIZE),
    cmdclass={"build_ext": ReusingBuildExt},
)
