"""Files are read as data: a crafted policy file, stable-baselines3 zip or training checkpoint cannot run code at
load (its pickles are never unpickled; the marker file a payload would create stays absent), a plain
stable-baselines3 ``model.save`` zip loads through ``load_policy`` and acts as its ``predict``, a draftgym sb3
policy round-trips, and ``train_sb3`` leaves the process's torch thread count as it found it."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from policies import PolicyError, load_policy
from policies.rl import SB3Policy
from policies.rl_train import train_sb3
from policies.sb3_checkpoints import read_checkpoint, save_checkpoint
from tests.hostile import Creates as Payload  # unpickles into open(marker, "w")
from tests.policies.synthetic import SYNTH_ARMS
from tests.policies.test_rl import SMALL, make_venv

ROOT = Path(__file__).resolve().parents[2]


def pickled(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_pickled(marker: Path) -> bytes:
    """A ``torch.save`` file (what ``policy.pth`` is) holding the payload next to a tensor."""
    buf = io.BytesIO()
    torch.save({"action_net.weight": torch.zeros(2, 2), "evil": Payload(marker)}, buf)
    return buf.getvalue()


def test_the_payloads_are_live(tmp_path):
    """Sanity check of the tests below: unpickling these payloads does create the marker."""
    a, b = tmp_path / "a", tmp_path / "b"
    pickle.loads(pickled(a)).close()
    torch.load(io.BytesIO(torch_pickled(b)), weights_only=False)["evil"].close()  # what weights_only prevents
    assert a.exists() and b.exists()


def read_zip(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def write_zip(path: Path, items: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in items.items():
            zf.writestr(name, data)


def hostile_sb3_zip(src: Path, dst: Path, marker: Path, policy_pth: bytes | None = None) -> Path:
    """``src`` with every ``:serialized:`` entry of ``data`` replaced by the payload (what stable-baselines3's
    ``load`` would unpickle), and optionally another ``policy.pth``."""
    items = read_zip(src)
    data = json.loads(items["data"])
    evil = base64.b64encode(pickled(marker)).decode()
    replaced = 0
    for value in data.values():
        if isinstance(value, dict) and ":serialized:" in value:
            value[":serialized:"] = evil
            replaced += 1
    assert replaced >= 5  # policy_class, spaces, schedules, buffers...
    items["data"] = json.dumps(data).encode()
    if policy_pth is not None:
        items["policy.pth"] = policy_pth
    write_zip(dst, items)
    return dst


# ---- plain stable-baselines3 zips (model.save of a model trained on the default env) ----------------------------


@pytest.fixture(scope="module")
def default_env():
    import gymnasium

    import env  # noqa: F401  (registers draftgym/SpecDecode-v0)

    return gymnasium.make("draftgym/SpecDecode-v0")


PLAIN = {
    "ppo": ("PPO", {"n_steps": 64, "batch_size": 32, "n_epochs": 1}),
    "dqn": ("DQN", {"learning_starts": 16, "buffer_size": 500}),
    "a2c": ("A2C", {}),
    "ppo-relu-pi32-vf16x8": (
        "PPO",
        {
            "n_steps": 64,
            "batch_size": 32,
            "n_epochs": 1,
            "policy_kwargs": {"net_arch": {"pi": [32], "vf": [16, 8]}, "activation_fn": torch.nn.ReLU},
        },
    ),  # fmt: skip
}


def quiet(model):
    """``model`` logging nowhere: else each ``learn`` leaves an empty SB3-<date> folder in the temp dir."""
    from stable_baselines3.common.logger import Logger

    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


@pytest.fixture(scope="module")
def plain(default_env, tmp_path_factory):
    """name -> (path of the model.save zip, the model)."""
    import stable_baselines3 as sb3

    d = tmp_path_factory.mktemp("plain")
    out = {}
    for name, (cls, kwargs) in PLAIN.items():
        model = quiet(getattr(sb3, cls)("MlpPolicy", default_env, seed=0, device="cpu", **kwargs)).learn(96)
        model.save(d / f"{name}.zip")
        out[name] = (d / f"{name}.zip", model)
    return out


def random_obs(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, size)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_plain_sb3_zip_acts_as_its_predict(plain, default_env, name):
    path, model = plain[name]
    u = default_env.unwrapped
    policy = load_policy(path)  # no menu given: the default env's
    assert policy.arm_names == u.arm_names and policy.features == u.feature_names
    assert policy.meta["feature_spec"] == u.feature_spec.as_dict() and policy.algo == name[:3]
    obs = random_obs(300, len(u.feature_names))
    expected = model.predict(obs, deterministic=True)[0]
    assert len(set(expected.tolist())) > 1  # the comparison means something: not one constant action
    assert np.array_equal(policy.act_batch(obs), expected)
    assert [policy.act(o) for o in obs] == expected.tolist()
    again = load_policy(path, arms=u.arm_names, obs_size=len(u.feature_names))
    assert np.array_equal(again.act_batch(obs), expected)


def test_the_architecture_is_read_from_the_weights(plain):
    p = load_policy(plain["ppo-relu-pi32-vf16x8"][0])
    assert (p.net_arch, p.vf_net_arch, p.activation) == ([32], [16, 8], "relu")
    assert (
        load_policy(plain["dqn"][0]).activation == "relu"
        and load_policy(plain["a2c"][0]).activation == "tanh"
    )


def test_a_plain_sb3_zip_for_another_menu_is_refused_in_one_line(plain, default_env):
    u = default_env.unwrapped
    path = plain["ppo"][0]
    with pytest.raises(PolicyError, match="has 7 actions, but this decoder/env has 5 arms") as err:
        load_policy(path, arms=u.arm_names[:5])
    assert "\n" not in str(err.value)
    with pytest.raises(PolicyError, match="observations of size 21, but this decoder/env gives 20") as err:
        load_policy(path, obs_size=20)
    assert "\n" not in str(err.value)


def test_a_plain_sb3_zip_of_another_env_is_refused_against_the_default_menu(synth_trace, tmp_path):
    from stable_baselines3 import PPO

    venv = make_venv(synth_trace, n_envs=1)
    quiet(PPO("MlpPolicy", venv, n_steps=16, batch_size=16, n_epochs=1, device="cpu")).learn(16).save(
        tmp_path / "s.zip"
    )
    with pytest.raises(
        PolicyError, match="has 5 actions, but the default env draftgym/SpecDecode-v0 has 7"
    ) as err:
        load_policy(tmp_path / "s.zip")
    assert "\n" not in str(err.value)
    p = load_policy(tmp_path / "s.zip", arms=SYNTH_ARMS)  # the env's own menu
    assert p.num_arms == 5


def test_serialized_entries_of_a_hostile_sb3_zip_are_never_unpickled(plain, default_env, tmp_path):
    path, model = plain["ppo"]
    marker = tmp_path / "pwned"
    bad = hostile_sb3_zip(path, tmp_path / "hostile.zip", marker)
    policy = load_policy(bad)  # the network is data: it loads, ignoring the pickles
    obs = random_obs(200, len(default_env.unwrapped.feature_names))
    assert np.array_equal(policy.act_batch(obs), model.predict(obs, deterministic=True)[0])
    assert not marker.exists()


@pytest.mark.filterwarnings("error")  # torch's warning of the pickle's protocol is not printed either
@pytest.mark.parametrize("payload", [pickled, torch_pickled], ids=["pickle", "torch-save"])
def test_a_pickled_policy_pth_is_refused(plain, tmp_path, payload):
    """In one line of ours: torch's own text went on to suggest loading the file with ``weights_only=False``."""
    marker = tmp_path / "pwned"
    bad = hostile_sb3_zip(plain["ppo"][0], tmp_path / "hostile.zip", marker, policy_pth=payload(marker))
    with pytest.raises(PolicyError, match="policy.pth is not a plain tensor file") as err:
        load_policy(bad)
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value) and not marker.exists()


