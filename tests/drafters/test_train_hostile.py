"""Hostile data parts and training checkpoints, and resumes that would not give the head an uninterrupted run gives,
are refused in one line (``DrafterError``) before a head is saved -- never a NaN head written over a good one, a
traceback, or a silently shortened run. And eagle3's windows hold every position, the answer's last ones too."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafters import DrafterError
from tests.drafters.tiny import tiny_loaded

PROMPTS = [(f"p{i:02d}", [3 + i, 7, 9, 11 + i, 3, 5 + i, 8]) for i in range(12)]


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Data of a tiny target (the streams eagle3 fuses too), a 3-step eagle run on it (its checkpoint and head),
    and the arguments to train."""
    from drafters.train import TrainSettings
    from drafters.train_data import generate_data

    loaded = tiny_loaded()
    root = tmp_path_factory.mktemp("hostile")
    generate_data(loaded.model, PROMPTS, root / "answers", max_new_tokens=8, batch_size=6, capture_layers=(1, 2),
                  window=32, pad_id=0, progress=False, model_id=loaded.model_id)  # fmt: skip
    st = TrainSettings(
        kind="eagle", draft_vocab=90, levels=2, steps=3, window=16, batch_size=4, save_every_s=1e9
    )
    out = dict(loaded=loaded, root=root, st=st)
    (root / "good").mkdir()
    _train(out, root / "good", st)
    out["state"] = torch.load(root / "good" / "train-state-eagle.pt", weights_only=True)
    out["head"] = (root / "good" / "head.safetensors").read_bytes()
    return out


def _train(run, work, st, data=None):
    from drafters.train import train_head

    loaded = run["loaded"]
    return train_head(loaded.model, loaded.model_id, [data or run["root"] / "answers"], work / "head", st,
                      work_dir=work, data_info={}, progress=False)  # fmt: skip


def _resume(run, tmp_path, mangle, st=None):
    """Train from the good checkpoint mangled by ``mangle``, over a good head at the output path; returns the
    error (the head must be kept)."""
    state = copy.deepcopy(run["state"])
    mangle(state)
    torch.save(state, tmp_path / "train-state-eagle.pt")
    (tmp_path / "head.safetensors").write_bytes(run["head"])
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, st or replace(run["st"], steps=3))
    assert (tmp_path / "head.safetensors").read_bytes() == run["head"]  # the user's head is kept
    return one_line(err)


