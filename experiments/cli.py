"""The ``draftgym`` command line. Every subcommand has ``--help``; ``--json`` gives machine-readable output.

Each command lives in its own module, which defines ``register(subparsers)`` and sets ``func`` on its parsers;
``func(args)`` returns an exit code. Errors the user can fix (a bad prompt, path, drafter, depth, config, file)
print one line and exit with code 2 (``experiments.errors``); no parser accepts abbreviated options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType
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
    "experiments.policy_train",
    "experiments.policy_commands",
    "experiments.oracle_gap",
    "experiments.serve_train",
)

# Each subcommand's module and one-line help, so that ``draftgym CMD`` imports CMD's module alone and
# ``draftgym --help`` imports none (torch and the model code take seconds to import). A test checks this table
# against what the modules register.
COMMANDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "generate": ("experiments.generate", "generate text with speculative decoding"),
        "bench": ("experiments.bench", "benchmark methods side by side against Hugging Face generate"),
        "serve-bench": (
            "experiments.serve_bench",
            "goodput against load: continuous batching, every method, each level",
        ),
        "agreement": (
            "experiments.agreement",
            "token agreement of a bench run with HF greedy; near-tie analysis",
        ),
        "run": ("experiments.runner", "run the workload x methods of a config into a run directory"),
        "sweep": ("experiments.sweep", "an Optuna study over tree shapes or policy hyper-parameters"),
        "report": ("experiments.report", "a Markdown report of run and sweep directories, side by side"),
        "calibrate": ("experiments.env_commands", "measure this machine's step costs into a cost-model JSON"),
        "record": (
            "experiments.env_commands",
            "record a replay trace (greedy) of a workload; re-run to resume",
        ),
        "train-drafter": (
            "experiments.train_drafter",
            "train an eagle, eagle3 or early_exit draft head by self-distillation",
        ),
        "train": (
            "experiments.policy_train",
            "train the policies of a config on the replay env (bandits, RL, predictors)",
        ),
        "evaluate": (
            "experiments.policy_commands",
            "policies vs the best static arm and the oracles, replay and live",
        ),
        "serve-train": (
            "experiments.serve_train",
            "fit and train the serving policies on the replayed serving env",
        ),
        "oracle-gap": (
            "experiments.oracle_gap",
            "how much of the per-step oracle's gain predictors can learn (replay)",
        ),
    }
)


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--prompt`` is not ``--prompt-file``); an error is one line and exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse prints usage + error otherwise
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, and an option given a blank value (``--out ""``, ``--policy ' '``) is refused: the
        commands read an empty value as the option left out, which would write a fresh default run folder or
        drop what the user meant to name."""
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if not action.option_strings:
                continue
            value = getattr(parsed, action.dest, None)
            defaults = action.default if isinstance(action.default, list) else [action.default]
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, str) and not item.strip() and item not in defaults:
                    self.error(
                        f"{'/'.join(action.option_strings)} is given an empty value ({item!r}); "
                        "name one or leave the option out"
                    )
        return parsed, extras


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser (every module registers its subcommands); with ``command``, only that command's module
    registers, the others are listed from ``COMMANDS`` (for the top-level help) without being imported."""
    p = _Parser(
        prog="draftgym", description="Adaptive speculative decoding: decode, benchmark, train, sweep."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if command is None:
        for name in COMMAND_MODULES:
            importlib.import_module(name).register(sub)
        return p
    module = COMMANDS[command][0] if command in COMMANDS else None
    if module is not None:
        importlib.import_module(module).register(sub)
    for name, (_, help_) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    return p


def _command_of(argv: list[str]) -> str:
    """The subcommand ``argv`` names ("" for none: ``draftgym --help`` lists them all without importing any)."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (2: bad input, reported in one line on stderr; 130 and 143: Ctrl-C
    and SIGTERM, in one line too, at any point, the imports included). The process is set up first
    (``env.process``: the current folder, the standard streams, SIGTERM)."""
    from env.process import check_cwd, interrupted, prepare_streams, sigterm_as_interrupt

    argv = sys.argv[1:] if argv is None else list(argv)
    prepare_streams()  # (first: a closed stderr is where check_cwd would write)
    code = check_cwd("draftgym")
    if code is not None:
        return code
    with sigterm_as_interrupt():
        try:
            return _main(argv)
        except KeyboardInterrupt as err:  # during the imports (the command's own is caught in _main)
            return interrupted("draftgym", err)


def _main(argv: list[str]) -> int:
    from env.process import interrupted

    try:
        args = build_parser(_command_of(argv)).parse_args(argv)
    except SystemExit as exit_:  # --help (0), or an argument argparse refused (2, already reported)
        return int(exit_.code or 0)
    from env.files import forget_made_folders, remove_made_folders
    from env.folder_lock import held_folders, release_folders

    held = held_folders()
    forget_made_folders()  # (only what this command makes counts)
    code = 1  # (a bug's traceback)
    try:
        code = int(args.func(args) or 0)
        return code
    except KeyboardInterrupt as err:
        code = interrupted("draftgym", err)
        return code
    except Exception as err:
        message = user_message(err)
        if message is None:
            raise
        sys.stderr.write(f"draftgym {args.command}: error: {message}\n")
        code = EXIT_USAGE
        return code
    finally:
        release_folders(keep=held)  # the folders the command claimed (``env.folder_lock``)
        if code != 0:
            remove_made_folders()  # an output folder made before the refusal, still empty (once released)
        forget_made_folders()


def user_message(err: Exception) -> str | None:
    """The one line to print for an error the user can fix; None for a bug (which keeps its traceback)."""
    if is_user_error(err):
        return one_line(err)
    if isinstance(err, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({err.reason} at byte {err.start})"
    if isinstance(err, OSError):  # a path that cannot be read or written
        return one_line(describe_os_error(err))
    from env.cli import memory_message

    return memory_message(err)


# commands whose process ends as soon as their output is out, without the interpreter's teardown (freeing torch
# and the model takes ~0.4 s of a fresh `draftgym generate` on a 2-core CPU); everything they write is written and
# closed before they return
FAST_EXIT = frozenset({"generate"})


def entry(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else list(argv)
    code = main(argv)
    if _command_of(argv) in FAST_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a reader closed the pipe (`draftgym generate ... | head -c 9`): nothing to report
            pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
