"""The llama_cpp baseline (``experiments.llama_cpp``): its worker decodes greedily, and a worker that cannot run
(not installed, a corrupted GGUF, killed by a signal) is one line of the bench table while the run goes on.

The tests that decode need llama-cpp-python (``pip install 'draftgym[llama]'``) and skip without it; the failure
tests run everywhere: without the extra, the failure is "not installed".
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench import format_table, run_bench
from experiments.cli import main
from experiments.config import ConfigError, load_config
from experiments.llama_cpp import INSTALL_HINT, LlamaCppError, LlamaCppRunner
from experiments.records import load_done

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
REPO = Path(__file__).resolve().parents[2]
# One llama.cpp thread in tests: its threads spin at barriers, and on a shared machine with fewer free cores
# than threads that spinning costs minutes (the benchmark itself uses every core).


@pytest.fixture(scope="module")
def gguf() -> Path:
    from env.model import embedded_gguf_path

    return embedded_gguf_path()


@pytest.fixture
def truncated_gguf(tmp_path: Path, gguf: Path) -> Path:
    """The embedded GGUF cut after 1 MB: a valid header, most tensors missing."""
    path = tmp_path / "truncated.gguf"
    with gguf.open("rb") as src:
        path.write_bytes(src.read(1 << 20))
    return path


def greedy_reference(gguf: Path, prompt_ids: list[int], n: int, eos: int) -> list[int]:
    """Greedy decoding written out, in this process: the argmax of llama.cpp's logits, token after token."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    llm.eval(prompt_ids)
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != eos):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


@needs_llama_cpp
@pytest.mark.model
def test_worker_decodes_greedily_and_stops_at_eos(fp32_model, gguf):
    from env.decoder import chat_prompt
    from env.target import eos_ids

    ids = chat_prompt(fp32_model.tokenizer, "Write a haiku about the sea.")
    (eos,) = eos_ids(fp32_model)
    with LlamaCppRunner(gguf, eos_ids(fp32_model), n_ctx=256, n_threads=1) as runner:
        assert runner.info["n_ctx"] >= 256 and runner.info["version"]
        out, wall = runner.run(ids, 64)
        again, _ = runner.run(ids, 64)  # the cache is reset: no reuse of the previous prompt's state
        short, _ = runner.run(ids, 5)
    assert out == greedy_reference(gguf, ids, 64, eos)  # no temperature, no repeat penalty
    assert out[-1] == eos and len(out) < 64  # the haiku ends before 64 tokens, its eos kept
    assert again == out and short == out[:5]
    assert wall > 0  # a time was measured (how long is the benchmark's to say, not a test's)


@needs_llama_cpp
def test_worker_killed_by_a_signal_is_one_error_and_stays_dead(gguf):
    runner = LlamaCppRunner(gguf, [2], n_ctx=64, n_threads=1)
    assert runner.run([1, 9690, 198], 2)[0]
    os.kill(runner.pid, signal.SIGSEGV)
    for _ in range(2):
        with pytest.raises(LlamaCppError, match=r"worker crashed \(signal 11, SIGSEGV\)"):
            runner.run([1, 9690, 198], 2)
    runner.close()


def test_worker_without_llama_cpp_says_not_installed(tmp_path):
    """``python -S``: no site-packages, so llama_cpp cannot be imported (experiments comes from PYTHONPATH)."""
    worker = [sys.executable, "-S", "-m", "experiments.llama_cpp"]
    proc = subprocess.run(
        [*worker, "--gguf", str(tmp_path / "x.gguf"), "--n-ctx", "64"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout) == {"error": f"not installed: {INSTALL_HINT}"}


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--n-ctx", "-5"], "argument --n-ctx: must be an integer in [1, 16777216], got '-5'"),
        (["--n-ctx", "64", "--n-threads", "0"], "argument --n-threads: must be an integer in [1, 4096]"),
        (
            ["--n-ctx", "64", "--eos", "x"],
            "argument --eos: must be a comma list of token ids, got 'x'",
        ),  # traceback
        ([], "the following arguments are required: --n-ctx"),  # was three lines of usage
    ],
)
def test_worker_arguments_are_one_line_and_exit_2(tmp_path, args, needle):
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "experiments.llama_cpp", "--gguf", str(tmp_path / "x.gguf"), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


STUB = """
__version__ = "stub"
class Llama:
    def __init__(self, model_path, n_ctx, **kw):
        self._n_ctx = n_ctx
    def n_ctx(self):
        return self._n_ctx
    def n_vocab(self):
        return 100
    def reset(self):
        pass
    def generate(self, ids, **kw):
        assert all(type(t) is int and 0 <= t < 100 for t in ids), ids  # what the C library would crash on
        while True:
            yield 7
"""


