"""The `baton` command line.

Each command lives in its own module, which exposes `register(subparsers)`: it adds its
subcommand(s) with `subparsers.add_parser(...)` and sets `func=<handler>` via `set_defaults`;
a handler takes the parsed `argparse.Namespace` and returns the exit code. To add a command
(e.g. `baton bench <name>`), write such a module and list it in COMMAND_MODULES. Modules should
import heavy dependencies inside their handlers so that `baton --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "baton.traces.commands",  # baton replay, baton trace {bfcl,locomo,check}
    "baton.bench.commands",  # baton bench <name> [--quick]
)


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description="Baton: serve and benchmark LLM conversations.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
