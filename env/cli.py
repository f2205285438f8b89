"""The entry of the ``python -m env.*`` programs (benchmarks and checks), as ``draftgym``'s own commands behave
(``experiments.cli``, which env/ may not import): no abbreviated options; a bad argument, name or path is one line
on stderr (``python -m env.bench_draft: error: ...``) and exit code 2, never a traceback; a path to write is checked
before any work, and results are written as they are measured (``write_json``), so that an error or a kill
mid-run keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernels.timing import (  # (kernels.bench checks --json with it too)
    format_of,
    holds_other_than,
    holds_other_than_json,
)

EXIT_USAGE = 2

# The errors of the layers env/ may import whose message is meant for the user, by ``module:Class`` (nothing is
# imported to recognise one; a subclass counts too). ``experiments.errors.USER_ERROR_TYPES`` names these and the
# upper layers' own.
USER_ERROR_TYPES: frozenset[str] = frozenset(
    {
        "env.cli:ProgramError",
        "kernels.packed:QuantError",
        "drafters.base:DrafterError",
        "env.model:ModelError",
        "env.target:PromptError",
        "env.workloads:WorkloadError",
        "env.features:FeatureSpecError",
        "env.cost:CostModelError",
        "env.trace:TraceError",
        "env.spec_env:EnvError",
        "env.serving:ServeError",
        "env.serve_obs:ServeEnvError",
        "env.folder_lock:FolderBusy",
        "env.decoder:PolicyMismatch",
    }
)


class ProgramError(Exception):
    """A bad argument a program finds itself (a name it cannot use, a list it cannot read): one line, exit 2."""


class Parser(argparse.ArgumentParser):
    """No abbreviations (``--draft`` is not ``--drafters``); an argparse error is one line and exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse prints the usage too otherwise
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        sys.exit(EXIT_USAGE)


def one_line(message: object) -> str:
    return " ".join(str(message).split())