def test_worker_answers_a_bad_request_with_an_error_line_and_lives_on(tmp_path):
    """Requests the C library would have been given as they were (ids -5, 1e30, true, past the vocabulary, a string
    as the prompt) or that killed the worker (Infinity new tokens: an OverflowError) get an error line each; a good
    request after them is answered. ``llama_cpp`` is a stub here: the worker's own checks are under test."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(STUB)
    bad = [
        '{"prompt_ids": [1, 2], "max_new_tokens": Infinity}',
        '{"prompt_ids": [1, -5], "max_new_tokens": 3}',
        '{"prompt_ids": [1, 1e30], "max_new_tokens": 3}',
        '{"prompt_ids": [true], "max_new_tokens": 3}',
        '{"prompt_ids": [100], "max_new_tokens": 3}',
        '{"prompt_ids": "12", "max_new_tokens": 3}',
        '{"prompt_ids": [1], "max_new_tokens": 0}',
        "[1, 2]",
    ]
    good = '{"prompt_ids": [1, 2], "max_new_tokens": 3}'
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "experiments.llama_cpp", "--gguf", "x.gguf", "--n-ctx", "64", "--eos", "9"],
        input="\n".join([*bad, good]) + "\n", env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert replies[0]["ready"] is True and len(replies) == len(bad) + 2, replies
    assert all(r.get("error", "").startswith("bad request (") for r in replies[1:-1]), replies
    assert replies[-1]["token_ids"] == [7, 7, 7]


def test_corrupted_gguf_fails_in_one_line(truncated_gguf):
    with pytest.raises(LlamaCppError) as err:
        LlamaCppRunner(truncated_gguf, [2], n_ctx=64)
    expected = f"cannot load {truncated_gguf}" if HAS_LLAMA_CPP else f"not installed: {INSTALL_HINT}"
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


@pytest.mark.model
def test_bench_with_a_worker_that_cannot_start_finishes(tmp_path, truncated_gguf, capsys):
    out = tmp_path / "run"
    argv = ["bench", "--methods", "ar,llama_cpp", "--limit", "1", "--max-new-tokens", "8", "--out", str(out)]
    argv += ["--llama-cpp-gguf", str(truncated_gguf), "--dtype", "fp32", "--device", "cpu"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if "llama_cpp" in line]
    assert len(failed) == 1, lines
    why = "cannot load" if HAS_LLAMA_CPP else "not installed"
    assert failed[0].startswith(f"llama_cpp failed: {why}") and "1 of 1 prompts not run" in failed[0]
    records = load_done(out / "records.jsonl")
    assert [r.method for r in records] == ["ar"] and 1 <= records[0].new_tokens <= 8
    bench = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in bench["summary"]] == ["ar", "ar"]  # its category and overall
    assert list(bench["failures"]) == ["llama_cpp"]


@needs_llama_cpp
@pytest.mark.model
def test_bench_with_a_worker_that_dies_keeps_the_other_methods(tmp_path, fp32_model, gguf):
    from env.workloads import load_workload

    prompts = load_workload(None)[:2]
    runner = LlamaCppRunner(gguf, [2], n_ctx=512, n_threads=1)
    os.kill(runner.pid, signal.SIGKILL)
    result = run_bench(
        fp32_model,
        prompts,
        ["ar", "llama_cpp"],
        max_new_tokens=4,
        out_dir=tmp_path,
        settings={},
        progress=False,
        decoders={"llama_cpp": runner},
    )
    runner.close()
    first = prompts[0].prompt_id  # prompt 0 runs ar first, then llama_cpp, whose worker is gone
    assert result["failures"] == {
        "llama_cpp": f"worker crashed (signal 9, SIGKILL) on prompt {first}; 2 of 2 prompts not run "
        "(a re-run with the same --out retries them)"
    }
    records = load_done(tmp_path / "records.jsonl")
    assert sorted(r.prompt_id for r in records if r.method == "ar") == sorted(p.prompt_id for p in prompts)
    table = format_table(result["summary"], result["failures"])
    assert sum("llama_cpp" in line for line in table.splitlines()) == 1


def test_bench_refuses_llama_cpp_on_a_model_folder_before_loading(tmp_path, capsys):
    argv = ["bench", "--methods", "ar,llama_cpp", "--model", str(tmp_path), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pass --llama-cpp-gguf PATH" in err
    assert main(["bench", "--methods", "ar", "--llama-cpp-gguf", "x.gguf", "--out", str(tmp_path)]) == 2
    assert "which --methods does not list" in capsys.readouterr().err


def test_config_accepts_llama_cpp_greedy_on_the_embedded_model_only():
    assert load_config(None, text='methods = ["ar", "llama_cpp"]').methods == ("ar", "llama_cpp")
    with pytest.raises(ConfigError, match="only runs greedy"):
        load_config(None, text='methods = ["llama_cpp"]\n[decode]\ntemperature = 0.7')
    with pytest.raises(ConfigError, match="--llama-cpp-gguf"):
        load_config(None, text='methods = ["llama_cpp"]\n[model]\nname = "some/folder"')
