"""The ``draftgym`` process itself: one line and exit code 2 for a prompt longer than the context, and the documented
``generate --json`` fields (the bad-input suite runs in process: tests/experiments/test_bad_input*.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.mark.model
def test_prompt_longer_than_context():
    r = _run("generate", "-", "--raw", "--dtype", "fp32", stdin="word " * 9000)
    assert r.returncode == 2, r.stderr
    assert "context is 8192 tokens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.model
def test_generate_json_has_the_documented_fields():
    import json

    r = _run("generate", "Name three colors.", "--max-new-tokens", "8", "--dtype", "fp32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert set(out["stats"]) >= {"new_tokens", "steps", "tau", "tokens_per_s", "wall_s"}
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 8


def test_the_command_table_is_what_the_modules_register():
    """``draftgym CMD`` imports CMD's module alone, from ``COMMANDS``: it must name every subcommand's module and
    help as the modules register them (a new command, or a changed help line, fails here until it is listed)."""
    import importlib

    from experiments.cli import COMMAND_MODULES, COMMANDS, _Parser

    found = {}
    for module in COMMAND_MODULES:
        p = _Parser(prog="draftgym")
        sub = p.add_subparsers(dest="command", parser_class=_Parser)
        importlib.import_module(module).register(sub)
        for action in sub._choices_actions:
            found[action.dest] = (module, action.help)
    assert found == COMMANDS


def test_the_top_level_help_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; from experiments.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert "generate" in out.stdout and "serve-bench" in out.stdout


@pytest.mark.parametrize(
    "argv",
    [["run", ""], ["train", " "], ["evaluate", "--no-live", ""], ["report", ""], ["agreement", ""]],
    ids=["run", "train", "evaluate", "report", "agreement"],
)
def test_an_empty_path_argument_is_named_as_empty(argv, capsys):
    """An empty shell variable as the config, policy or folder was reported as the folder ``.`` ("config . is a
    directory")."""
    from experiments.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "an empty path" in err and err.count("\n") == 1 and " . " not in err, err


def test_a_dangling_link_as_the_output_folder_is_named_as_one(tmp_path):
    """It was refused as "cannot write there (File exists)"."""
    from experiments.args import output_dir
    from experiments.errors import UserError

    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match=r"is a symbolic link to .*gone, which does not exist"):
        output_dir(tmp_path / "out")
