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
from policies.predictor import PredictorPolicy
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
    with pytest.raises(PolicyError, match="LinUCB state A has shape"):
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
        (lambda p: rewrite(p, header=lambda h: h.update(meta=[])), "meta must be a JSON object"),
        (lambda p: rewrite(p, header=lambda h: h.update(params="x")), "params must be a JSON object"),
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
        "meta-a-list",
        "params-text",
        "bad-json",
    ],
)
def test_corrupted_files_fail_with_one_clear_line(saved, damage, message):
    damage(saved)
    with pytest.raises(PolicyError, match=message) as err:
        load_policy(saved)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_an_observation_that_is_not_finite_is_refused(bad):
    """Every model picks some arm from NaN (LinUCB, PPO and the confidence rule picked arm 0): named instead."""
    obs = np.zeros(len(FEATURES))
    obs[2] = bad
    for pol in (LinUCB(ARMS, len(FEATURES), FEATURES), ConfidencePolicy(ARMS, len(FEATURES), FEATURES)):
        with pytest.raises(PolicyError, match=f"the observation holds {bad} at index 2"):
            pol.act(obs)


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.zip")
    loop = tmp_path / "loop.zip"
    loop.symlink_to(loop)  # reported as missing before
    with pytest.raises(PolicyError, match="loop.zip is a symbolic link to nothing"):
        load_policy(loop)


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


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: UCB1(ARMS, c=float("nan")), "ucb1 c must be a finite number"),
        (lambda: UCB1(ARMS, c=-1.0), "ucb1 c must be"),
        (lambda: UCB1(ARMS, seed=True), "seed must be an integer"),
        (lambda: UCB1(ARMS, scale=float("inf")), "reward scale"),
        (lambda: EXP3(ARMS, gamma=2.0), "exp3 gamma"),
        (lambda: EXP3(ARMS, horizon=0), "exp3 horizon"),
        (lambda: LinUCB(ARMS, len(FEATURES), FEATURES, alpha=float("nan")), "LinUCB alpha"),
        (lambda: HFSchedulePolicy(ARMS, initial=3), "initial depth must be one of"),
        (lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, refit_every=0), "confidence refit_every"),
        (lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, window=-1), "confidence window"),
        # a hand-edited header's values: named, not a Python error, not read as true
        (lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, window=10**30), "confidence window must be"),
        (
            lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, threshold="x"),
            "confidence threshold must be",
        ),
        (lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, refit="x"), "refit must be true or false"),
        (
            lambda: ConfidencePolicy(ARMS, len(FEATURES), FEATURES, refit=float("nan")),
            "refit must be true or",
        ),
        (lambda: PredictorPolicy(ARMS, len(FEATURES), FEATURES, rate="x"), "predictor rate must be a finite"),
        (
            lambda: PredictorPolicy(ARMS, len(FEATURES), FEATURES, rate=None),
            "predictor rate must be a finite",
        ),
    ],
)
def test_parameters_of_a_policy_are_checked(make, needle):
    """A policy's parameters (a config's, or a file header's) are finite numbers in range, refused in one line."""
    with pytest.raises(PolicyError, match=needle) as err:
        make()
    assert "\n" not in str(err.value)


def _ucb_with(change):
    pol = UCB1(ARMS)
    drive(pol, 20)
    change(pol)
    return pol


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda: _ucb_with(lambda p: p.stats.counts.__setitem__(0, -3.0)),
            "counts holds non-finite or negative",
        ),
        (lambda: _ucb_with(lambda p: p.stats.sums.__setitem__(1, np.inf)), "sums holds non-finite"),
        (lambda: _ucb_with(lambda p: setattr(p.stats, "total_pulls", -1)), "total_pulls"),
        (
            lambda: _ucb_with(lambda p: setattr(p.stats, "window", 4) or p.stats.recent.append((9, 1.0))),
            "recent",
        ),
    ],
)
def test_a_saved_state_of_bad_values_is_refused_at_load(tmp_path, make, needle):
    """The state a policy acts on is checked when it loads (not found mid-run as a NaN score or an index error):
    a file written by a buggy or hostile tool, with a valid checksum."""
    path = tmp_path / "p.zip"
    make().save(path)
    with pytest.raises(PolicyError, match=needle):
        load_policy(path)


