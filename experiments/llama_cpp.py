"""``llama_cpp``: llama-cpp-python as a baseline method of ``draftgym bench``, in a worker process of its own.

What it runs: the same GGUF as our target (the embedded SmolLM2's Q4_1 file, or ``--llama-cpp-gguf PATH``), on
exactly the prompt token ids our methods decode (``env.decoder.chat_prompt``: our chat template, handed over
as tokens, never re-tokenized), plain greedy (llama.cpp's greedy sampler: temperature 0, no repeat penalty),
stopping at the target's end-of-sequence ids (kept, as our decoders keep them) or at ``max_new_tokens``.
``wall_s`` is measured in the worker from submitting the prompt to the last token, prompt evaluation included,
as our ``wall_s`` is; the KV cache is reset before each prompt, so no prompt reuses the previous one's prefix.

Why a process: llama.cpp's thread pool (as many threads as torch's, ``torch.get_num_threads()``) would fight torch's in
one process, and a crash of the C library (a segfault on a bad file) would end the whole run. Here it ends the
worker only; ``LlamaCppRunner`` raises ``LlamaCppError`` and ``draftgym bench`` records the method as failed
in one line. While the worker decodes, the torch process waits for its answer (bench interleaves methods per
prompt).

Protocol, JSON lines (the worker's stdout carries nothing else: the C library's prints go to its stderr)::

    worker -> {"ready": true, "version": ..., "n_ctx": ..., "n_threads": ..., "allocator": ..., "allocator_env": ...}
              (the allocator fields: env.allocator.allocator_state, absent where the package cannot be imported)
              or {"error": ...}, then exits
    parent -> {"prompt_ids": [...], "max_new_tokens": N}
    worker -> {"token_ids": [...], "wall_s": S}          or {"error": ...} (a bad request; the worker lives on)

The worker exits at the end of its stdin. By hand: ``python -m experiments.llama_cpp --gguf PATH --n-ctx 2048 --eos 2``.
Its arguments and each request are checked (the ids are given to the C library as they are): a bad argument is
one line and exit code 2, a bad request an ``{"error": ...}`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from experiments.errors import UserError, one_line

METHOD = "llama_cpp"
INSTALL_HINT = "pip install 'draftgym[llama]'"
LOAD_TIMEOUT_S = 300.0  # loading and the untimed warm-up; a 135M GGUF takes about a second
REQUEST_TIMEOUT_S = 120.0  # per request, plus SECONDS_PER_TOKEN per prompt and new token
SECONDS_PER_TOKEN = 1.0


class LlamaCppError(UserError):
    """The llama_cpp method cannot run (not installed, no GGUF, a worker that died); meant for the user."""


def gguf_of(model: str | None, gguf: str | Path | None) -> Path:
    """The GGUF llama.cpp runs: ``gguf`` when given, else the embedded model's (``model`` None or its name);
    a Hugging Face folder has no GGUF, so it needs ``--llama-cpp-gguf``."""
    from env.model import DEFAULT_MODEL, embedded_gguf_path

    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise LlamaCppError(f"--llama-cpp-gguf {path} is not a file")
        return path
    if model in (None, "", DEFAULT_MODEL):
        return embedded_gguf_path()
    raise LlamaCppError(
        f"llama_cpp needs a GGUF of --model {model} (a Hugging Face folder has none): "
        "pass --llama-cpp-gguf PATH"
    )


class LlamaCppRunner:
    """The parent's end of one worker: started (model loaded, warmed up) in the constructor, then ``run`` per
    prompt, like ``experiments.hf_baselines.HFRunner``. Any way the worker fails raises ``LlamaCppError``; after that
    the runner stays dead (bench does not restart it: one failure, one line)."""

    def __init__(
        self, gguf: Path, eos_ids: frozenset[int] | list[int], *, n_ctx: int, n_threads: int | None = None
    ) -> None:
        self.gguf = Path(gguf)
        self.eos_ids = sorted(int(t) for t in eos_ids)
        if (
            not n_threads
        ):  # the threads every torch method of the run gets (physical cores within the affinity)
            import torch

            n_threads = torch.get_num_threads()
        package_root = str(Path(__file__).resolve().parents[1])  # the worker imports experiments from here
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "experiments.llama_cpp", "--gguf", str(self.gguf), "--n-ctx", str(n_ctx)]
        cmd += ["--n-threads", str(n_threads), "--eos", ",".join(map(str, self.eos_ids))]
        # a file, not a pipe: a chatty worker cannot block on it; held for its life, closed by close()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        self._buf = b""
        self.dead: str | None = None  # why the worker is gone, once it is
        try:
            reply = self._reply(LOAD_TIMEOUT_S, f"while loading {self.gguf}")
            if not reply.get("ready"):
                self._fail(str(reply.get("error") or f"unexpected first reply {reply}"))
        except LlamaCppError:
            self.close()
            raise
        self.info: dict[str, Any] = {
            "gguf": str(self.gguf),
            **{k: v for k, v in reply.items() if k != "ready"},
        }

    @property
    def pid(self) -> int:
        return self._proc.pid

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens after ``prompt_ids`` and the worker's wall time for them (prompt evaluation in)."""
        if self.dead is not None:
            raise LlamaCppError(self.dead)
        request = {"prompt_ids": [int(t) for t in prompt_ids], "max_new_tokens": int(max_new_tokens)}
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died; the read below finds out how
        timeout = REQUEST_TIMEOUT_S + SECONDS_PER_TOKEN * (len(prompt_ids) + max_new_tokens)
        reply = self._reply(timeout)
        if "error" in reply:
            raise LlamaCppError(str(reply["error"]))
        try:
            return [int(t) for t in reply["token_ids"]], float(reply["wall_s"])
        except (KeyError, TypeError, ValueError):
            self.close()
            self._fail(f"worker wrote an unexpected reply: {one_line(str(reply)[:120])}")

    def close(self) -> None:
        """End the worker (end of its stdin; killed if it does not go within a few seconds) and its pipes."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout, self._stderr):
            with contextlib.suppress(OSError):
                f.close()
        self.dead = self.dead or "worker closed"  # keeps the first reason

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ the pipe

    def _reply(self, timeout_s: float, during: str = "") -> dict[str, Any]:
        """The worker's next JSON line; a death, a timeout or a garbled line raises ``LlamaCppError``."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._proc.kill()
                self._proc.wait()
                self._fail(f"worker timed out after {timeout_s:.0f} s" + (f" {during}" if during else ""))
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._fail(self._death(during))
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            reply = None
        if not isinstance(reply, dict):
            self._proc.kill()
            self._proc.wait()
            self._fail(
                f"worker wrote a line that is not a reply: {one_line(line[:120].decode(errors='replace'))}"
            )
        return reply

    def _death(self, during: str) -> str:
        """Why the worker's stdout ended: its signal or exit code, and its last line on stderr."""
        try:
            rc = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            rc = self._proc.wait()
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = "unknown signal"
            why = f"worker crashed (signal {-rc}, {name})"
        else:
            why = f"worker exited with code {rc}"
        why += f" {during}" if during else ""
        last = self._last_stderr_line()
        return f"{why}; its last words: {last}" if last else why

    def _last_stderr_line(self) -> str:
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 4096))
            lines = [s for s in self._stderr.read().decode(errors="replace").splitlines() if s.strip()]
        except (OSError, ValueError):
            return ""
        return one_line(lines[-1])[:200] if lines else ""

    def _fail(self, why: str) -> NoReturn:
        self.dead = why
        raise LlamaCppError(why)


