"""What a command line sets up about its process before any work: its standard streams and SIGTERM.

Used by ``draftgym`` (``experiments.cli.main``) and the ``python -m env.*`` programs (``env.cli.run_program``);
imports nothing heavy, so that it runs before torch loads:

- ``check_cwd``: a current folder removed under the shell is one line (torch's import failed in it with an MKL
  message that named a library, not the folder).
- ``prepare_streams``: stdout or stderr closed by the caller (``>&-``) writes to the null device (a command's
  results are its files; a progress bar on a closed stderr stopped the work), which holds the closed number too
  (else the first file the command opened took it); what the stream's encoding cannot
  carry is escaped, never an error after the work is done (a file name's undecodable bytes are written back as
  those bytes, other characters as backslash escapes: ``PYTHONIOENCODING=ascii`` with a French prompt); stdin is
  read as UTF-8 whatever the locale says, as every file the commands read.
- ``sigterm_as_interrupt``: SIGTERM (what ``timeout``, job schedulers and systemd send) is raised as
  ``Terminated``, a ``KeyboardInterrupt``, where the program is, so that what runs on Ctrl-C runs on it too (a
  sweep stops its workers; a trial is marked for retry); before, the process ended on the spot without a word and
  a sweep's workers ran on. Python runs the handler between its own instructions: a long torch operation
  finishes first (``timeout -k`` sends SIGKILL after a grace period).
"""

from __future__ import annotations

import codecs
import fcntl
import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

EXIT_TERMINATED = 128 + signal.SIGTERM  # as a shell reports a process SIGTERM ended (143)
ESCAPE = "draftgym-escape"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program was (``sigterm_as_interrupt``)."""


def _escape(err: UnicodeError) -> tuple[str | bytes, int]:
    if not isinstance(err, UnicodeEncodeError):  # (a stream read with this handler: as "replace" reads)
        return codecs.replace_errors(err)
    text = err.object[err.start : err.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in text):  # bytes a file name held that were no UTF-8
        return bytes(ord(c) - 0xDC00 for c in text), err.end
    return codecs.backslashreplace_errors(err)


codecs.register_error(ESCAPE, _escape)


def check_cwd(prog: str) -> int | None:
    """The exit code 2, after one line on stderr, when the current folder no longer exists; None when it does."""
    try:
        os.getcwd()
    except FileNotFoundError:
        sys.stderr.write(
            f"{prog}: error: the current folder no longer exists (removed): cd to one that does\n"
        )
        return 2
    return None


def _usable(fd: int, write: bool) -> bool:
    """Whether ``fd`` is open for writing (or, not ``write``, for reading)."""
    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        return False
    return mode != (os.O_RDONLY if write else os.O_WRONLY)


def prepare_streams() -> None:
    """Set up stdin, stdout and stderr as the module docstring says (only the process's own: a stream put in their
    place, as a test's capture, is left as it is)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        # closed by the caller (`2>&-`): the null device takes the number, or the next file the command opens (its
        # results) would, and what is written to the terminal would go into that file (a launcher script may
        # hold the number already, read-only: pyenv's shim did)
        if not _usable(fd, write=fd > 0):
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            mode = "r" if fd == 0 else "w"
            setattr(sys, name, open(fd, mode, encoding="utf-8", errors=ESCAPE, closefd=False))  # noqa: SIM115
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # closed by the caller: Python made it None
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8", errors=ESCAPE))  # noqa: SIM115
        elif (
            stream is getattr(sys, f"__{name}__")
            and isinstance(stream, io.TextIOWrapper)
            and stream.errors != ESCAPE
        ):
            with suppress(ValueError, OSError):
                stream.reconfigure(errors=ESCAPE)
    stdin = sys.stdin
    if (
        stdin is sys.__stdin__
        and isinstance(stdin, io.TextIOWrapper)
        and stdin.encoding.replace("_", "-").lower()
        not in (
            "utf-8",
            "utf8",
        )
    ):
        with suppress(ValueError, OSError):  # (refused once something was read: then left as it is)
            stdin.reconfigure(encoding="utf-8")


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated``; the handler before it is put back after (only the main
    thread can set one: elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def interrupted(prog: str, err: KeyboardInterrupt) -> int:
    """One line for Ctrl-C or SIGTERM, and its exit code (130 or 143)."""
    if isinstance(err, Terminated):
        sys.stderr.write(f"{prog}: terminated\n")
        return EXIT_TERMINATED
    sys.stderr.write(f"{prog}: interrupted\n")
    return 130