# ---- draftgym sb3 policy files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(synth_trace, synth_env):
    """algo -> a briefly trained SB3Policy on the synthetic env."""
    out = {}
    for algo in ("ppo", "dqn", "a2c"):
        p = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo=algo,
                      **SMALL[algo])  # fmt: skip
        p.build(make_venv(synth_trace, n_envs=2)).learn(160)
        out[algo] = p
    return out


@pytest.mark.parametrize("algo", ["ppo", "dqn", "a2c"])
def test_a_trained_sb3_policy_round_trips_as_tensors_and_json(trained, synth_env, tmp_path, algo):
    policy = trained[algo]
    path = tmp_path / f"{algo}.zip"
    policy.save(path)
    items = read_zip(path)
    assert set(items) == {"header.json", "network.json", "policy.safetensors"}
    assert json.loads(items["network.json"])["observation_shape"] == [len(synth_env.feature_names)]
    again = load_policy(path, arms=synth_env.arm_names, obs_size=len(synth_env.feature_names))
    obs = random_obs(300, len(synth_env.feature_names), seed=1)
    expected = policy.model.predict(obs, deterministic=True)[0]
    assert np.array_equal(again.act_batch(obs), expected)
    assert np.array_equal(again.model.predict(obs, deterministic=True)[0], expected)
    for key, value in policy.model.policy.state_dict().items():
        assert torch.equal(again.model.policy.state_dict()[key], value), key