def _copy_data(run, tmp_path, change) -> Path:
    """A copy of the data whose first part ``change(tensors, meta)`` mangled."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    data = tmp_path / "data"
    data.mkdir()
    for part in sorted((run["root"] / "answers").glob("part-*.safetensors")):
        with safe_open(str(part), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            meta = json.loads(fh.metadata()["meta"])
        if part.name.endswith("0000.safetensors"):
            change(tensors, meta)
        save_file(tensors, str(data / part.name), metadata={"meta": json.dumps(meta)})
    return data


def _nan_row(key):
    def change(t, _meta):
        t[key][2] = float("nan") if key.endswith("final") else float("inf")

    return change


# ---- 1. NaN or inf in the data or the checkpoint: refused, the head already there kept


@pytest.mark.parametrize("key", ["0/final", "0/exit1"])
def test_non_finite_features_are_refused_and_the_head_kept(run, key, tmp_path):
    """A NaN feature (or residual stream) trained a head of NaN weights, saved with exit 0 over the good one."""
    data = _copy_data(run, tmp_path, _nan_row(key))
    (tmp_path / "head.safetensors").write_bytes(run["head"])
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, run["st"], data=data)
    message = one_line(err)
    assert "part-0000.safetensors" in message and "NaN or infinite" in message, message
    assert (tmp_path / "head.safetensors").read_bytes() == run["head"]


def _head_nan(s):
    for v in s["head"].values():
        v.fill_(float("nan"))


def _moment_nan(s):
    for entries in s["opt"]["state"].values():
        entries["exp_avg_sq"].fill_(float("nan"))


def _group(key, value):
    return lambda s: s["opt"]["param_groups"][0].__setitem__(key, value)


def _opt_step(value):
    def mangle(s):
        for entries in s["opt"]["state"].values():
            entries["step"] = value

    return mangle


CORRUPTED = {
    "head NaN": (_head_nan, "NaN or infinite"),
    "exp_avg_sq NaN": (_moment_nan, "exp_avg_sq"),
    "weight_decay NaN": (_group("weight_decay", float("nan")), "weight_decay = nan"),
    "betas inf": (_group("betas", (0.9, float("inf"))), "betas = (0.9, inf)"),
    "gen random bytes": (
        lambda s: s.__setitem__("gen", torch.randint(0, 255, s["gen"].shape, dtype=torch.uint8)),
        "its generator state",
    ),
    "AdamW step negative": (_opt_step(torch.tensor(-5.0)), "optimizer state step"),
    "AdamW step fractional": (_opt_step(torch.tensor(2.5)), "optimizer state step"),
    "AdamW step a negative number": (_opt_step(-3), "optimizer state step"),
    "head not a mapping": (lambda s: s.__setitem__("head", [1]), "its head"),
}


@pytest.mark.parametrize("name", list(CORRUPTED))
def test_a_corrupted_checkpoint_is_one_line_and_the_head_kept(run, name, tmp_path):
    """Each trained on (a NaN head saved with exit 0) or crashed with a traceback (``Invalid mt19937 state``, a
    RuntimeError inside ``opt.step``); refused before any step, naming the file and what is wrong."""
    mangle, needle = CORRUPTED[name]
    message = _resume(run, tmp_path, mangle, replace(run["st"], steps=3))
    assert "train-state-eagle.pt is corrupted" in message and "delete it to start over" in message, message
    assert needle in message, message


def test_a_diverged_run_saves_nothing(run, tmp_path):
    """A run whose loss or weights become NaN or infinite (here an infinite learning rate) saved them; refused
    before the save: the head and checkpoint already there are kept."""
    (tmp_path / "head.safetensors").write_bytes(run["head"])
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, replace(run["st"], lr=float("inf")))
    assert "NaN or infinite" in one_line(err) and "--lr" in str(err.value), str(err.value)
    assert (tmp_path / "head.safetensors").read_bytes() == run["head"]
    assert not (tmp_path / "train-state-eagle.pt").exists()


# ---- 2. another step budget: refused once the checkpoint has trained


@pytest.mark.parametrize("steps", [1, 5])
def test_another_step_budget_is_refused(run, steps, tmp_path):
    """A finished 3-step run resumed with --steps 1 returned the 3-step head (its settings said 1 step); with
    --steps 5 its lr schedule changed mid-run (a head no fresh 5-step run trains)."""
    message = _resume(run, tmp_path, lambda s: None, replace(run["st"], steps=steps))
    assert "--steps 3" in message and f"--steps {steps}" in message, message
    assert "train-state-eagle.pt" in message and "another --work folder" in message, message


def test_a_cpu_budget_resumes_and_a_step_budget_does_not_take_it_over(run, tmp_path):
    """The CPU-minute budget (steps 0) resumes as before, from its own checkpoint or a step run's; a checkpoint
    of a CPU budget that has trained, resumed with --steps, is refused (its lr schedule followed CPU time)."""
    budget = replace(run["st"], steps=0, max_steps=2, cpu_minutes=5.0)
    assert _train(run, tmp_path, budget)["training"]["steps"] == 2
    assert _train(run, tmp_path, replace(budget, max_steps=3))["training"]["steps"] == 3
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, replace(budget, steps=5))
    assert "CPU budget" in one_line(err) and "--steps 5" in str(err.value), str(err.value)
    (tmp_path / "steps").mkdir()
    torch.save(run["state"], tmp_path / "steps" / "train-state-eagle.pt")  # 3 steps of a 3-step run
    assert _train(run, tmp_path / "steps", replace(budget, max_steps=4))["training"]["steps"] == 4


def test_the_same_step_budget_resumes(run, tmp_path):
    """A finished run rerun with its --steps gives its head again (a kill mid-run resumes the same way)."""
    torch.save(run["state"], tmp_path / "train-state-eagle.pt")
    assert _train(run, tmp_path, run["st"])["training"]["steps"] == 3
    assert (tmp_path / "head.safetensors").read_bytes() == run["head"]


# ---- 3. see CORRUPTED above; 4. eagle3 windows


def test_windows_hold_every_position_the_answer_tail_too():
    """A sequence of 40 positions in windows of 32: the last 8 (the answer) were dropped, being shorter than
    ``min_len``; now the last window ends at the sequence's end, overlapping the one before."""
    from drafters.train import windows
    from drafters.train_data import Sequence

    def seq(n, answer):
        return Sequence(tokens=torch.arange(n), feats=torch.arange(n).float()[:, None].repeat(1, 4),
                        exits={1: torch.zeros(n, 4)}, answer_start=answer, prompt_id=f"s{n}")  # fmt: skip

    for n, answer in [(40, 36), (70, 66), (64, 60), (10, 6), (33, 29), (48, 44)]:
        pieces = windows([seq(n, answer)], 32)
        seen = set()
        answered = 0
        for p in pieces:
            assert 1 <= p.tokens.shape[0] <= 32 and p.tokens.shape[0] >= min(16, n)
            assert p.feats[:, 0].long().tolist() == p.tokens.tolist()  # tokens and features stay aligned
            first = int(p.tokens[0])
            assert p.answer_start == min(max(0, answer - first), p.tokens.shape[0])
            seen |= set(p.tokens.tolist())
            answered += p.tokens.shape[0] - p.answer_start
        assert seen == set(range(n)), (n, sorted(set(range(n)) - seen))
        assert answered >= n - answer  # every answer token is in some window


