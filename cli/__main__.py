"""`python -m expertpack.cli ...` runs the `expertpack` command."""

import sys

from .main import main

sys.exit(main())
