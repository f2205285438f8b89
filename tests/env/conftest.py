"""Env fixtures that need no model: a synthetic trace built with the real n-gram drafter over hand-made token
sequences (repetitive, so drafts get accepted), and a toy cost model."""

from __future__ import annotations

import numpy as np
import pytest

from drafters import DraftContext, NGramDrafter
from env.cost import Curve, FittedCostModel
from env.features import FeatureSpec, position_feature_names
from env.trace import FORMAT, VERSION, Trace, TreeArrays

EOS = 2
MODEL = {
    "model_id": "toy",
    "vocab_size": 64,
    "tokenizer_sha256": "abc",
    "eos_ids": [EOS],
    "dtype": "float32",
    "hidden_size": 8,
}


def make_trace(seed: int = 0, prompts: int = 5, max_new: int = 40) -> Trace:
    rng = np.random.default_rng(seed)
    spec = FeatureSpec()
    d = NGramDrafter()
    ptoks, trajs, trees = [], [], []
    for i in range(prompts):
        motif = rng.integers(3, 20, size=int(rng.integers(3, 7))).tolist()
        prompt = [int(t) for t in rng.integers(3, 20, size=6)] + motif
        n = int(rng.integers(2, max_new + 1)) if i else max_new  # prompt 0 runs to max_new
        traj = []
        while len(traj) < n:  # repeat the motif with random mutations
            for t in motif:
                traj.append(int(t) if rng.random() > 0.2 else int(rng.integers(3, 20)))
        traj = traj[:n]
        if i % 2 == 1:
            traj[-1] = EOS  # odd prompts end with end of sequence
        ptoks.append(prompt)
        trajs.append(traj)
        toks = list(prompt)
        for t in traj:
            toks.append(t)
            ctx = DraftContext(tokens=list(toks), prompt_len=len(prompt))
            d.reset(ctx)
            trees.append(d.propose(ctx, d.max_shape))
    feat = rng.random((sum(map(len, trajs)), 4 + spec.proj_dim)).astype(np.float32)
    feat[:, 4:] = feat[:, 4:] * 2 - 1
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": MODEL,
        "sampling": "greedy",
        "max_new_tokens": max_new,
        "features": {"spec": spec.as_dict(), "names": position_feature_names(spec)},
        "drafters": {"ngram": {"exact": True, "shape": [16, 8, 0], "options": {}}},
        "workload": "synthetic",
        "prompts": {"ids": [f"p{i}" for i in range(prompts)], "categories": ["toy"] * prompts},
    }

    def off(arrs):
        return np.concatenate([[0], np.cumsum([len(a) for a in arrs])]).astype(np.int64)

    return Trace(
        header=header,
        prompt_tokens=np.concatenate(ptoks).astype(np.int32),
        prompt_off=off(ptoks),
        traj=np.concatenate(trajs).astype(np.int32),
        traj_off=off(trajs),
        feat=feat,
        trees={
            "ngram": TreeArrays(
                off=off([t.tokens for t in trees]),
                tokens=np.concatenate([t.tokens.numpy() for t in trees]).astype(np.int32),
                parents=np.concatenate([t.parents.numpy() for t in trees]).astype(np.int16),
            )
        },
    )


class WordTokenizer:
    """Token ids written as numbers, no chat template (what ``record`` and the fingerprint need) for the tiny model
    (``tests.drafters.tiny``: a vocabulary of 96)."""

    chat_template = None
    eos_token_id = 95

    def get_vocab(self):
        return {f"t{i}": i for i in range(96)}

    def __call__(self, text):
        return {"input_ids": [int(x) for x in text.split()]}

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def tiny_words():
    """The tiny model (``tests.drafters.tiny``) with ``WordTokenizer``: prompts given as token numbers."""
    from tests.drafters.tiny import tiny_loaded

    loaded = tiny_loaded()
    loaded._tokenizer = WordTokenizer()
    return loaded


def toy_cost_model(model_id: str = "toy", dtype: str = "float32") -> FittedCostModel:
    return FittedCostModel(
        model_id=model_id,
        dtype=dtype,
        device="cpu",
        chain=Curve((1, 9, 17), (0.10, 0.11, 0.13)),
        tree=Curve((1, 17, 129), (0.10, 0.14, 0.40)),
        context_ref=16,
        per_context=1e-5,
        per_node_context=1e-7,
        drafters={"ngram": {"shapes": {}, "base_s": 2e-4, "per_node_s": 1e-6}},
    )


@pytest.fixture
def toy_trace() -> Trace:
    return make_trace()


@pytest.fixture
def toy_cost() -> FittedCostModel:
    return toy_cost_model()


# ---- the serving env's tests (test_serve_env*.py): a synthetic trace priced by the H200 roofline model ----------

SERVE_COST = "roofline:h200/llama-3.1-8b"
SERVE_ROWS = 4  # max_batch


@pytest.fixture(scope="module")
def serve_trace() -> Trace:
    return make_trace(seed=0, prompts=8, max_new=40)


def serve_kw(trace: Trace, **over):
    """``ServeSim``/``SpecServeEnv`` arguments on ``trace``, with ``over`` replacing any of them."""
    args = dict(trace=trace, cost=SERVE_COST, max_batch=SERVE_ROWS, requests=6,
                loads=["1", "3", "ramp", "bursty", "poisson@2"])  # fmt: skip
    args.update(over)
    return args


# ---- the programs' tests (test_bench_programs.py, test_program_outputs.py) ----


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every check must come before it."""
    import env.model

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(env.model, "load_model", refuse)


def _one_line_error(capsys, code, expected, rc=2):
    err = capsys.readouterr().err
    assert code == rc, err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    return err
