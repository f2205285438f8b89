"""A model folder naming code of its own (``auto_map``) runs none of it: transformers asked on the terminal whether to
run the folder's Python file and ran it on "y" (a run folder's ``bench.json`` names its model, so ``agreement`` read
one from a file too). Refused in one line, whatever stdin answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _evil_folder(tmp_path: Path, config_map: bool) -> tuple[Path, Path]:
    marker = tmp_path / "PWNED"
    folder = tmp_path / "evil"
    folder.mkdir()
    auto = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM",
            "AutoTokenizer": ["evil.EvilTok", None]}  # fmt: skip
    config = {"architectures": ["EvilForCausalLM"], "model_type": "llama" if not config_map else "evil",
              "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
              "intermediate_size": 8, "max_position_embeddings": 64}  # fmt: skip
    if config_map:
        config["auto_map"] = auto
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTok", None]}, "tokenizer_class": "EvilTok"})
    )
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder, marker


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], input="y\ny\ny\ny\n", capture_output=True, text=True, cwd=cwd, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(cwd), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


def test_a_config_naming_custom_code_is_refused_before_any_is_run(tmp_path):
    folder, marker = _evil_folder(tmp_path, config_map=True)
    r = _run(
        ["-m", "experiments", "generate", "hi", "--model", str(folder), "--max-new-tokens", "2"], tmp_path
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "names custom code (auto_map)" in r.stderr and "Traceback" not in r.stderr
    assert "custom code" not in r.stdout  # (transformers' question was printed there)
    assert not marker.exists()


def test_a_tokenizer_naming_custom_code_runs_none_of_it(tmp_path):
    """The tokenizer alone (its config's auto_map), loaded as the engines load it: no question, no code."""
    folder, marker = _evil_folder(tmp_path, config_map=False)
    code = (
        "import sys; from pathlib import Path; from env.tokenizer import folder_tokenizer\n"
        "try:\n    folder_tokenizer(Path(sys.argv[1]))\nexcept Exception as err:\n    print(type(err).__name__, err)\n"
    )
    r = _run(["-c", code, str(folder)], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ModelError"), r.stdout[-2000:]
    assert "[y/N]" not in r.stdout
    assert not marker.exists()


def test_a_known_model_type_naming_code_loads_as_that_type(tmp_path):
    """transformers loads a type it knows as that type, its ``auto_map`` unused (with trust_remote_code=False):
    such a folder is no custom code to refuse; an unknown type, or none, is."""
    import pytest

    from env.model import ModelError
    from env.model_checks import check_no_code

    auto = {"AutoModelForCausalLM": "evil.EvilForCausalLM"}
    check_no_code(tmp_path, {"model_type": "llama", "auto_map": auto})
    check_no_code(tmp_path, {"model_type": "evil"})
    for kind in ("evil", None, ["llama"]):
        with pytest.raises(ModelError, match="names custom code"):
            check_no_code(tmp_path, {"model_type": kind, "auto_map": auto})
