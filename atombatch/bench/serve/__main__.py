"""`python -m atombatch.bench.serve` (the same as `python -m atombatch.bench serve`)."""

import sys

from atombatch.bench.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
