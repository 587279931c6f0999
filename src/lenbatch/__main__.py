"""`python -m lenbatch ...`: the `lenbatch` script (also how `serve` re-executes itself)."""

import sys

from lenbatch.cli.main import main

sys.exit(main())
