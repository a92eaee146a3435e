"""`python -m baton ...` is the `baton` command."""

import sys

from baton.cli import main

if __name__ == "__main__":  # spawned child processes (vLLM, benchmarks) re-import this module
    sys.exit(main())