def runner_for(loaded: Any, gguf: str | Path | None = None, *, n_ctx: int | None = None) -> LlamaCppRunner:
    """A worker for ``loaded``'s eos ids, on ``gguf`` (default: the embedded model's GGUF), with a context of
    ``n_ctx`` tokens (default: the model's)."""
    from env.target import eos_ids

    return LlamaCppRunner(gguf_of(loaded.model_id, gguf), eos_ids(loaded), n_ctx=n_ctx or loaded.max_context)


# ------------------------------------------------------------------------------------------------ the worker


def decode(llm: Any, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy decoding with llama-cpp-python: (new token ids, seconds from submitting the prompt to the last
    token). ``reset`` first: the whole prompt is evaluated, as our methods evaluate it."""
    llm.reset()
    out: list[int] = []
    t0 = time.perf_counter()
    # temp 0: llama.cpp's greedy sampler; repeat_penalty 1.0: none (a generate default elsewhere is 1.1)
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token in eos or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


class _Parser(argparse.ArgumentParser):
    """The worker's arguments (standard library only: it runs where the package's dependencies may be missing);
    an error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def _count(high: int) -> Any:
    """An argparse type: an integer in 1..``high``."""

    def parse(text: str) -> int:
        digits = text.strip()
        if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [1, {high}], got {text[:40]!r}")
        return int(digits)

    return parse


