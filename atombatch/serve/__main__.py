"""`python -m atombatch.serve`: see `atombatch.serve.cli`."""

import sys

from atombatch.serve.cli import main

sys.exit(main())
