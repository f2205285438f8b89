"""The code's layout as CONVENTIONS.md asks it: command modules import nothing back from the CLI, the CLI keeps no
mutable registry others append to, every third-party import is a declared dependency, and the README's commands
name files a user's clone has."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "drafters", "env", "policies", "experiments")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_command_module_imports_the_cli():
    bad = [
        p.name
        for p in (ROOT / "experiments").glob("*.py")
        if p.name not in ("cli.py", "__main__.py")
        and any(m == "experiments.cli" or m.startswith("experiments.cli.") for m in _imports(p))
    ]
    assert bad == []


@pytest.mark.parametrize(
    "module",
    sorted(__import__("experiments.cli", fromlist=["COMMAND_MODULES"]).COMMAND_MODULES),
)
def test_each_command_module_imports_on_its_own(module):
    code = f"import sys, {module} as m; m.register; assert 'experiments.cli' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_cli_keeps_no_mutable_registry():
    import experiments.cli as cli
    import experiments.errors as errors

    for mod in (cli, errors):
        shared = [
            k for k, v in vars(mod).items() if not k.startswith("__") and isinstance(v, (list, dict, set))
        ]
        assert shared == [], (mod.__name__, shared)


def _declared() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


# import name -> distribution name, where they differ
DIST = {
    "sklearn": "scikit-learn",
    "stable_baselines3": "stable-baselines3",
    "psycopg2": "psycopg2-binary",
    "llama_cpp": "llama-cpp-python",
}


def test_every_third_party_import_is_a_declared_dependency():
    used = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            used.update(m.split(".")[0] for m in _imports(path))
    third = {m for m in used if m not in sys.stdlib_module_names and m not in PACKAGES}
    missing = sorted(m for m in third if DIST.get(m, m).lower().replace("_", "-") not in _declared())
    assert missing == []


def test_readme_commands_name_no_path_outside_the_clone():
    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text and "../" not in re.sub(r"\]\([^)]*\)", "", text)
