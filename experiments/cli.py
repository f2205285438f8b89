"""The ``draftgym`` command line. Every subcommand has ``--help``; ``--json`` gives machine-readable output.

Each command lives in its own module, which defines ``register(subparsers)`` and sets ``func`` on its parsers;
``func(args)`` returns an exit code. Errors the user can fix (a bad prompt, path, drafter, depth, config, file)
print one line and exit with code 2 (``experiments.errors``); no parser accepts abbreviated options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from experiments.errors import EXIT_USAGE, describe_os_error, is_user_error, one_line

# The modules that add subcommands, in the order ``draftgym --help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "experiments.generate",
    "experiments.bench",
    "experiments.serve_bench",
    "experiments.agreement",
    "experiments.runner",
    "experiments.sweep",
    "experiments.report",
    "experiments.env_commands",
    "experiments.train_drafter",
    "experiments.policy_commands",
    "experiments.oracle_gap",
)


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--prompt`` is not ``--prompt-file``); an error is one line and exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse prints usage + error otherwise
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="draftgym", description="Adaptive speculative decoding: decode, benchmark, train, sweep."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (2: bad input, reported in one line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0), or an argument argparse refused (2, already reported)
        return int(exit_.code or 0)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("draftgym: interrupted\n")
        return 130
    except Exception as err:
        message = user_message(err)
        if message is None:
            raise
        sys.stderr.write(f"draftgym {args.command}: error: {message}\n")
        return EXIT_USAGE


def user_message(err: Exception) -> str | None:
    """The one line to print for an error the user can fix; None for a bug (which keeps its traceback)."""
    if is_user_error(err):
        return one_line(err)
    if isinstance(err, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({err.reason} at byte {err.start})"
    if isinstance(err, OSError):  # a path that cannot be read or written
        return one_line(describe_os_error(err))
    return None


def entry(argv: list[str] | None = None) -> Any:
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
