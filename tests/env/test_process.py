"""``env.process``: how a command line's process is set up before any work. SIGTERM ends it as Ctrl-C does (one
line, exit 143, the command's cleanup run); a closed stdout or stderr and output the stream's encoding cannot
carry are no errors; stdin is read as UTF-8; a removed current folder is one line. Each runs a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys, time
from env.cli import run_program

def body(argv):
    try:
        print("ready", flush=True)  # (inside: the signal may come before the print returns)
        time.sleep(60)
    finally:
        open(argv[0], "w").write("cleaned up")  # what a command's cleanup (a finally, an except) does

sys.exit(run_program("prog", body, sys.argv[1:]))
"""


# Ctrl-C as a terminal's foreground job has it, first thing in each program: a test run started in the background
# (``nohup ... &``, a CI runner) ignores SIGINT, and its children inherit that, so SIGINT would not reach the program
# under test. (Set by the program itself: a ``preexec_fn`` is unsafe in a test runner with threads.)
AS_FROM_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def _start(*args: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL + PROGRAM, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_sigterm_ends_a_program_as_ctrl_c_does_with_its_cleanup_and_one_line(tmp_path):
    """It ended the process on the spot, silently: no cleanup ran (a sweep's workers ran on without a parent)."""
    for sig, code, word in ((signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")):
        mark = tmp_path / f"cleanup-{code}"
        proc = _start(str(mark))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code and err == f"prog: {word}\n", (proc.returncode, err)
        assert mark.read_text() == "cleaned up"


def test_sigterm_during_the_imports_is_one_line_too():
    """Ctrl-C in the first seconds (the command's modules and torch being imported) printed a screen of
    traceback: ``main`` caught it only around the command itself."""
    code = (
        "import os, signal, sys\n"
        "from experiments import cli\n"
        "build = cli.build_parser\n"
        "def slow_import(command):\n"
        "    os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # arrives while the parser is built\n"
        "    return build(command)\n"
        "cli.build_parser = slow_import\n"
        "sys.exit(cli.main(['generate', 'hi']))\n"
    )
    for sig, rc, word in (("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")):
        out = subprocess.run(
            [sys.executable, "-c", AS_FROM_A_TERMINAL + code, sig],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert out.returncode == rc and out.stderr == f"draftgym: {word}\n", (out.returncode, out.stderr)


def test_closed_streams_and_an_encoding_without_the_characters_are_no_errors(tmp_path):
    """``generate >&-`` failed flushing a stdout Python had made None; ``2>&-`` stopped ``bench`` at its first
    progress bar; ``PYTHONIOENCODING=ascii`` failed printing a French answer after the work was done, and read a
    UTF-8 prompt on stdin as "not UTF-8 text"."""
    code = (
        "import sys\n"
        "from env.cli import run_program\n"
        "def body(argv):\n"
        "    text = sys.stdin.read()\n"
        "    with open(argv[0], 'w', encoding='utf-8') as fh:  # (a closed number: this file's, unless taken)\n"
        "        print(text, 'bytes\\udcff', flush=True)\n"
        "        print('to stderr', file=sys.stderr, flush=True)\n"
        "        fh.write(text)\n"
        "sys.exit(run_program('prog', body, sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    got = tmp_path / "got.txt"
    out = subprocess.run([sys.executable, "-c", code, str(got)], input="Écris «bonjour»".encode(),
                         capture_output=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert got.read_text(encoding="utf-8") == "Écris «bonjour»"  # read as UTF-8
    assert out.stdout == b"\\xc9cris \\xabbonjour\\xbb bytes\xff\n"  # escaped; a file name's byte as itself

    def closed(fd: int, held: bool) -> None:  # as `2>&-`; held: a launcher script took the number, read-only
        os.close(fd)
        if held:
            assert os.open(os.devnull, os.O_RDONLY) == fd  # (pyenv's shim script held stderr so)

    for fd, held in ((1, False), (2, False), (2, True)):
        got.unlink()
        out = subprocess.run([sys.executable, "-c", code, str(got)], input=b"hi", cwd=ROOT, timeout=120,
                             stdout=subprocess.DEVNULL if fd == 2 else None,
                             stderr=subprocess.DEVNULL if fd == 1 else None,
                             preexec_fn=lambda fd=fd, held=held: closed(fd, held))  # fmt: skip
        assert out.returncode == 0 and got.read_text() == "hi", (fd, held)


def test_a_removed_current_folder_is_one_line(tmp_path):
    """torch's import failed there with an MKL message that named a library, not the folder."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = "import os, sys\nos.rmdir(os.getcwd())\nfrom experiments.cli import main\nsys.exit(main(['generate', 'hi']))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=gone, env=env, timeout=120
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "the current folder no longer exists" in out.stderr