def test_eagle3_trains_on_and_reports_every_answer_token(run, tmp_path):
    """Sequences of 15 positions in windows of 8: the last 7 (the answer) were dropped from training, and the
    head's metadata counted the answer tokens that were left."""
    from drafters.train_data import load_data, split

    st = replace(run["st"], kind="eagle3", steps=1, window=8, reg_weight=0.0)
    meta = _train(run, tmp_path, st)["training"]
    train, _ = split(load_data(run["root"] / "answers"))
    assert meta["train_answer_tokens"] == sum(s.tokens.shape[0] - s.answer_start for s in train) > 0
    assert meta["train_positions"] == sum(s.tokens.shape[0] for s in train)


# ---- 5. hostile data-part metadata and dtypes


def _meta(key, value):
    def change(_t, meta):
        meta[0][key] = value

    return change


def _dtype(key, dtype):
    def change(t, _meta):
        t[key] = t[key].to(dtype)

    return change


BAD_PARTS = {
    "answer_start negative": (_meta("answer_start", -5), "answer_start -5"),
    "answer_start huge": (_meta("answer_start", 10**9), "answer_start 1000000000"),
    "answer_start fractional": (_meta("answer_start", 2.5), "answer_start 2.5"),
    "answer_start a bool": (_meta("answer_start", True), "answer_start True"),
    "features int16": (_dtype("0/final", torch.int16), "torch.int16"),
    "stream int16": (_dtype("0/exit1", torch.int16), "torch.int16"),
    "tokens float": (_dtype("0/tokens", torch.float32), "torch.float32"),
    "feature NaN": (_nan_row("0/final"), "NaN or infinite"),
    "stream inf": (_nan_row("0/exit1"), "NaN or infinite"),
}


@pytest.mark.parametrize("name", list(BAD_PARTS))
def test_a_hostile_data_part_is_one_line(run, name, tmp_path):
    """A negative or huge ``answer_start`` reported wrong answer-token counts; int16 features and float tokens were
    cast silently. Each is refused naming the part and the sequence."""
    from drafters.train_data import load_data

    change, needle = BAD_PARTS[name]
    data = _copy_data(run, tmp_path, change)
    with pytest.raises(DrafterError) as err:
        load_data(data)
    message = one_line(err)
    assert "part-0000.safetensors: sequence 0" in message and needle in message, message
    assert "delete it to make it again" in message, message


# ---- 6. a directory at the checkpoint's path; messages that name what differs


def test_a_directory_at_the_checkpoint_path_is_refused_before_training(run, tmp_path, monkeypatch):
    """It was found only at the first save (naming the temporary file), after the steps had run."""
    import drafters.train

    def no_training(*_a, **_k):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(drafters.train, "loss_eagle", no_training)
    (tmp_path / "train-state-eagle.pt").mkdir()
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, run["st"])
    message = one_line(err)
    assert "train-state-eagle.pt is not a file" in message and ".tmp" not in message, message


def test_a_checkpoint_with_an_unknown_setting_names_it(run, tmp_path):
    """It said "trained with other settings (: )"."""
    message = _resume(run, tmp_path, lambda s: s["settings"].__setitem__("foo", 1))
    assert "other settings (foo: 1)" in message, message


def test_an_empty_checkpoint_says_so(run, tmp_path):
    """It said "is corrupted ()"."""
    (tmp_path / "train-state-eagle.pt").write_bytes(b"")
    with pytest.raises(DrafterError) as err:
        _train(run, tmp_path, run["st"])
    assert "train-state-eagle.pt is corrupted (an empty file)" in one_line(err), str(err.value)
