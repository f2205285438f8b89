"""The saved-file format: every policy type round-trips (same choices after load, learned state included), and a
corrupted or mismatched file fails at load with a one-line PolicyError that names the problem."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from policies import PolicyError, load_policy
from policies.bandits import EXP3, UCB1, ThompsonSampling
from policies.base import check_compatible, read_policy
from policies.heuristic import ConfidencePolicy, HFSchedulePolicy
from policies.linucb import LinUCB
from policies.static import StaticPolicy

ARMS = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
FEATURES = ["position", "top1_prob", "accept_rate_recent", "match_len", "accept/ngram-d4"]


def drive(policy, steps: int, seed: int = 0) -> list[int]:
    """Act and learn for ``steps`` steps on a fixed random problem; returns the actions."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        obs = rng.random(len(FEATURES)).astype(np.float32)
        a = policy.act(obs)
        if hasattr(policy, "update"):
            acc = int(rng.integers(0, 9))
            policy.update(obs, a, float(rng.random() * 3), {"accepted": acc, "drafted": 8, "tokens": acc + 1})
        out.append(a)
    return out


POLICIES = {
    "static": lambda: StaticPolicy(ARMS, arm="ngram-d4"),
    "hf_schedule": lambda: HFSchedulePolicy(ARMS),
    "confidence": lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, refit_every=4),
    "ucb1": lambda: UCB1(ARMS, scale=3.0, discount=0.99),
    "thompson": lambda: ThompsonSampling(ARMS, scale=3.0, window=50, seed=3),
    "exp3": lambda: EXP3(ARMS, scale=3.0, share=1e-3, seed=4),
    "linucb": lambda: LinUCB(ARMS, len(FEATURES), FEATURES, alpha=0.3, discount=0.999),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_round_trip_continues_identically(name, tmp_path):
    a = POLICIES[name]()
    drive(a, 200)
    path = tmp_path / f"{name}.zip"
    a.save(path)
    b = load_policy(path, arms=ARMS, obs_size=a.obs_size or None)
    assert type(b) is type(a) and b.arm_names == a.arm_names and b.kind == a.kind
    a.reset()  # a file restores what was learned; the episode's own state (a schedule's depth) starts afresh
    b.reset()
    assert drive(a, 100, seed=1) == drive(b, 100, seed=1)  # learned state and RNG restored


def test_header_records_kind_arms_size_and_versions(tmp_path):
    p = tmp_path / "p.zip"
    pol = LinUCB(ARMS, len(FEATURES), FEATURES)
    pol.meta = {"trace": "x.npz"}
    pol.save(p)
    header, files = read_policy(p)
    assert (header.type, header.kind, header.arms, header.obs_size) == ("linucb", "bandit", tuple(ARMS), 5)
    assert header.features == tuple(FEATURES) and header.meta == {"trace": "x.npz"}
    assert header.versions["numpy"] and set(header.payload) == set(files) == {"state.npz"}


@pytest.fixture
def saved(tmp_path):
    p = tmp_path / "bandit.zip"
    pol = LinUCB(ARMS, len(FEATURES), FEATURES)
    drive(pol, 50)
    pol.save(p)
    return p


def rewrite(path, header=None, members=None):
    """Rewrite the archive with a changed header and/or payload members."""
    with zipfile.ZipFile(path) as zf:
        items = {n: zf.read(n) for n in zf.namelist()}
    if header is not None:
        h = json.loads(items["header.json"])
        header(h)
        items["header.json"] = json.dumps(h).encode()
    items.update(members or {})
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in items.items():
            zf.writestr(n, d)


def test_mismatched_arm_menu(saved):
    with pytest.raises(PolicyError, match=r"trained for arms .* but this decoder/env has"):
        load_policy(saved, arms=["none", "ngram-d4"])


def test_mismatched_observation_size(saved):
    with pytest.raises(PolicyError, match="expects observations of size 5, but this decoder/env gives 7"):
        load_policy(saved, obs_size=7)


def test_mismatched_features(saved):
    with pytest.raises(PolicyError, match="other observation features"):
        load_policy(saved, features=[*FEATURES[:-1], "accept/ngram-d8"])


def test_payload_of_the_wrong_shape(saved, tmp_path):
    """A header that claims another observation size than the payload holds (a hand-edited file)."""
    rewrite(saved, header=lambda h: h.update(obs_size=7, features=None))
    with pytest.raises(PolicyError, match="LinUCB state has shape"):
        load_policy(saved)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
            "not a readable draftgym policy",
        ),
        (lambda p: p.write_bytes(b"garbage" * 100), "not a readable draftgym policy"),
        (lambda p: p.write_text("{}"), "not a readable draftgym policy"),
        (lambda p: rewrite(p, members={"state.npz": b"\x00" * 64}), "does not match its checksum"),
        (lambda p: rewrite(p, header=lambda h: h.update(format="other")), "not a draftgym policy file"),
        (lambda p: rewrite(p, header=lambda h: h.update(format_version=99)), "format version 99"),
        (lambda p: rewrite(p, header=lambda h: h.update(type="nope")), "unknown policy type 'nope'"),
        (lambda p: rewrite(p, header=lambda h: h.pop("arms")), "lacks or mangles a field"),
        (lambda p: rewrite(p, members={"header.json": b"{not json"}), "header.json is corrupted"),
    ],
    ids=[
        "truncated",
        "garbage",
        "not-zip",
        "payload-flipped",
        "format",
        "version",
        "type",
        "no-arms",
        "bad-json",
    ],
)
def test_corrupted_files_fail_with_one_clear_line(saved, damage, message):
    damage(saved)
    with pytest.raises(PolicyError, match=message) as err:
        load_policy(saved)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.zip")


def test_policies_without_observation_ignore_obs_size():
    check_compatible(UCB1(ARMS), arms=ARMS, obs_size=31)  # a bandit over arms runs with any observation


def test_bad_constructor_arguments():
    with pytest.raises(PolicyError, match="not in the arm menu"):
        StaticPolicy(ARMS, arm="ngram-d16")
    with pytest.raises(PolicyError, match="twice"):
        UCB1(["none", "none"])
    with pytest.raises(PolicyError, match="discount"):
        UCB1(ARMS, discount=1.5)
    with pytest.raises(PolicyError, match="size 5"):
        LinUCB(ARMS, 5).act(np.zeros(3))