def with_member(path: Path, name: str, data: bytes, dst: Path) -> Path:
    """``path`` with member ``name`` replaced, its checksum in header.json updated (a forger can do that)."""
    items = read_zip(path)
    header = json.loads(items["header.json"])
    header["payload"][name] = hashlib.sha256(data).hexdigest()
    items["header.json"], items[name] = json.dumps(header).encode(), data
    write_zip(dst, items)
    return dst


@pytest.mark.parametrize("payload", [pickled, torch_pickled], ids=["pickle", "torch-save"])
def test_a_hostile_tensor_member_is_refused(trained, tmp_path, payload):
    good = tmp_path / "good.zip"
    trained["ppo"].save(good)
    marker = tmp_path / "pwned"
    bad = with_member(good, "policy.safetensors", payload(marker), tmp_path / "bad.zip")
    with pytest.raises(PolicyError, match="not a safetensors file") as err:
        load_policy(bad)
    assert "\n" not in str(err.value) and not marker.exists()


def test_an_old_file_with_a_hostile_model_zip_is_read_as_data(plain, default_env, tmp_path):
    """Files of earlier versions carry stable-baselines3's model.zip: read like a plain zip, pickles ignored."""
    path, model = plain["ppo"]
    u = default_env.unwrapped
    marker = tmp_path / "pwned"
    inner = hostile_sb3_zip(path, tmp_path / "inner.zip", marker).read_bytes()
    good = tmp_path / "new.zip"
    load_policy(path).save(good)
    items = read_zip(good)
    header = json.loads(items["header.json"])
    header["payload"] = {"model.zip": hashlib.sha256(inner).hexdigest()}
    write_zip(tmp_path / "old.zip", {"header.json": json.dumps(header).encode(), "model.zip": inner})
    old = load_policy(tmp_path / "old.zip", arms=u.arm_names)
    obs = random_obs(200, len(u.feature_names))
    assert np.array_equal(old.act_batch(obs), model.predict(obs, deterministic=True)[0])
    assert not marker.exists()


def test_the_shipped_rl_policies_are_tensors():
    for name in ("ppo", "dqn", "a2c"):
        path = ROOT / "policies" / "data" / f"{name}.zip"
        assert set(read_zip(path)) == {"header.json", "network.json", "policy.safetensors"}
        assert load_policy(path).algo == name


# ---- training state ----------------------------------------------------------------------------------------------


def dqn_run(synth_trace, synth_env, out: Path, total: int = 320) -> SB3Policy:
    policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo="dqn",
                       **SMALL["dqn"])  # fmt: skip
    return train_sb3(policy, make_venv(synth_trace, n_envs=4), out, total_timesteps=total, eval_fn=lambda p: 1.0,
                     eval_freq=10**6, checkpoint_freq=128)  # fmt: skip


def test_a_dqn_checkpoint_holds_its_whole_training_state(synth_trace, synth_env, tmp_path):
    policy = dqn_run(synth_trace, synth_env, tmp_path / "run")
    ckpt = max(
        (tmp_path / "run" / "checkpoints").glob("model_*_steps.zip"), key=lambda p: int(p.name.split("_")[1])
    )  # the latest by step, not by name
    names = set(read_zip(ckpt))
    assert names == {"state.json", "policy.safetensors", "optimizer.pt", "replay_buffer.npz"}
    c = read_checkpoint(ckpt)
    assert c.counters["num_timesteps"] == int(re.search(r"_(\d+)_", ckpt.name).group(1))
    assert c.buffer_pos["pos"] > 0 and c.buffer["observations"].any()
    # a fresh model takes it all back (weights, optimizer moments, counters, replay buffer), and saves it again
    from policies.rl_train import _resume

    model = policy.build(make_venv(synth_trace, n_envs=4))
    _resume(policy, model, ckpt.parent)
    save_checkpoint(model, policy.network(), tmp_path / "again.zip")
    d = read_checkpoint(tmp_path / "again.zip")
    assert d.counters == c.counters and d.buffer_pos == c.buffer_pos
    assert all(np.array_equal(d.buffer[k], c.buffer[k]) for k in c.buffer)
    assert all(torch.equal(d.state[k], c.state[k]) for k in c.state)
    assert c.optimizer["state"] and c.optimizer["param_groups"] == d.optimizer["param_groups"]
    for i, moments in c.optimizer["state"].items():
        assert all(torch.equal(v, d.optimizer["state"][i][k]) for k, v in moments.items())