def user_message(err: BaseException, user_types: frozenset[str] = USER_ERROR_TYPES) -> str | None:
    """The line to print for an error the user can fix (None for a bug, which keeps its traceback).
    ``user_types``: the error types meant for the user (a program of an upper layer passes its own list)."""
    if any(f"{c.__module__}:{c.__qualname__}" in user_types for c in type(err).__mro__):
        return one_line(err)
    if isinstance(err, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({err.reason} at byte {err.start})"
    if isinstance(err, OSError):  # a path that cannot be read or written
        what = err.strerror or type(err).__name__
        return one_line(f"{err.filename}: {what}" if err.filename is not None else f"{what}: {err}")
    return memory_message(err)


def memory_message(err: BaseException) -> str | None:
    """The line for sizes this machine cannot hold (numpy's and Python's MemoryError, torch's allocator): ask for
    less. None for another error."""
    text = one_line(err)
    torch_oom = isinstance(err, RuntimeError) and (
        any(c.__name__ == "OutOfMemoryError" for c in type(err).__mro__)  # torch's, on a GPU
        or "not enough memory" in text  # torch's CPU allocator, Windows and older
        or "can't allocate memory" in text  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate ..."
    )
    if isinstance(err, MemoryError) or torch_oom:
        where = text.find("DefaultCPUAllocator")  # after "[enforce fail at alloc_cpu.cpp:127] err == 0."
        text = text[where:] if where > 0 else text
        text = text if len(text) <= 200 else text[:199] + "…"  # a GPU's comes with a paragraph of advice
        return f"not enough memory for the sizes asked for ({text or type(err).__name__}); ask for less"
    return None


def run_program(
    prog: str,
    body: Callable[[list[str] | None], int | None],
    argv: list[str] | None,
    user_types: frozenset[str] = USER_ERROR_TYPES,
) -> int:
    """``body(argv)``'s exit code; a user's error ends as one line on stderr and exit code 2 (``--help`` and an
    argument argparse refused return their own code). ``user_types``: as ``user_message``."""
    from env.process import check_cwd, interrupted, prepare_streams, sigterm_as_interrupt

    prepare_streams()  # (first: a closed stderr is where check_cwd would write)
    code = check_cwd(prog)
    if code is not None:
        return code
    with sigterm_as_interrupt():
        try:
            return _run(prog, body, argv, user_types, interrupted)
        except KeyboardInterrupt as err:  # before _run's own handler is in place
            return interrupted(prog, err)


def _run(prog: str, body: Callable[[list[str] | None], int | None], argv: list[str] | None,
         user_types: frozenset[str], interrupted: Callable[[str, KeyboardInterrupt], int]) -> int:  # fmt: skip
    from env.files import forget_made_folders, remove_made_folders
    from env.folder_lock import held_folders, release_folders

    held = held_folders()
    forget_made_folders()  # (only what this command makes counts)
    code = 1  # (a bug's traceback)
    try:
        code = int(body(argv) or 0)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            sys.stderr.write(f"{prog}: error: {one_line(exit_.code)}\n")
            code = EXIT_USAGE
        else:
            code = int(exit_.code or 0)
    except KeyboardInterrupt as err:
        code = interrupted(prog, err)
    except Exception as err:
        message = user_message(err, user_types)
        if message is None:
            raise
        sys.stderr.write(f"{prog}: error: {message}\n")
        code = EXIT_USAGE
    finally:
        release_folders(keep=held)  # the folders its command claimed (``env.folder_lock``)
        if code != 0:
            remove_made_folders()  # an output folder made before the refusal, still empty (once released)
        forget_made_folders()
    return code


def same_file(a: object, b: object) -> bool:
    """Whether the paths ``a`` and ``b`` (None: no path) name one existing file."""
    try:
        return a is not None and b is not None and os.path.samefile(a, b)  # type: ignore[arg-type]
    except (OSError, ValueError, TypeError):
        return False


def check_not_input(path: str | Path, flag: str, inputs: tuple[object, ...]) -> None:
    """``ProgramError`` when the output ``path`` is one of the command's ``inputs`` (paths, None for an input not
    given, a name such as ``roofline:...`` that is no file): writing it would destroy what the command reads."""
    if any(same_file(path, src) for src in inputs):
        raise ProgramError(f"{flag} {path} is also an input of this command; it would be overwritten")


def check_not_inside(path: str | Path, flag: str, folders: tuple[object, ...]) -> None:
    """``ProgramError`` when the output ``path`` lies in one of the folders the command reads (``folders``: a
    model's folder, a head's, training data; None for one not given): a result written there could replace one of
    their files, which are not all named in advance (a model folder holds ``config.json``)."""
    out = Path(path).resolve()
    for folder in folders:
        if folder is not None and out.is_relative_to(Path(str(folder)).resolve()):
            raise ProgramError(
                f"{flag} {path} is inside {folder}, which this command reads; write it elsewhere"
            )


NAME_MAX = 255  # bytes of a file name on Linux file systems (ext4, xfs, btrfs, tmpfs)
NAME_MARGIN = 16  # what a temporary or lock name adds: ".NAME.PID.dg.tmp" (16), "NAME.partial.lock" (13)


def check_output_kind(path: str | Path, flag: str) -> Path:
    """``path`` as a ``Path`` when it may name an output file; ``ProgramError`` naming ``flag`` when it is a folder
    or ends in a slash (``Path`` drops it: ``x/`` would write a file ``x``), or exists and is no regular file (a
    result is written under a temporary name and renamed: it would replace a device, FIFO or socket)."""
    out = Path(path)
    if (
        len(os.fsencode(out.name)) > NAME_MAX - NAME_MARGIN
    ):  # refused at the end, with the work done, or a traceback
        raise ProgramError(
            f"{flag}: its file name is {len(os.fsencode(out.name))} bytes; at most {NAME_MAX - NAME_MARGIN} (the "
            f"temporary file written first adds to it, within the file system's {NAME_MAX})"
        )
    if out.is_dir():
        raise ProgramError(f"{flag} {path} is a directory, not a file")
    if str(path).endswith(("/", os.sep)):
        raise ProgramError(f"{flag} {path} names a folder, not a file")
    if out.exists() and not out.is_file():
        raise ProgramError(f"{flag} {path} is not a regular file (a device, FIFO or socket); not overwritten")
    return out


def output_file(
    path: str | Path | None,
    flag: str = "--json",
    inputs: tuple[object, ...] = (),
    folders: tuple[object, ...] = (),
    formats: tuple[str, ...] = (),
    earlier: tuple[Callable[[Path], bool], str] | None = None,
) -> Path | None:
    """Check, before any work, that ``path`` can be written: not a directory, none of the command's ``inputs``
    (as ``check_not_input``), in none of the folders it reads (``folders``, as ``check_not_inside``), and that
    an existing file there is an earlier output of the command, not something else a misplaced flag would
    destroy: with ``formats`` a JSON object of one of them (a cost model replaces only a cost model), with
    ``earlier`` what its test (and name) accepts, for ``--json`` by default an earlier JSON result; its folder
    made and writable (``ProgramError`` naming ``flag`` otherwise). None stays None (nothing to write)."""
    if path is None:
        return None
    out = check_output_kind(path, flag)
    check_not_input(out, flag, inputs)
    check_not_inside(out, flag, folders)
    if formats:
        earlier = (lambda p: not holds_other_than(p, formats), f"a {' or '.join(formats)} file")
    elif earlier is None and flag == "--json":
        earlier = (lambda p: not holds_other_than_json(p), "a JSON file")
    if earlier is not None and out.is_file() and not earlier[0](out):
        kind = format_of(out)
        shown = "a JSON result" if earlier[1] == "a JSON file" else earlier[1]
        what = earlier[1] if kind is None else f"{shown} (a {kind} file)"
        raise ProgramError(f"{flag} {path} exists and is not {what}; not overwritten")
    folder = out.parent
    if folder.is_symlink() and not folder.exists():  # (mkdir said "File exists")
        raise ProgramError(
            f"{flag} {path}: {folder} is a symbolic link to {os.readlink(folder)}, which does not exist"
        )
    if folder.exists() and not folder.is_dir():
        raise ProgramError(f"{flag} {path}: {folder} is a file, not a directory")
    try:
        from env.files import make_folder

        make_folder(folder)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ProgramError(f"{flag} {path}: cannot write there ({err.strerror or err})") from err
    return out


def check_context(loaded: Any, positions: int, what: str) -> None:
    """``ProgramError`` when a benchmark's rows need ``positions`` (``what`` says from which options) past the
    model's context: found after the model loads, before the first prefill (which ran first and failed)."""
    if positions > loaded.max_context:
        raise ProgramError(
            f"{what}: {positions} positions exceed the model's context of {loaded.max_context}"
        )


def decimal_int(text: str) -> int:
    """``int(text)`` for plain decimal digits only (a sign and surrounding spaces allowed): Python's ``int`` also
    reads ``4_0`` as 40 and other scripts' digits (``٤`` as 4), which an option's value is not meant to be;
    ``ValueError`` otherwise."""
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise ValueError(f"not a decimal integer: {text[:40]!r}")
    return int(text)


def int_list(text: str, flag: str, low: int = 1) -> list[int]:
    """A comma list of integers >= ``low`` (``ProgramError`` naming ``flag`` otherwise)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = [decimal_int(x) for x in items]
    except ValueError:
        values = []
    if not values or any(v < low for v in values):
        raise ProgramError(f"{flag} must be a comma list of integers >= {low}, got {text!r}")
    return values


INT64_MAX = (1 << 63) - 1  # the most an integer option takes: a larger one overflows a float or a tensor


def int_at_least(low: int, high: int | None = None, *, most: int = INT64_MAX) -> Callable[[str], int]:
    """An integer >= ``low`` and <= ``high`` (refused as "in [low, high]"); without ``high``, at most ``most``
    (refused as "<= most")."""
    top = most if high is None else high

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        try:
            value = decimal_int(text)
        except ValueError:
            # past the 4300 digits int() reads
            if len(digits) > 4000 and digits.isascii() and digits.isdigit():
                span = f"in [{low}, {high}]" if high is not None else f"<= {top}"
                raise argparse.ArgumentTypeError(
                    f"must be {span}, got {digits[:6]}... ({len(digits)} digits)"
                ) from None
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        shown = (
            str(value)
            if len(digits) <= 24
            else f"{'-' if value < 0 else ''}{digits[:6]}... ({len(digits)} digits)"
        )
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {shown}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {shown}")
        if value > top:
            raise argparse.ArgumentTypeError(f"must be <= {top}, got {shown}")
        return value

    parse.__name__ = f"integer >= {low}" if high is None else f"integer in [{low}, {high}]"
    return parse


positive_int = int_at_least(1)  # (argparse names it "integer >= 1")


SEED_MAX = (1 << 32) - 1


def seed_int(text: str) -> int:
    """An argparse type: a seed, an integer in [0, 2**32 - 1] (numpy refuses negative seeds; numpy's legacy seeding,
    which stable-baselines3 and scikit-learn use, larger ones)."""
    try:
        value = decimal_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1], got {text}")
    return value


def write_json(path: Path | None, doc: Any, indent: int | None = 1) -> None:
    """Write ``doc`` to ``path`` atomically (``env.files``), after every row measured; nothing when None."""
    if path is not None:
        from env.files import atomic_write_text

        atomic_write_text(path, json.dumps(doc, indent=indent))


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar on stderr, shown on a terminal only (and not at all when ``enabled`` is false)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None if enabled else True)
