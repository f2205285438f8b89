"""A DQN checkpoint without training: a full replay buffer comes back full, at its position; a position past the
buffer's end, an optimizer setting with a NaN inside a tuple (Adam's betas) and a checkpoint of another network are
refused in one line; a resume takes the newest checkpoint by step, or the one before when the newest is torn."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from policies import PolicyError
from policies.rl import SB3Policy
from policies.rl_train import resume_model
from policies.sb3_checkpoints import apply_checkpoint, read_checkpoint, save_checkpoint
from policies.sb3_files import torch_bytes
from tests.policies.synthetic import SYNTH_ARMS
from tests.policies.test_safe_files import read_zip, write_zip

BUFFER = 64


def _dqn(**kw):
    policy = SB3Policy(SYNTH_ARMS, 19, algo="dqn", net_arch="8", buffer_size=BUFFER, **kw)
    return policy, policy._new_model(policy._spaces_env(), None, seed=0, acting=False)


@pytest.fixture
def full_ckpt(tmp_path):
    """(policy, path) of a checkpoint whose replay buffer has wrapped around (full, at position 5)."""
    policy, model = _dqn()
    rb = model.replay_buffer
    rng = np.random.default_rng(0)
    rb.observations[...] = rng.normal(size=rb.observations.shape)
    rb.rewards[...] = rng.normal(size=rb.rewards.shape)
    rb.pos, rb.full = 5, True
    path = tmp_path / "model_64_steps.zip"
    save_checkpoint(model, policy.network(), path)
    return policy, path


def test_a_full_replay_buffer_comes_back_full_at_its_position(full_ckpt):
    policy, path = full_ckpt
    _, model = _dqn()
    assert not model.replay_buffer.full
    apply_checkpoint(model, read_checkpoint(path), policy.network(), str(path))
    rb = model.replay_buffer
    assert (rb.pos, rb.full) == (5, True)
    assert rb.size() == BUFFER  # every row is sampled from, not only the first five
    want = read_checkpoint(path).buffer
    assert np.array_equal(rb.observations, want["observations"]) and rb.observations.any()


def _edited(path, dst, edit_meta=None, edit_opt=None):
    items = read_zip(path)
    if edit_meta:
        meta = json.loads(items["state.json"])
        edit_meta(meta)
        items["state.json"] = json.dumps(meta).encode()
    if edit_opt:
        opt = torch.load(io.BytesIO(items["optimizer.pt"]), weights_only=True)
        edit_opt(opt)
        items["optimizer.pt"] = torch_bytes(opt)
    write_zip(dst, items)
    return dst


@pytest.mark.parametrize("pos", [BUFFER, -1, 1.5, True])
def test_a_replay_buffer_position_outside_the_buffer_is_refused(full_ckpt, tmp_path, pos):
    policy, path = full_ckpt
    bad = _edited(path, tmp_path / "bad.zip", edit_meta=lambda m: m["replay_buffer"].update(pos=pos))
    _, model = _dqn()
    with pytest.raises(PolicyError, match="replay buffer's position is corrupted"):
        apply_checkpoint(model, read_checkpoint(bad), policy.network(), str(bad))
    ok = _edited(path, tmp_path / "ok.zip", edit_meta=lambda m: m["replay_buffer"].update(pos=BUFFER - 1))
    apply_checkpoint(model, read_checkpoint(ok), policy.network(), str(ok))
    assert model.replay_buffer.pos == BUFFER - 1


def test_a_nan_inside_an_optimizer_settings_tuple_is_refused(full_ckpt, tmp_path):
    policy, path = full_ckpt

    def nan_beta(opt):
        opt["param_groups"][0]["betas"] = (0.9, float("nan"))

    bad = _edited(path, tmp_path / "bad.zip", edit_opt=nan_beta)
    _, model = _dqn()
    with pytest.raises(PolicyError, match="corrupted.*betas") as err:
        apply_checkpoint(model, read_checkpoint(bad), policy.network(), str(bad))
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_another_network_is_refused(full_ckpt):
    policy, path = full_ckpt
    other, model = _dqn(gamma=0.5)  # the same weights' shapes, other settings
    with pytest.raises(PolicyError, match="other settings \\(hyper\\)"):
        apply_checkpoint(model, read_checkpoint(path), other.network(), str(path))


def test_a_resume_takes_the_newest_readable_checkpoint_by_step(tmp_path):
    """Checkpoints at steps 64, 96 and 128 (newest by step, not by name: 'model_128' sorts before 'model_64'); the
    newest torn by a kill: the resume takes step 96's, its counters and weights."""
    policy, model = _dqn()
    weights = {}
    for step in (64, 96, 128):
        model.num_timesteps = step
        with torch.no_grad():
            model.policy.q_net.q_net[0].bias.fill_(step)
        weights[step] = model.policy.q_net.q_net[0].bias.clone()
        save_checkpoint(model, policy.network(), tmp_path / f"model_{step}_steps.zip")
    _, fresh = _dqn()
    resume_model(policy, fresh, tmp_path)
    assert fresh.num_timesteps == 128
    assert torch.equal(fresh.policy.q_net.q_net[0].bias, weights[128])
    torn = tmp_path / "model_128_steps.zip"
    torn.write_bytes(torn.read_bytes()[:100])
    _, fresh = _dqn()
    resume_model(policy, fresh, tmp_path)
    assert fresh.num_timesteps == 96
    assert torch.equal(fresh.policy.q_net.q_net[0].bias, weights[96])


@pytest.mark.parametrize("member", ["policy.safetensors", "optimizer.pt"])
def test_a_checkpoint_without_its_weights_or_optimizer_is_refused(full_ckpt, tmp_path, member):
    _, path = full_ckpt
    items = read_zip(path)
    del items[member]
    bad = tmp_path / "model_64_steps.zip"
    write_zip(bad, items)
    with pytest.raises(PolicyError, match=f"lacks {member}"):
        read_checkpoint(bad)