def test_a_linucb_state_of_non_finite_values_is_refused(tmp_path):
    pol = LinUCB(ARMS, len(FEATURES), FEATURES)
    drive(pol, 20)
    pol.b[0, 0] = np.nan
    pol.save(tmp_path / "l.zip")
    with pytest.raises(PolicyError, match="LinUCB state b holds"):
        load_policy(tmp_path / "l.zip")


def test_an_archive_declaring_more_than_a_policy_could_hold_is_not_unpacked(saved, monkeypatch):
    import policies.archive as archive

    monkeypatch.setattr(
        archive, "ARCHIVE_BYTES", 10_000
    )  # a zip bomb, scaled down: declared sizes are checked first
    rewrite(saved, members={"extra.bin": b"\0" * 20_000})
    with pytest.raises(PolicyError, match="unpacked"):
        load_policy(saved)


def test_a_windowed_bandit_saves_a_state_it_loads(tmp_path):
    """A pull leaving the window subtracts its squared reward; with other pulls of the arm still in it, the
    rounding residue left a negative sum of squares, which the saved state's check then refused at load."""
    b = UCB1(["none", "ngram-d4"], window=2)
    for r in (2.7, 0.1, 0.0, 0.0):
        b.update(None, 0, r, {})
    assert (b.stats.sq >= 0).all()
    b.save(tmp_path / "w.zip")
    assert load_policy(tmp_path / "w.zip").act(None) == b.act(None)


def test_states_that_would_fail_mid_run_are_refused_at_load(tmp_path):
    """NaN EXP3 weights (no distribution to draw from) and a singular LinUCB matrix (no solve) load no more."""
    e = EXP3(ARMS)
    drive(e, 10)
    e.log_w[0] = np.nan
    e.save(tmp_path / "e.zip")
    with pytest.raises(PolicyError, match="exp3 state log_w holds non-finite"):
        load_policy(tmp_path / "e.zip")
    lin = LinUCB(ARMS, len(FEATURES), FEATURES)
    drive(lin, 10)
    lin.A[1] = 0.0
    lin.save(tmp_path / "l.zip")
    with pytest.raises(PolicyError, match="not symmetric positive definite"):
        load_policy(tmp_path / "l.zip")


def test_a_linucb_header_alone_does_not_allocate_its_matrices(saved, tmp_path):
    """A header claiming a huge observation with a tiny payload: refused by the payload's shape before the policy
    allocates arms x (obs_size + 1)^2 floats (2,000 features: 256 MB)."""
    import tracemalloc

    from policies.archive import npz_bytes
    from policies.base import write_policy

    header, _ = read_policy(saved)
    lin = LinUCB(ARMS, len(FEATURES), FEATURES)
    hostile = header.__class__(**{**header.__dict__, "type": "linucb", "kind": lin.kind, "obs_size": 2000,
                                  "features": None, "params": lin.params()})  # fmt: skip
    path = tmp_path / "big.zip"
    write_policy(
        path, hostile, {"state.npz": npz_bytes(A=np.eye(1)[None], b=np.zeros((1, 1)), pulls=np.zeros(1))}
    )
    tracemalloc.start()
    with pytest.raises(PolicyError, match="LinUCB state A has shape"):
        load_policy(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2**20, peak


def test_the_confidence_policy_resumes_its_refit_schedule(tmp_path):
    """Its refit counter is saved: a loaded copy refits on the same steps and chooses as the original."""
    pol = ConfidencePolicy(ARMS, len(FEATURES), FEATURES, refit_every=16, window=128)
    drive(pol, 77, seed=1)
    pol.save(tmp_path / "c.zip")
    back = load_policy(tmp_path / "c.zip")
    assert back.steps == pol.steps > 0
    assert drive(back, 60, seed=2) == drive(pol, 60, seed=2) and back.threshold == pol.threshold
