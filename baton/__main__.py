"""`python -m baton ...` is the `baton` command."""

import sys

from baton.cli import main

sys.exit(main())
