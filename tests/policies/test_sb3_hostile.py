"""Hostile stable-baselines3 files and training state are refused in one line (``PolicyError``), never a
traceback, a hang or GBs of memory: a ``policy.pth`` whose records are compressed (torch would inflate them whole),
weights of the wrong dtype or not finite in float32, checkpoint metadata of the wrong type, an optimizer state of
the wrong shape or not finite, a replay buffer of NaN, a FIFO where a checkpoint should be, and training logs
holding Infinity or a 400-digit number."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from policies import PolicyError, load_policy
from policies.rl import SB3Policy
from policies.rl_train import _best_speedup, eval_rows, resume_model
from policies.sb3_checkpoints import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    apply_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from policies.sb3_files import read_sb3_zip, read_torch_tensors, torch_bytes
from tests.policies.test_rl import SMALL, make_venv
from tests.policies.test_safe_files import read_zip, with_member, write_zip

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PPO = ROOT / "policies" / "data" / "ppo.zip"


def deflated(obj: object) -> bytes:
    """``torch.save(obj)`` with its tensor records deflated: what torch's reader inflates whole, unchecked."""
    src = zipfile.ZipFile(io.BytesIO(torch_bytes(obj)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            z.writestr(info.filename, src.read(info), compress_type=method)
    return out.getvalue()


def shipped_state() -> dict[str, torch.Tensor]:
    return load_safetensors(read_zip(SHIPPED_PPO)["policy.safetensors"])


# ---- A: a policy.pth that would unpack to far more than the file ----------------------------------------------


def test_a_compressed_record_is_refused_before_torch_unpacks_it():
    state = shipped_state()
    assert read_torch_tensors(torch_bytes(state), "ok").keys() == state.keys()  # torch.save's own: stored
    with pytest.raises(PolicyError, match="record 'archive/data/0' is compressed"):
        read_torch_tensors(deflated(state), "policy.pth")
    with pytest.raises(PolicyError, match="is not a plain tensor file"):
        read_torch_tensors(b"not a zip at all", "policy.pth")


def test_an_sb3_zip_bomb_is_one_line_and_exit_2_at_the_cli(tmp_path):
    """16 MB of zeros deflate to a few KB inside policy.pth (a 1 GB one is as small, relatively)."""
    bomb = tmp_path / "bomb.zip"
    write_zip(bomb, {"policy.pth": deflated({"w": torch.zeros(4 << 20)}), "data": b"{}"})
    assert bomb.stat().st_size < 100_000
    r = subprocess.run([sys.executable, "-m", "experiments", "evaluate", str(bomb), "--no-live"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "is compressed" in lines[0], r.stderr


# ---- F: weights that are finite only before they are loaded, or not real numbers at all ---------------------------


@pytest.mark.parametrize(
    ("make", "needle"),
    [(lambda w: torch.full_like(w, 1e300, dtype=torch.float64), "infinite in float32"),
     (lambda w: torch.full(w.shape, complex(float("nan"), 0), dtype=torch.complex64), "complex64"),
     (lambda w: torch.ones(w.shape, dtype=torch.int32), "int32"),
     (lambda w: torch.zeros(1).expand(w.shape), "not a dense array")],
    ids=["float64-1e300", "complex-nan", "int", "stride-0-view"],
)  # fmt: skip
def test_weights_must_be_real_and_finite_as_float32(tmp_path, make, needle):
    state = shipped_state()
    state["action_net.weight"] = make(state["action_net.weight"])
    plain = write_zip_bytes({"policy.pth": torch_bytes(state), "data": b"{}"})
    with pytest.raises(PolicyError, match=needle):  # a plain stable-baselines3 zip's policy.pth
        read_sb3_zip(plain, "plain.zip")
    if state["action_net.weight"].is_contiguous():  # safetensors stores dense tensors only
        from safetensors.torch import save

        bad = with_member(SHIPPED_PPO, "policy.safetensors", save(state), tmp_path / "bad.zip")
        with pytest.raises(PolicyError, match=needle):  # a draftgym policy file
            load_policy(bad)


def write_zip_bytes(items: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)
    return buf.getvalue()


# ---- B: checkpoint metadata of the wrong type ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("network", 5, "network is int"), ("network", [1, 2], "network is list"),
     ("counters", "abc", "counters is str"), ("counters", {"num_timesteps": "7"}, "counter 'num_timesteps'"),
     ("counters", {"nonsense": 1}, "counter 'nonsense'")],
)  # fmt: skip
def test_checkpoint_metadata_of_the_wrong_type_is_a_policy_error(tmp_path, field, value, needle):
    path = tmp_path / "model_64_steps.zip"
    meta = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION, field: value}
    write_zip(path, {"state.json": json.dumps(meta).encode(), "policy.safetensors": b"",
                     "optimizer.pt": torch_bytes({"state": {}, "param_groups": []})})  # fmt: skip
    with pytest.raises(PolicyError, match=needle):
        read_checkpoint(path)


# ---- C: optimizer state and replay buffer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dqn_ckpt(synth_trace, synth_env, tmp_path_factory):
    """(policy, checkpoint path) of a DQN trained past its first updates: Adam's moments and a replay buffer."""
    policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo="dqn",
                       **SMALL["dqn"])  # fmt: skip
    model = policy.build(make_venv(synth_trace, n_envs=2)).learn(96)
    path = tmp_path_factory.mktemp("dqn") / "model_96_steps.zip"
    save_checkpoint(model, policy.network(), path)
    return policy, path


