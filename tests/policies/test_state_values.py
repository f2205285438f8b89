"""What a loaded bandit's state may hold, and the bandits' maths against the papers' formulas computed by hand:
LinUCB and BucketUCB state of any real numeric dtype is held in float64 (an integer ``b`` failed on the first
update; a bool count stayed 1 after ``+= 1``), complex or bool arrays and a non-finite or fractional count are
refused at load, as is a BucketUCB ``c`` that is NaN, infinite or not a number; one EXP3.S update and one Gaussian
Thompson posterior equal Auer et al. (2002) and Agrawal & Goyal (2013); the shipped policies still load."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from policies.archive import npz_bytes, read_npz
from policies.bandits import EXP3, ThompsonSampling
from policies.base import PolicyError, load_policy, read_policy, write_policy
from policies.linucb import LinUCB

ARMS = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
FEATURES = ["position", "top1_prob", "accept_rate_recent", "match_len", "accept/ngram-d4"]
DATA = Path(__file__).resolve().parents[2] / "policies" / "data"


def rewrite(path: Path, params: dict | None = None, **arrays: np.ndarray) -> Path:
    """The policy file at ``path`` with header ``params`` and ``state.npz`` arrays replaced, checksums made to match
    (a file written by a buggy or hostile tool)."""
    header, files = read_policy(path)
    if arrays:
        state = read_npz(files["state.npz"])
        state.update(arrays)
        files = {**files, "state.npz": npz_bytes(**state)}
    if params:
        header = dataclasses.replace(header, params={**header.params, **params})
    write_policy(path, header, files)
    return path


# ---- LinUCB ----
def _linucb(tmp_path: Path) -> tuple[LinUCB, Path]:
    pol = LinUCB(ARMS, len(FEATURES), FEATURES, alpha=0.3)
    rng = np.random.default_rng(0)
    for _ in range(30):
        obs = rng.random(len(FEATURES))
        pol.update(obs, pol.act(obs), float(rng.random() * 3))
    pol.save(tmp_path / "lin.zip")
    return pol, tmp_path / "lin.zip"


def test_an_integer_linucb_state_loads_as_float64_and_learns(tmp_path):
    pol, path = _linucb(tmp_path)
    rewrite(path, b=np.rint(pol.b).astype(np.int64), pulls=pol.pulls.astype(np.int32))
    back = load_policy(path)
    assert back.A.dtype == back.b.dtype == back.pulls.dtype == np.float64
    obs = np.full(len(FEATURES), 0.5)
    a = back.act(obs)
    back.update(obs, a, 1.3)  # an int64 b raised numpy's casting error here
    assert back.pulls[a] == pol.pulls[a] + 1 and np.isfinite(back.b).all()


@pytest.mark.parametrize(
    "name, bad",
    [
        ("b", lambda p: p.b.astype(np.complex128)),
        ("pulls", lambda p: p.pulls > 0),
        ("A", lambda p: p.A.astype(np.complex64)),
    ],
    ids=["complex-b", "bool-pulls", "complex-A"],
)
def test_a_linucb_state_of_complex_or_bool_arrays_is_refused(tmp_path, name, bad):
    pol, path = _linucb(tmp_path)
    rewrite(path, **{name: bad(pol)})
    # complex arrays: refused by the policy, or already by the reader of its arrays (env.safe_zip)
    with pytest.raises(
        PolicyError, match=rf"LinUCB state {name} must hold real numbers|{name}\.npy holds <c"
    ):
        load_policy(path)


# ---- BucketUCB (the serving bandit) ----
@pytest.fixture
def bucket(tmp_path):
    from env.serve_env import feature_names
    from policies.serving import BucketUCB

    feats = feature_names(4)
    b = BucketUCB(ARMS, len(feats), feats, buckets=[1, 2, 4], c=0.5)
    rng = np.random.default_rng(0)
    for _ in range(60):
        o = rng.random(len(feats))
        o[0] = 1.0
        b.update(o, b.act(o), [0.1, 0.5, 3.0, 0.2][b.act(o)])
    b.save(tmp_path / "b.zip")
    return b, tmp_path / "b.zip"


@pytest.mark.parametrize("c", [float("nan"), float("inf"), -float("inf"), "0.5", True, None])
def test_a_bucket_bandit_c_that_is_not_a_finite_number_is_refused(bucket, c):
    _, path = bucket
    rewrite(path, params={"c": c})
    with pytest.raises(PolicyError, match="exploration constant c must be a finite number >= 0"):
        load_policy(path)


def test_bucket_bounds_that_are_not_row_counts_are_refused(bucket):
    _, path = bucket
    for bounds in ([1, "2"], [1.5, 4], [True, 2], []):
        rewrite(path, params={"buckets": bounds})
        with pytest.raises(PolicyError, match="bucket bounds must be positive row counts"):
            load_policy(path)


@pytest.mark.parametrize(
    "state, needle",
    [
        (lambda b: {"counts": np.full_like(b.counts, 0.1)}, "whole numbers of pulls"),  # ln(sum n) < 0: NaN
        (lambda b: {"counts": b.counts + 0.5}, "whole numbers of pulls"),
        (
            lambda b: {"counts": b.counts.astype(np.complex128) + 1j},
            r"counts must hold real|counts\.npy holds <c",
        ),
        (lambda b: {"counts": b.counts > 0}, "counts must hold real numbers, not bool"),
        (lambda b: {"sums": b.sums + 5j}, r"sums must hold real|sums\.npy holds <c"),
        (lambda b: {"counts": np.full_like(b.counts, 2.0**60)}, "negative or non-finite counts"),
        (lambda b: {"sums": np.full_like(b.sums, np.inf)}, "non-finite sums"),
    ],
    ids=[
        "fraction-0.1",
        "half-pulls",
        "complex-counts",
        "bool-counts",
        "complex-sums",
        "beyond-2^53",
        "inf-sums",
    ],
)
def test_a_bucket_bandit_state_that_would_act_wrongly_is_refused(bucket, state, needle):
    b, path = bucket
    rewrite(path, **state(b))
    with pytest.raises(PolicyError, match=needle):
        load_policy(path)


def test_an_integer_bucket_bandit_state_loads_as_float64_and_learns(bucket):
    b, path = bucket
    rewrite(path, counts=b.counts.astype(np.int64), sums=b.sums)
    back = load_policy(path)
    assert back.counts.dtype == back.sums.dtype == np.float64 and np.array_equal(back.counts, b.counts)
    o = np.zeros(back.obs_size)
    o[0] = 1.0
    a = back.act(o)
    assert a == b.act(o)
    back.update(o, a, 1.0)
    assert back.counts[back.bucket(o), a] == b.counts[b.bucket(o), a] + 1


# ---- the bandits' maths, by hand ----
def test_one_exp3s_update_is_auer_et_al_weight_sharing():
    """Exp3.S (Auer, Cesa-Bianchi, Freund & Schapire 2002): p_i = (1 - gamma) w_i / W + gamma / K;
    w_i(t+1) = w_i(t) exp(gamma xhat_i / K) + (e alpha / K) W(t), W(t) = sum_j w_j(t) BEFORE the update,
    xhat_i = x / p_i for the pulled arm and 0 for the others."""
    k, gamma, alpha, scale = 3, 0.3, 0.05, 2.0
    e = EXP3(["a", "b", "c"], gamma=gamma, share=alpha, scale=scale)
    w = [1.0, 2.0, 0.5]
    e.log_w = np.log(np.array(w))
    e.probs = e.distribution()
    W = sum(w)  # 3.5
    p = [(1 - gamma) * wi / W + gamma / k for wi in w]
    assert np.allclose(e.probs, p)
    e.update(None, 1, 1.2)  # x = 1.2 / scale = 0.6, pulled arm 1
    xhat = 0.6 / p[1]
    want = [
        w[0] + math.e * alpha / k * W,
        w[1] * math.exp(gamma * xhat / k) + math.e * alpha / k * W,
        w[2] + math.e * alpha / k * W,
    ]
    got = np.exp(e.log_w)
    assert np.allclose(got / got.sum(), np.array(want) / sum(want), rtol=1e-12, atol=0)
    p_next = [(1 - gamma) * wi / sum(want) + gamma / k for wi in want]
    assert np.allclose(e.distribution(), p_next, rtol=1e-12, atol=0)


def test_gaussian_thompson_samples_agrawal_goyal_posterior():
    """Agrawal & Goyal (2013, Gaussian priors): theta_i ~ N(S_i / (n_i + 1), 1 / (n_i + 1)), in reward units
    scaled by ``scale``: arm 1 pulled once (reward 2.0), arm 2 three times (1.0 each), arm 0 never."""
    t = ThompsonSampling(["a", "b", "c"], scale=0.5)
    for arm, r in ((1, 2.0), (2, 1.0), (2, 1.0), (2, 1.0)):
        t.update(None, arm, r)
    seen = {}

    class Rng:
        def normal(self, loc, sd):
            seen["loc"], seen["sd"] = np.asarray(loc), np.asarray(sd)
            return np.asarray(loc)

    t.rng = Rng()
    a = t.act(None)
    assert np.allclose(seen["loc"], [0.0, 2.0 / 2, 3.0 / 4])  # not the sample means [0, 2, 1]
    assert np.allclose(seen["sd"], [0.5, 0.5 / math.sqrt(2), 0.5 / 2])
    assert a == 1


@pytest.mark.parametrize(
    "name", sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.zip") if "ppo" not in p.name)
)
def test_the_shipped_bandit_and_table_policies_still_load_and_act(name):
    """The shipped files pass the stricter checks (PPO zips are loaded by the RL tests)."""
    pol = load_policy(DATA / name)
    obs = np.full(pol.obs_size, 0.25) if pol.obs_size else None
    if obs is not None and name.startswith("serve/"):
        obs[0] = 1.0
    assert 0 <= pol.act(obs) < pol.num_arms
