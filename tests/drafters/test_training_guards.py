"""Damaged files in a training or data folder are refused in one line (``DrafterError``) naming the file and what to
do, never a traceback or a run that goes on from nonsense: a damaged ``info.json`` of a data folder, a training
checkpoint whose settings, optimizer state or counters were mangled. And an eagle3 head is scored only on the
streams it fuses."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from drafters import DrafterError
from tests.drafters.tiny import tiny_loaded

PROMPTS = [(f"p{i}", [1 + i, 7, 9, 11 + i, 3]) for i in range(4)]
KW = dict(
    max_new_tokens=4, batch_size=2, capture_layers=(1,), window=16, pad_id=0, progress=False, model_id="t"
)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "damaged",
    ['{"cpu_s": 1.0, "prom', "[1, 2]", '{"cpu_s": "lots"}', '{"cpu_s": NaN}', '"text"', "\xff\xfe"],
)
@pytest.mark.parametrize("pending", [False, True])
def test_a_damaged_info_json_is_one_line_telling_to_delete_it(damaged, pending, tmp_path):
    """A resumed ``generate_data`` read info.json with a bare ``json.loads``: a torn file was a JSONDecodeError,
    another JSON value an AttributeError or ValueError, after the work. Refused (before the work, when parts are
    still to make), as ``experiments.corpus`` refuses its own."""
    from drafters.train_data import generate_data

    model = tiny_loaded().model
    generate_data(model, PROMPTS, tmp_path, **KW)
    if pending:  # a part still to make: refused before it is made
        (tmp_path / "part-0001.safetensors").unlink()
    (tmp_path / "info.json").write_bytes(damaged.encode("utf-8", "surrogateescape"))
    with pytest.raises(DrafterError) as err:
        generate_data(model, PROMPTS, tmp_path, **KW)
    assert "info.json is not this data's info" in one_line(err) and "delete it" in str(err.value)
    assert (tmp_path / "part-0001.safetensors").is_file() != pending
    (tmp_path / "info.json").unlink()  # as told: the folder resumes
    assert generate_data(model, PROMPTS, tmp_path, **KW)["cpu_s"] >= 0


# ---- training checkpoints ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training checkpoint of a tiny eagle head (3 steps an epoch), and the arguments to resume it."""
    from drafters.train import TrainSettings
    from experiments.corpus import distill_answers

    loaded = tiny_loaded()
    root = tmp_path_factory.mktemp("ckpt")
    g = torch.Generator().manual_seed(5)
    prompts = [(f"p{i:02d}", torch.randint(3, 90, (7,), generator=g).tolist()) for i in range(12)]
    distill_answers(loaded, prompts, root / "answers", max_new_tokens=8, batch=6, progress=False)
    st = TrainSettings(kind="eagle", draft_vocab=90, levels=2, feat_noise=0.1, reg_weight=0.1, steps=4,
                       window=16, batch_size=4, save_every_s=0.0, lr=1e-2)  # fmt: skip
    (root / "good").mkdir()
    run = dict(loaded=loaded, root=root, st=st)
    _train(run, root / "good", st)
    state = torch.load(root / "good" / "train-state-eagle.pt", weights_only=True)
    assert state["step"] == 4 and state["epoch"] == 1 and state["opt"]["state"]
    return run, state


def _train(run: dict, work, st):
    from drafters.train import train_head

    loaded = run["loaded"]
    return train_head(loaded.model, loaded.model_id, [run["root"] / "answers"], work / "head", st, work_dir=work,
                      data_info={}, progress=False)  # fmt: skip


def _set(key, value):
    return lambda s: s.__setitem__(key, value)


def _opt(key, value, param=0):
    return lambda s: s["opt"]["state"][param].__setitem__(key, value)


def _del_opt(key):
    return lambda s: s["opt"]["state"][0].pop(key)


def _group(key, value):
    return lambda s: s["opt"]["param_groups"][0].__setitem__(key, value)


