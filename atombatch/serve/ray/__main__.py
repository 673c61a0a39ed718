"""`python -m atombatch.serve.ray` (flags: `--help`, docs/cluster.md)."""

# Nothing Ray pickles is defined here: Ray pickles classes of `__main__` by value, and a by-value
# copy of the package's msgspec Structs does not rebuild in the workers. Every class lives in a
# module with an import name (`atombatch.serve.ray.*`), and this file only calls `main`.
import sys

from atombatch.serve.ray.cli import main

if __name__ == "__main__":
    sys.exit(main())