def edit_optimizer(opt: dict, how: str) -> None:
    st = opt["state"][0]
    if how == "shape":
        st["exp_avg"] = torch.zeros(3)
    elif how == "nan-moment":
        st["exp_avg_sq"] = torch.full_like(st["exp_avg_sq"], float("nan"))
    elif how == "huge-moment":  # finite in float64, infinite once cast to the parameter's float32
        st["exp_avg"] = torch.full_like(st["exp_avg"], 1e300, dtype=torch.float64)
    elif how == "negative-step":
        st["step"] = torch.tensor(-1.0)
    elif how == "nan-step":
        st["step"] = torch.tensor(float("nan"))
    elif how == "nan-eps":
        opt["param_groups"][0]["eps"] = float("nan")


def edit_buffer(arrays: dict[str, np.ndarray], how: str) -> None:
    if how == "nan-observation":
        arrays["observations"] = arrays["observations"].copy()
        arrays["observations"][0, 0, 0] = np.nan
    elif how == "huge-reward":  # float64 beyond float32's range: inf in the buffer
        arrays["rewards"] = np.full(arrays["rewards"].shape, 1e300)


@pytest.mark.parametrize(
    "how",
    [
        "shape",
        "nan-moment",
        "huge-moment",
        "negative-step",
        "nan-step",
        "nan-eps",
        "nan-observation",
        "huge-reward",
    ],
)
def test_a_corrupted_optimizer_state_or_replay_buffer_is_refused(dqn_ckpt, synth_trace, tmp_path, how):
    policy, good = dqn_ckpt
    items = read_zip(good)
    if how in ("nan-observation", "huge-reward"):
        with np.load(io.BytesIO(items["replay_buffer.npz"])) as npz:
            arrays = dict(npz)
        edit_buffer(arrays, how)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        items["replay_buffer.npz"] = buf.getvalue()
    else:
        opt = torch.load(io.BytesIO(items["optimizer.pt"]), weights_only=True)
        edit_optimizer(opt, how)
        items["optimizer.pt"] = torch_bytes(opt)
    bad = tmp_path / good.name
    write_zip(bad, items)
    model = policy.build(make_venv(synth_trace, n_envs=2))
    apply_checkpoint(model, read_checkpoint(good), policy.network(), str(good))  # control: the real one loads
    with pytest.raises(PolicyError, match="corrupted|replay buffer") as err:
        apply_checkpoint(model, read_checkpoint(bad), policy.network(), str(bad))
    assert "\n" not in str(err.value)


# ---- E: a FIFO named like a checkpoint -----------------------------------------------------------------------------


@pytest.mark.timeout(30)  # without the check, opening the FIFO blocks forever
def test_a_fifo_named_like_a_checkpoint_is_refused_not_opened(dqn_ckpt, synth_trace, tmp_path):
    policy, _ = dqn_ckpt
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    os.mkfifo(folder / "model_5000_steps.zip")
    with pytest.raises(PolicyError, match="not a regular file"):
        read_checkpoint(folder / "model_5000_steps.zip")
    model = policy.build(make_venv(synth_trace, n_envs=2))
    with pytest.raises(PolicyError, match="not a regular file"):
        resume_model(policy, model, folder)


# ---- D: training logs holding numbers that do not fit ------------------------------------------------------------


def test_eval_rows_skip_rows_of_infinite_or_overlong_numbers(tmp_path):
    log = tmp_path / "eval.jsonl"
    good = {"timesteps": 64, "wall_s": 1.0, "cpu_s": 1.0, "replay_speedup": 1.5}
    bad = [
        '{"timesteps": Infinity, "wall_s": 1, "cpu_s": 1, "replay_speedup": 1}',
        '{"timesteps": NaN, "wall_s": 1, "cpu_s": 1, "replay_speedup": 1}',
        '{"timesteps": 1, "wall_s": 1e400, "cpu_s": 1, "replay_speedup": 1}',
        '{"timesteps": 1, "wall_s": 1, "cpu_s": 1, "replay_speedup": 1' + "0" * 400 + "}",
        '{"timesteps": 1, "wall_s": 1, "cpu_s": 1, "replay_speedup": NaN}',
    ]
    log.write_text("\n".join([*bad, json.dumps(good)]) + "\n")
    assert eval_rows(log) == [good]


@pytest.mark.parametrize(
    "speedup",
    ["1" + "0" * 400, "Infinity", "NaN", '"1e999"', "true"],
    ids=["400-digits", "inf", "nan", "str", "bool"],
)
def test_best_speedup_of_a_number_that_does_not_fit_falls_back_to_the_rows(tmp_path, speedup):
    (tmp_path / "best.zip").write_bytes(b"x")
    (tmp_path / "best.json").write_text('{"timesteps": 5, "replay_speedup": ' + speedup + "}")
    rows = [{"timesteps": 5, "wall_s": 1.0, "cpu_s": 1.0, "replay_speedup": 1.25}]
    assert _best_speedup(tmp_path, rows) == 1.25
    (tmp_path / "best.json").write_text('{"timesteps": 5, "replay_speedup": 1.5}')
    assert _best_speedup(tmp_path, rows) == 1.5