def _ids(text: str) -> set[int]:
    """An argparse type: a comma list of token ids (non-negative integers), possibly empty."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isascii() and t.isdigit() and len(t) < 12 for t in items):
        raise argparse.ArgumentTypeError(f"must be a comma list of token ids, got {text[:40]!r}")
    return {int(t) for t in items}


def _request(line: str, n_vocab: int) -> tuple[list[int], int]:
    """A request line's prompt ids and new-token count; ``ValueError`` for a line that is none (ids that are not
    integers of the vocabulary, a count that is no positive integer: Infinity overflowed, 1e30 or -5 reached the
    C library)."""
    req = json.loads(line)
    if not isinstance(req, dict):
        raise ValueError("not an object")
    ids, n = req.get("prompt_ids"), req.get("max_new_tokens")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < n_vocab for t in ids):
        raise ValueError(f"prompt_ids is not a list of token ids below {n_vocab}")
    if type(n) is not int or n < 1:
        raise ValueError("max_new_tokens is not a positive integer")
    return ids, n


def serve(argv: list[str] | None = None) -> int:
    """The worker: load the GGUF, warm up, say ready, then answer one request per stdin line."""
    p = _Parser(prog="python -m experiments.llama_cpp", allow_abbrev=False)
    p.add_argument("--gguf", required=True)
    p.add_argument("--n-ctx", type=_count(1 << 24), required=True)
    p.add_argument("--n-threads", type=_count(4096), default=os.cpu_count() or 1)
    p.add_argument("--eos", type=_ids, default=set(), help="comma list of end-of-sequence ids")
    args = p.parse_args(argv)
    allocator: dict[str, Any] = {}
    # the allocator our engine runs under in the parent, for a like-for-like comparison (a bad DRAFTGYM_MALLOC: the
    # parent refused it when it loaded the target; a worker that cannot import the package reports none)
    with contextlib.suppress(ImportError, ValueError):
        from env.allocator import allocator_state, settle_allocator

        settle_allocator()
        allocator = allocator_state()
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything else written to stdout (the C library's prints) goes to stderr

    def say(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        import llama_cpp
    except ImportError as err:
        if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "llama_cpp":
            say({"error": f"not installed: {INSTALL_HINT}"})
        else:
            say({"error": f"cannot import llama_cpp ({one_line(err)}); reinstall it: {INSTALL_HINT}"})
        return 3
    try:
        llm = llama_cpp.Llama(
            model_path=args.gguf,
            n_ctx=args.n_ctx,
            n_threads=args.n_threads,
            n_threads_batch=args.n_threads,
            logits_all=False,
            verbose=False,
        )
    except (ValueError, RuntimeError, OSError) as err:
        say({"error": f"cannot load {args.gguf}: {one_line(err)}"})
        return 4
    eos, n_ctx, n_vocab = args.eos, llm.n_ctx(), llm.n_vocab()
    decode(llm, list(range(1, 17)), 4, set())  # untimed: the first decode pays for lazy initialisation
    say({"ready": True, "version": llama_cpp.__version__, "n_ctx": n_ctx, "n_threads": args.n_threads,
         **allocator})  # fmt: skip
    for line in sys.stdin:
        try:
            ids, n = _request(line, n_vocab)
        except (ValueError, RecursionError) as err:
            say({"error": f"bad request ({one_line(err)}): {one_line(line[:120])}"})
            continue
        if not ids or len(ids) >= n_ctx:
            say(
                {
                    "error": f"a request of {len(ids)} prompt tokens and {n} new ones; "
                    f"the worker's n_ctx is {n_ctx}"
                }
            )
            continue
        token_ids, wall = decode(llm, ids, min(n, n_ctx - len(ids)), eos)
        say({"token_ids": token_ids, "wall_s": wall})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
