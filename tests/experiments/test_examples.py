"""Every example config runs, with a tiny budget (smoke tests, the cleanrl way): 1-2 prompts, 8 new tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import load_config
from experiments.records import load_done
from experiments.runner import check_results, run, select_prompts

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"
TINY = ["workload.per_category=0", "workload.limit=1", "decode.max_new_tokens=8", "model.dtype=fp32"]

pytestmark = pytest.mark.model


@pytest.mark.parametrize("name", ["benchmark.toml", "bandit.toml"])
def test_run_examples(name, tmp_path, fp32_model):
    cfg = load_config(CONFIGS / name, sets=TINY)
    result = run(cfg, tmp_path / "run", progress=False, loaded=fp32_model)
    records = load_done(tmp_path / "run" / "records.jsonl")
    assert check_results(records, select_prompts(cfg), list(cfg.methods)) == []
    ar = next(r for r in records if r.method == "ar")
    for r in records:  # greedy: every method commits the tokens of our AR loop
        assert r.token_ids == ar.token_ids, r.method
    assert {row["method"] for row in result["summary"]} == set(cfg.methods)
    if name == "bandit.toml":  # the online policies chose arms and saved their state for a resumed run
        assert (tmp_path / "run" / "policies" / "ucb.zip").is_file()
        assert {a for r in records if r.method == "policy:ucb" for a in r.arms} <= set(
            cfg.policies["ucb"].arms
        )


def test_tree_sweep_example(tmp_path):
    sets = [*TINY, "sweep.n_trials=2"]
    cmd = [
        sys.executable,
        "-m",
        "experiments",
        "sweep",
        str(CONFIGS / "tree_sweep.toml"),
        "--out",
        str(tmp_path),
    ]
    r = subprocess.run([*cmd, *(a for s in sets for a in ("--set", s)), "--json"], capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr
    best = load_config(tmp_path / "best.toml")
    assert best.decode.max_new_tokens == 8 and best.methods[0] == "ar"  # --set wins over the trial


def test_ppo_example_trains_then_runs_live(tmp_path, fp32_model):
    from env.trace import default_trace_path

    if not default_trace_path().is_file():
        pytest.skip(f"no bundled replay trace yet ({default_trace_path()}): ppo.toml trains on it")
    tiny = ["policies.ppo.train.total_timesteps=64", "policies.ppo.train.n_envs=2", "policies.ppo.params.n_steps=16",
            "policies.ppo.params.batch_size=16", "policies.ppo.train.eval_freq=32",
            "policies.ppo.train.checkpoint_freq=32"]  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "experiments",
        "train",
        str(CONFIGS / "ppo.toml"),
        "--out",
        str(tmp_path),
        "--json",
    ]
    r = subprocess.run(
        [*cmd, *(a for s in tiny for a in ("--set", s))], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "policies" / "ppo.zip").is_file()
    cfg = load_config(CONFIGS / "ppo.toml", sets=[*TINY, *tiny])
    run(cfg, tmp_path, progress=False, loaded=fp32_model)  # the same directory: the trained policy, live
    records = load_done(tmp_path / "records.jsonl")
    assert check_results(records, select_prompts(cfg), list(cfg.methods)) == []
    assert {a for r in records if r.method == "policy:ppo" for a in r.arms} <= set(cfg.policies["ppo"].arms)