def hostile_checkpoints(src: Path, dst: Path, marker: Path) -> None:
    """Copy the checkpoints of ``src`` into ``dst`` with their optimizer state or replay buffer made pickles."""
    dst.mkdir(parents=True)
    ckpts = sorted(src.glob("model_*_steps.zip"), key=lambda p: int(p.name.split("_")[1]))
    evil_npz = io.BytesIO()
    np.savez(evil_npz, observations=np.array([Payload(marker)], dtype=object))  # an object array is a pickle
    for path, (member, data) in zip(ckpts, [("optimizer.pt", torch_pickled(marker)),
                                            ("replay_buffer.npz", evil_npz.getvalue())]):  # fmt: skip
        items = read_zip(path)
        items[member] = data
        write_zip(dst / path.name, items)


def test_hostile_checkpoints_are_not_unpickled_on_resume(synth_trace, synth_env, tmp_path):
    dqn_run(synth_trace, synth_env, tmp_path / "good")
    src = tmp_path / "good" / "checkpoints"
    assert len(list(src.glob("model_*_steps.zip"))) == 2
    # control: a copy of the readable checkpoints resumes (its first evaluation is at the checkpoint's step)
    ctrl = tmp_path / "ctrl" / "checkpoints"
    ctrl.mkdir(parents=True)
    for p in src.iterdir():
        (ctrl / p.name).write_bytes(p.read_bytes())
    dqn_run(synth_trace, synth_env, tmp_path / "ctrl", total=384)
    first = json.loads((tmp_path / "ctrl" / "eval.jsonl").read_text().splitlines()[0])
    assert first["timesteps"] > 0
    marker = tmp_path / "pwned"
    hostile_checkpoints(src, tmp_path / "bad" / "checkpoints", marker)
    dqn_run(synth_trace, synth_env, tmp_path / "bad", total=384)
    first = json.loads((tmp_path / "bad" / "eval.jsonl").read_text().splitlines()[0])
    assert first["timesteps"] == 0  # both refused: trained afresh
    assert not marker.exists()


def test_train_sb3_leaves_the_thread_count_as_it_was(synth_trace, synth_env, tmp_path):
    before = torch.get_num_threads()
    mine = 3 if before != 3 else 2
    torch.set_num_threads(mine)
    try:
        policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), algo="a2c", **SMALL["a2c"])
        train_sb3(policy, make_venv(synth_trace, n_envs=2), tmp_path / "ok", total_timesteps=32,
                  eval_fn=lambda p: 1.0, eval_freq=10**6, checkpoint_freq=10**6)  # fmt: skip
        assert torch.get_num_threads() == mine

        def boom(p):
            raise RuntimeError("eval failed")

        with pytest.raises(RuntimeError, match="eval failed"):
            train_sb3(policy, make_venv(synth_trace, n_envs=2), tmp_path / "boom", total_timesteps=32,
                      eval_fn=boom, eval_freq=10**6, checkpoint_freq=10**6)  # fmt: skip
        assert torch.get_num_threads() == mine
    finally:
        torch.set_num_threads(before)


def test_no_module_of_policies_unpickles():
    banned = re.compile(
        r"^\s*(import|from) \w*pickle|pickle\.|load_replay_buffer|weights_only\s*=\s*False|allow_pickle\s*=\s*True"
        r"|\b(PPO|DQN|A2C|cls|algo_class\(.*\))\.load\("
    )
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for path in sorted((ROOT / "policies").glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert not hits, hits


# ---- generate --policy with a plain stable-baselines3 zip --------------------------------------------------------


@pytest.mark.model
def test_generate_runs_a_plain_sb3_zip_with_the_default_menu(plain, default_env, fp32_model):
    """``policy_decoder`` is what ``generate --policy`` and ``bench --policy`` build."""
    from env.decoder import SpeculativeDecoder
    from env.engine import NO_DRAFT
    from experiments.policy_commands import policy_decoder

    u = default_env.unwrapped
    dec = policy_decoder(fp32_model, str(plain["ppo"][0]))
    assert tuple(a.name for a in dec.arms) == u.arm_names and tuple(dec.feature_names) == u.feature_names
    prompt = "Summarize: the cat sat on the mat. The cat sat on the mat."
    g = dec.generate(prompt, max_new_tokens=16)
    assert (
        g.token_ids
        == SpeculativeDecoder(fp32_model, [NO_DRAFT]).generate(prompt, max_new_tokens=16).token_ids
    )
    assert set(g.arms) <= set(u.arm_names)


def test_a_pickled_tensor_file_is_refused_in_our_words_and_without_torchs_warning(tmp_path):
    """torch warned of the pickle's protocol on stderr (a second line at the command line), and its message, cut
    to a line, ended by suggesting ``torch.load`` with its check turned off."""
    import warnings

    from policies.sb3_files import read_torch_tensors

    marker = tmp_path / "pwned"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(
            PolicyError, match="holds objects other than tensors, which draftgym never"
        ) as err:
            read_torch_tensors(torch_pickled(marker), "policy.pth")
    assert not seen, [str(w.message) for w in seen]
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value) and not marker.exists()
