"""Print an OpenBLAS kernel other than the one this machine picks, for a second numeric run.

Float32 sums differ between kernels (another SIMD width, another blocking), so a test whose
tolerance does not follow from what it compares passes on one CPU and fails on another. Running
the numeric tests under a second kernel makes that fail here, in CI. Prints nothing when NumPy's
BLAS is not OpenBLAS or the architecture has no second kernel we know of.
"""

from __future__ import annotations

import platform

import numpy  # noqa: F401  (loads the BLAS that threadpoolctl then reports)
from threadpoolctl import threadpool_info

# Kernels every CPU of the architecture can run (the baseline), and one alternative for when the
# baseline is what the machine picks by itself.
CHOICES = {"x86_64": ("Prescott", "Nehalem"), "aarch64": ("ARMV8", "NEOVERSEN1")}


def main() -> None:
    blas = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
    choices = CHOICES.get(platform.machine())
    if not blas or not choices:
        return
    picked = str(blas[0].get("architecture", "")).lower()
    print(choices[1] if picked == choices[0].lower() else choices[0])


if __name__ == "__main__":
    main()