MANGLED = {
    "settings None": (_set("settings", None), "its settings: None"),
    "exp_avg an int": (_opt("exp_avg", 3), "optimizer state 'exp_avg' of parameter 0: 3, not a tensor"),
    "exp_avg a scalar tensor": (_opt("exp_avg", torch.tensor(3.0)), "optimizer state exp_avg of shape ()"),
    "exp_avg_sq missing": (_del_opt("exp_avg_sq"), "optimizer state of parameter 0 holds"),
    "step a string": (_opt("step", "x"), "optimizer state 'step' of parameter 0: 'x'"),
    "step not finite": (_opt("step", torch.tensor(float("nan"))), "optimizer state step"),
    "state of no parameter": (
        lambda s: s["opt"]["state"].__setitem__(999, {"step": torch.tensor(1.0)}),
        "a parameter the head does not have",
    ),
    "weight_decay a string": (_group("weight_decay", "x"), "optimizer setting weight_decay = 'x'"),
    "betas None": (_group("betas", None), "optimizer setting betas = None"),
    "step past its epoch": (_set("step", 10**11), "step 100000000000 is not in epoch 1 of 3 steps"),
    "epoch past its step": (lambda s: s.update(step=3, epoch=7), "step 3 is not in epoch 7 of 3 steps"),
    "step not an integer": (_set("step", 4.5), "its counters: [4.5, 1"),
}


@pytest.mark.parametrize("name", list(MANGLED))
def test_a_mangled_training_checkpoint_is_one_line(trained, name, tmp_path):
    """Each was let through: settings None was a TypeError at the settings check, a moment that is not a tensor
    of the parameter's shape (or a missing one, a string hyperparameter) an error in the middle of training, and
    counters that do not fit together (a step outside its epoch) trained from the wrong batch or not at all."""
    run, good = trained
    mangle, needle = MANGLED[name]
    state = copy.deepcopy(good)
    mangle(state)
    torch.save(state, tmp_path / "train-state-eagle.pt")
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, replace(run["st"], steps=6))
    message = one_line(err)
    assert "train-state-eagle.pt is corrupted" in message and "delete it to start over" in message, message
    assert needle in message, message


def test_a_checkpoint_at_every_step_resumes(trained, tmp_path):
    """The counters check accepts what training writes, at an epoch's end (step = (epoch + 1) x steps an epoch,
    before the epoch counter moves on) as in its middle, and an older checkpoint's step count as a number. (A
    resume must give the checkpoint's --steps; an older checkpoint, which did not keep it, resumes with any.)"""
    run, good = trained
    for steps in range(1, 8):
        work = tmp_path / f"s{steps}"
        work.mkdir()
        for _ in range(2):  # trained, then resumed from its checkpoint at step `steps`
            assert _train(run, work, replace(run["st"], steps=steps))["training"]["steps"] == steps
    work = tmp_path / "older"
    work.mkdir()
    state = copy.deepcopy(good)
    del state["settings"]["steps"]  # (kept since the step budget is checked)
    for entries in state["opt"]["state"].values():
        entries["step"] = int(entries["step"])  # torch's AdamW once kept it as a number
    torch.save(state, work / "train-state-eagle.pt")
    assert _train(run, work, replace(run["st"], steps=5))["training"]["steps"] == 5


def test_collate_takes_the_fused_layers_and_refuses_missing_ones():
    """``evaluate``/``_collate`` stack the streams the head fuses (not whatever the data captured) and refuse data
    without them in one line naming both."""
    from drafters.train import _collate
    from drafters.train_data import Sequence

    h = 4
    exits = {n: torch.full((6, h), float(n)) for n in (1, 2, 3)}
    s = Sequence(tokens=torch.arange(6), feats=torch.zeros(6, h), exits=exits, answer_start=3, prompt_id="a")
    out = _collate([s], "eagle3", 0, 8, fuse=(1, 3))
    assert out["aux"].shape == (1, 6, 2 * h)
    assert out["aux"][0, 0].tolist() == [1.0] * h + [3.0] * h
    assert _collate([s], "eagle3", 0, 8)["aux"].shape == (1, 6, 3 * h)  # training: every captured stream
    with pytest.raises(DrafterError) as err:
        _collate([s], "eagle3", 0, 8, fuse=(1, 4))
    assert "[1, 4]" in one_line(err) and "[1, 2, 3]" in str(err.value)
