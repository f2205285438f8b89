"""Serving policies: the arm of a whole batch under load, from the observation of ``draftgym/SpecServe-v0``
(``env.serve_env.feature_names``: load features, pooled and per-row request features).

Baselines as the engines ship them:

- ``BatchTablePolicy`` (kind ``schedule``): a table rows -> arm, as vLLM's ``num_speculative_tokens_per_batch_size``
  and TensorRT-LLM's ``draft_len_schedule`` are written. ``fit_batch_table`` fits one the way their users do: the
  best static arm at each concurrency, measured (here: replayed) on this machine. ``trt_auto`` is TensorRT-LLM's
  AUTO rule for n-gram drafts as a per-step schedule of the rows in the batch (depth 5 up to 4 rows, 3 up to 32,
  off above); TensorRT-LLM itself fixes the depth once from the engine's max batch size (5 if it is at most 4,
  else 3) and only switches drafting off above 32 requests: at a max batch of 16, the static ``ngram-d3`` arm;
- ``SmartSpecPolicy`` (kind ``heuristic``): SmartSpec's rule (its closed loop, TurboSpec: ``policies.turbospec``):
  each request's per-token acceptance estimated online (``env.serve_env.alpha_estimate``, the per-row feature),
  the depth that maximizes the estimated goodput ``sum_i E[tokens_i(d)] / c(rows, d + 1, context)`` under a batch
  cost model (rows whose drafter has no match expect one token);
- ``BucketUCB`` (kind ``bandit``): UCB1 per batch-size bucket (as mit-han-lab/fastrl's per-batch-size bandit).

Learned ones use the policies of the single-sequence env on this observation: ``policies.rl.SB3Policy`` (PPO on
the vectorized serving env, ``train_serve_ppo``) and ``policies.linucb.LinUCB`` (a contextual bandit on the whole
serving observation: load, pooled and per-row features). Every file is JSON and arrays (``policies.archive``), never code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from drafters.base import shown
from policies.archive import npz_bytes, read_npz
from policies.base import BasePolicy, PolicyError, real

# indices into the serving observation (env.serve_env.feature_names); checked against the feature names at load
ROWS_AT, MATCH_ROWS_AT, CTX_AT, ROW_BLOCK_AT, ROW_WIDTH = 0, 4, 2, 9, 6


def _max_batch(obs_size: int) -> int:
    m, r = divmod(obs_size - ROW_BLOCK_AT, ROW_WIDTH)
    if r or m < 1:
        raise PolicyError(f"an observation of size {obs_size} is not a serving observation")
    return m


def rows_of(obs: np.ndarray, max_batch: int) -> int:
    return int(round(float(obs[ROWS_AT]) * max_batch))


def _check_serving(policy: BasePolicy) -> int:
    m = _max_batch(policy.obs_size)
    if policy.features is not None:
        from env.serve_env import feature_names

        if tuple(policy.features) != tuple(feature_names(m)):
            raise PolicyError(f"{policy.name}: the observation is not the serving env's (features differ)")
    return m


class BatchTablePolicy(BasePolicy):
    """``table``: ``[[max_rows, arm], ...]`` in increasing ``max_rows``; a batch of ``r`` rows takes the arm of the
    first entry with ``r <= max_rows`` (past the last: the last entry's arm)."""

    type_name = "serve_table"
    kind = "schedule"

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 table: Sequence[Sequence[Any]], label: str = "table") -> None:  # fmt: skip
        super().__init__(arms, obs_size, features)
        self.label = str(label)
        self.max_batch = _check_serving(self)
        if not isinstance(table, (list, tuple)) or not all(
            isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[1], str) for e in table
        ):
            raise PolicyError(f"a batch table is [[max_rows, arm], ...], got {shown(table, 120)}")
        self.table = [
            (int(real("batch table max_rows", r, lo=1, hi=1 << 30, integer=True)), a) for r, a in table
        ]
        if not self.table:
            raise PolicyError("a batch table needs at least one entry")
        if [r for r, _ in self.table] != sorted({r for r, _ in self.table}):
            raise PolicyError("the batch table's max_rows must increase")
        bad = [a for _, a in self.table if a not in self.arm_names]
        if bad:
            raise PolicyError(f"batch table arms {bad} are not in the arm menu {list(self.arm_names)}")
        self._bounds = np.array([r for r, _ in self.table])
        self._index = np.array([self.arm_names.index(a) for _, a in self.table])

    @property
    def name(self) -> str:
        return self.label

    def params(self) -> dict[str, Any]:
        return {"table": [[r, a] for r, a in self.table], "label": self.label}

    def act(self, obs: np.ndarray | None) -> int:
        x = self._check_obs(obs)
        i = min(int(np.searchsorted(self._bounds, rows_of(x, self.max_batch))), len(self.table) - 1)
        return int(self._index[i])

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        rows = np.rint(self._check_batch(obs)[:, ROWS_AT] * self.max_batch)
        i = np.minimum(np.searchsorted(self._bounds, rows), len(self.table) - 1)
        return self._index[i]


def trt_auto(arms: Sequence[str], obs_size: int, features: Sequence[str] | None = None) -> BatchTablePolicy:
    """TensorRT-LLM's AUTO rule for n-gram speculation read per step on the rows in the batch: depth 5 up to 4 rows,
    depth 3 up to 32, off above. (TensorRT-LLM's ``suggest_spec_config`` keys the depth on the engine's max batch
    size instead, once: at a max batch above 4 that is the static ``ngram-d3`` arm, off above 32 requests.)"""
    need = ("ngram-d5", "ngram-d3", "none")
    if any(a not in arms for a in need):
        raise PolicyError(f"the TensorRT-LLM AUTO rule needs arms {list(need)} in the menu")
    return BatchTablePolicy(arms, obs_size, features, table=[[4, "ngram-d5"], [32, "ngram-d3"], [1 << 30, "none"]],
                            label="trt-auto")  # fmt: skip


class SmartSpecPolicy(BasePolicy):
    """The SmartSpec rule over the menu's chain arms (and "none") under the batch cost model ``cost``
    (the JSON of a ``env.batch_cost`` model: fitted or roofline)."""

    type_name = "smartspec"
    kind = "heuristic"

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 cost: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(arms, obs_size, features)
        self.max_batch = _check_serving(self)
        from env.batch_cost import FORMAT, ROOFLINE_FORMAT, FittedBatchCost
        from env.cost import CostModelError
        from env.engine import parse_arm
        from env.roofline import RooflineCost

        if not isinstance(cost, dict) or cost.get("format") not in (FORMAT, ROOFLINE_FORMAT):
            raise PolicyError("SmartSpec needs the JSON of a batch cost model (env.batch_cost)")
        try:
            self.cost_model = (FittedBatchCost if cost["format"] == FORMAT else RooflineCost).from_json(cost)
        except CostModelError as err:
            raise PolicyError(f"SmartSpec: {err}") from err
        self.cost = cost
        self.arms = [parse_arm(a) for a in self.arm_names]
        for a in self.arms:
            if a.drafter is not None and a.shape.topk != 1:
                raise PolicyError(f"SmartSpec prices chains only; {a.name} is a tree")
        self.depths = np.array([0 if a.drafter is None else a.shape.depth for a in self.arms], np.float64)
        from env.serve_obs import TABLE_DRAFTERS

        # the observation's match depth (a table drafter's) bounds the chains of the table drafters; a model
        # head's are not
        self.capped = [a.drafter in TABLE_DRAFTERS for a in self.arms]
        self._capped = np.array(self.capped, bool)
        drafters = dict.fromkeys(a.drafter for a in self.arms if a.drafter is not None)  # priced per drafter
        self._by_drafter = {d: np.flatnonzero([a.drafter == d for a in self.arms]) for d in drafters}

    def params(self) -> dict[str, Any]:
        return {"cost": self.cost}

    def scores(self, obs: np.ndarray) -> np.ndarray:
        """Estimated goodput of every arm (tokens per second of the batch)."""
        tokens, seconds, _ = self.estimate(obs)
        return tokens / seconds

    def estimate(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Every arm's expected tokens committed by the step and its priced seconds (forward and drafting), and the
        rows in the batch."""
        from env.batch_cost import step_context
        from env.serve_env import CTX_NORM, DEPTH_NORM

        m = self.max_batch
        block = np.asarray(obs[ROW_BLOCK_AT:], np.float64).reshape(m, ROW_WIDTH)
        live = block[:, 0] > 0.5
        rows = max(int(live.sum()), 1)
        match = block[live, 4] * DEPTH_NORM  # the drafter's longest proposal here (0: nothing to draft)
        ctx = float(step_context(self.cost_model, block[None, :, 1] * CTX_NORM, live[None])[0])
        k, r = len(self.arms), int(live.sum())
        d = np.broadcast_to(self.depths[:, None], (k, r))  # [K, R]: every arm at every live row
        dd = np.where(self._capped[:, None], np.minimum(d, match[None, :]), d)  # chains <= the proposal
        tokens = self.expected_tokens(obs, block[live], dd)
        nodes = 1 + (dd.max(1) if r else np.zeros(k))
        t = np.asarray(self.cost_model.forward_s(np.full(k, rows), nodes, np.full(k, ctx)), np.float64).copy()
        for name, idx in self._by_drafter.items():
            t[idx] += np.asarray(self.cost_model.draft_s(name, np.full(idx.size, rows), self.depths[idx]))
        return tokens, t, r

    def expected_tokens(self, obs: np.ndarray, rows: np.ndarray, dd: np.ndarray) -> np.ndarray:
        """Every arm's expected tokens committed by the step ``[K]``, from the live rows' block ``rows`` ``[R, 6]``
        and each arm's chain at each row ``dd`` ``[K, R]``: SmartSpec's geometric rule, a row's draft tokens
        accepted one by one with its acceptance estimate."""
        alpha = np.clip(rows[:, 2], 0.0, 0.999)[None, :]
        return np.where(dd > 0, (1 - alpha ** (dd + 1)) / (1 - alpha), 1.0).sum(1)

    def act(self, obs: np.ndarray | None) -> int:
        return int(np.argmax(self.scores(self._check_obs(obs))))


class BucketUCB(BasePolicy):
    """UCB1 over the arms, one bandit per batch-size bucket (``buckets``: upper bounds of rows); learns online
    from the step's reward."""

    type_name = "bucket_ucb"
    kind = "bandit"

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 buckets: Sequence[int] = (1, 2, 4, 8, 16), c: float = 0.5) -> None:  # fmt: skip
        super().__init__(arms, obs_size, features)
        self.max_batch = _check_serving(self)
        bounds = list(buckets) if isinstance(buckets, (list, tuple)) else []
        ok = all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) and 1 <= b < 2**31 for b in bounds
        )
        if not bounds or not ok:
            raise PolicyError(
                f"bucket bounds must be positive row counts (a list of integers >= 1), got {str(buckets)[:60]}"
            )
        self.buckets = np.array(sorted({int(b) for b in bounds}), np.int64)
        finite = isinstance(c, (int, float)) and not isinstance(c, bool) and abs(c) < 1e300  # NaN, inf: False
        if not finite:
            raise PolicyError(f"the exploration constant c must be a finite number >= 0, got {str(c)[:40]}")
        if c < 0:
            raise PolicyError(f"the exploration constant must be >= 0, got {c}")
        self.c = float(c)
        self.counts = np.zeros((len(self.buckets), self.num_arms))
        self.sums = np.zeros((len(self.buckets), self.num_arms))

    @property
    def name(self) -> str:
        return "bucket-ucb"

    def params(self) -> dict[str, Any]:
        return {"buckets": self.buckets.tolist(), "c": self.c}

    def bucket(self, obs: np.ndarray) -> int:
        return min(int(np.searchsorted(self.buckets, rows_of(obs, self.max_batch))), len(self.buckets) - 1)

    def act(self, obs: np.ndarray | None) -> int:
        b = self.bucket(self._check_obs(obs))
        n, s = self.counts[b], self.sums[b]
        if (n == 0).any():
            return int(np.flatnonzero(n == 0)[0])
        return int(np.argmax(s / n + self.c * np.sqrt(np.log(n.sum()) / n)))

    def update(
        self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        action, reward = self._check_update(action, reward)
        b = self.bucket(self._check_obs(obs))
        self.counts[b, action] += 1
        self.sums[b, action] += reward

    def state(self) -> dict[str, bytes]:
        return {"state.npz": npz_bytes(counts=self.counts, sums=self.sums)}

    def restore(self, files: dict[str, bytes]) -> None:
        if "state.npz" not in files:
            raise PolicyError("bucket bandit file has no state.npz")
        s = read_npz(files["state.npz"])
        shape = (len(self.buckets), self.num_arms)
        got = {}
        for name in ("counts", "sums"):
            x = s.get(name)
            if x is None:
                raise PolicyError(f"bucket bandit state has no {name}")
            if x.shape != shape:
                raise PolicyError(
                    f"bucket bandit state has the wrong shape (expected {shape}, {name} is {x.shape})"
                )
            if x.dtype.kind not in "fiu":  # not complex, bool (+= 1 stays 1) or object
                raise PolicyError(f"bucket bandit state {name} must hold real numbers, not {x.dtype}")
            with np.errstate(over="ignore"):  # a long double beyond float64's range: inf, refused below
                got[name] = x.astype(np.float64)
        counts, sums = got["counts"], got["sums"]
        # pulls: whole numbers (a fraction below 1 makes ln(sum n) < 0 and every score NaN), within float64's exact
        # integers (their sum, the log's argument, stays finite and exact); sums: finite
        if not (np.isfinite(counts).all() and (counts >= 0).all() and (counts <= 2**53).all()):
            raise PolicyError(
                "bucket bandit state holds negative or non-finite counts (pull counts: 0 to 2^53)"
            )
        if (counts != np.floor(counts)).any():
            raise PolicyError("bucket bandit state counts must be whole numbers of pulls")
        if not np.isfinite(sums).all():
            raise PolicyError("bucket bandit state holds negative or non-finite counts, or non-finite sums")
        self.counts, self.sums = counts, sums


# ---- fitting and training in replay --------------------------------------------------------------------------------


def run_policy(
    sim: Any, policy: Any, *, learn: bool = False, oracle: bool = False, online: bool = False
) -> np.ndarray:
    """Run every server of ``sim`` (reset) to the end of its episode under ``policy`` (``oracle``: the myopic
    oracle instead); ``learn``: online policies update after each step (one policy for all servers: training).
    ``online``: an online policy (a bandit) serves every server as it does one live stream — a copy of it as
    given per server, learning from that server's steps only. Returns each server's goodput."""
    if online and not oracle and hasattr(policy, "update"):
        return _run_copies(sim, policy)
    act_batch = getattr(policy, "act_batch", None)
    per_row = getattr(policy, "per_row", False)  # one arm per row slot (policies.serve_rows)
    while not sim.done().all():
        live = ~sim.done()
        if oracle:
            a = sim.myopic_best()
        else:
            obs = sim.observe()
            if per_row and act_batch is not None:
                a = np.asarray(act_batch(obs), np.int64).reshape(sim.num_envs, sim.max_batch)
            elif per_row:
                a = np.zeros((sim.num_envs, sim.max_batch), np.int64)
                for i in np.flatnonzero(live):
                    a[i] = policy.act(obs[i])
            elif act_batch is not None:
                a = np.asarray(act_batch(obs), np.int64).reshape(-1)
            else:
                a = np.array([policy.act(obs[i]) if live[i] else 0 for i in range(sim.num_envs)], np.int64)
            if learn and hasattr(policy, "update"):
                obs = obs.copy()
        r, o = sim.step(a)
        if learn and not oracle and hasattr(policy, "update"):
            for i in np.flatnonzero(live):
                policy.update(obs[i], int(a[i]), float(r[i]), {})
    return sim.goodput()


def _run_copies(sim: Any, policy: Any) -> np.ndarray:
    import copy

    copies = [copy.deepcopy(policy) for _ in range(sim.num_envs)]
    while not sim.done().all():
        live = ~sim.done()
        obs = sim.observe().copy()
        a = np.array([copies[i].act(obs[i]) if live[i] else 0 for i in range(sim.num_envs)], np.int64)
        r, _ = sim.step(a)
        for i in np.flatnonzero(live):
            copies[i].update(obs[i], int(a[i]), float(r[i]), {})
    return sim.goodput()


def static_goodputs(make_sim: Any, arms: Sequence[str], loads: Sequence[str], episodes: int, seed: int = 0,
                    tick: Callable[[], object] | None = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """Replayed goodput of every static arm at every load: ``{load: {arm: tokens/s}}`` (``episodes`` servers each,
    the same request streams for every arm). ``tick``: called after each (load, arm), for a progress bar."""
    out: dict[str, dict[str, float]] = {}
    for load in loads:
        out[load] = {}
        for k, arm in enumerate(arms):
            sim = make_sim(episodes, loads=[load], seed=seed)
            sim.reset()
            out[load][arm] = float(np.median(run_policy(sim, _Const(k))))
            if tick is not None:
                tick()
    return out


class _Const:
    def __init__(self, k: int) -> None:
        self.k = k

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        return np.full(len(obs), self.k)


def fit_batch_table(goodputs: dict[str, dict[str, float]], arms: Sequence[str], obs_size: int,
                    features: Sequence[str] | None = None) -> BatchTablePolicy:  # fmt: skip
    """The table a vLLM / TensorRT-LLM user writes: the best static arm at each closed-loop concurrency."""
    levels = sorted(int(x) for x in goodputs if str(x).isdigit())
    if not levels:
        raise PolicyError("fitting a batch table needs goodputs at integer concurrencies")
    table = [[c, max(goodputs[str(c)], key=goodputs[str(c)].get)] for c in levels]
    return BatchTablePolicy(arms, obs_size, features, table=merge_levels(table), label="fitted-table")


def merge_levels(table: list[list[Any]]) -> list[list[Any]]:
    """A fitted table ``[[max_rows, *rule], ...]`` by increasing ``max_rows``: adjacent levels with the same rule
    merged, the last one covering every batch."""
    merged: list[list[Any]] = []
    for row in table:
        if merged and merged[-1][1:] == row[1:]:
            merged[-1][0] = row[0]
        else:
            merged.append(list(row))
    merged[-1][0] = 1 << 30
    return merged


def train_serve_ppo(make_vec: Any, arms: Sequence[str], obs_size: int, features: Sequence[str], *,
                    timesteps: int, seed: int = 0, progress: bool = False, make_eval: Any = None,
                    eval_every: int = 16384, checkpoints: Path | None = None,
                    checkpoint_every: int = 65536, rows: bool = False) -> tuple[Any, list[dict[str, float]]]:  # fmt: skip
    """PPO (stable-baselines3) on the vectorized serving env ``make_vec()`` (``draftgym serve-train`` builds it with
    the env's own reward, the step's goodput relative to AR at the same batch; ``time_saved`` learned less here). ``make_eval()``: a fresh
    ``ServeSim`` (reset) whose median replayed goodput under the current policy is logged every ``eval_every``
    steps — the learning curve, ``[{"timesteps", "seconds", "goodput"}]``. Returns ``(SB3Policy, curve)``.

    ``checkpoints``: a folder for the training state (``policies.sb3_checkpoints.save_checkpoint``, atomic; the last two
    kept) and the curve so far (``curve.json``), written every ``checkpoint_every`` steps; a run killed midway and
    started again with the same folder resumes from its latest readable checkpoint (its curve and training seconds
    carried on), not from step 0. The caller checks that the folder's settings are this run's (a checkpoint of
    another network is refused). A resumed run is not bitwise the run that was not killed: the envs restart.

    ``rows``: the per-row policy (``policies.rl_rows.SB3RowPolicy``, ``ppo-rows``: a 64x64 row actor shared by the
    slots, 128x128 shape actor and critic) on a ``make_vec()`` built with ``action="row"``; else a 128x128 MLP."""
    import time

    from stable_baselines3.common.callbacks import BaseCallback

    from env.files import atomic_write_text
    from policies.rl import SB3Policy
    from policies.rl_rows import SB3RowPolicy
    from policies.rl_train import checkpoint_files, resume_model
    from policies.sb3_checkpoints import save_checkpoint

    venv = make_vec()
    make_policy, net = (SB3RowPolicy, {"net_arch": "64,64", "vf_net_arch": "128,128"}) if rows else (
        SB3Policy, {"net_arch": "128,128"})  # fmt: skip
    policy = make_policy(arms, obs_size, features, algo="ppo", seed=seed, gamma=0.9, n_steps=64, batch_size=1024,
                         n_epochs=4, learning_rate=3e-4, ent_coef=0.003, **net)  # fmt: skip
    model = policy.build(venv)
    curve: list[dict[str, float]] = []
    carried, carried_wall = 0.0, 0.0  # training seconds (and wall seconds) of the run a resume continues
    if checkpoints is not None:
        checkpoints.mkdir(parents=True, exist_ok=True)
        resume_model(policy, model, checkpoints)
        curve, carried, carried_wall = _saved_curve(checkpoints / "curve.json", int(model.num_timesteps))
    t0 = time.perf_counter()
    eval_s = [0.0]

    def seconds() -> float:
        return round(carried + time.perf_counter() - t0 - eval_s[0], 2)

    def wall() -> float:
        return round(carried_wall + time.perf_counter() - t0, 2)

    class Curve(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.next = 0
            self.next_ckpt = 0

        def _on_training_start(self) -> None:
            done = int(self.num_timesteps)  # after a resume, the next multiples of the periods
            if curve:
                self.next = int(curve[-1]["timesteps"]) + eval_every
            self.next_ckpt = (done // checkpoint_every + 1) * checkpoint_every

        def _on_rollout_end(self) -> None:
            self._evaluate()

        def _on_rollout_start(self) -> None:
            # after the previous rollout's update (stable-baselines3 trains on a rollout after its end): the
            # weights saved are those of num_timesteps, and a resume repeats no update and skips none
            if checkpoints is not None and self.num_timesteps >= self.next_ckpt:
                self.next_ckpt = (self.num_timesteps // checkpoint_every + 1) * checkpoint_every
                save_checkpoint(
                    self.model, policy.network(), checkpoints / f"model_{self.num_timesteps}_steps.zip"
                )
                atomic_write_text(checkpoints / "curve.json", json.dumps({"timesteps": int(self.num_timesteps),
                    "seconds": seconds(), "wall_s": wall(), "curve": curve}))  # fmt: skip
                for _, old in checkpoint_files(checkpoints)[:-2]:
                    old.unlink(missing_ok=True)

        def _evaluate(self) -> None:
            if make_eval is None or self.num_timesteps < self.next:
                return
            self.next = self.num_timesteps + eval_every
            a = time.perf_counter()
            policy.attach(self.model)  # a numpy copy of the actor as it is now
            g = float(np.median(run_policy(make_eval(), policy)))
            eval_s[0] += time.perf_counter() - a
            curve.append({"timesteps": int(self.num_timesteps), "seconds": seconds(), "goodput": g})

        def _on_step(self) -> bool:
            return True

    remaining = int(timesteps) - int(model.num_timesteps)
    if remaining > 0:
        model.learn(total_timesteps=remaining, progress_bar=progress, callback=Curve(),
                    reset_num_timesteps=model.num_timesteps == 0)  # fmt: skip
    policy.attach(model)
    policy.train_wall_s = wall()  # PPO's wall seconds, evaluations included, across resumes
    return policy, curve


def _saved_curve(path: Path, step: int) -> tuple[list[dict[str, float]], float, float]:
    """The learning curve, training seconds and wall seconds a checkpoint at ``step`` was written with
    (``curve.json``); none (a fresh start, or a file torn, hand-edited or of another step): an empty curve from
    0 s. Points after ``step`` go."""
    import math

    from env.safe_zip import ArchiveProblem, parse_json

    if step == 0 or not path.is_file() or path.stat().st_size > 1 << 24:
        return [], 0.0, 0.0
    try:
        saved = parse_json(path.read_bytes())
    except (ArchiveProblem, OSError):  # a torn curve loses the curve only, never the run
        return [], 0.0, 0.0
    if not isinstance(saved, dict) or saved.get("timesteps") != step:
        return [], 0.0, 0.0

    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x < 1e12

    points = [
        {"timesteps": int(c["timesteps"]), "seconds": float(c["seconds"]), "goodput": float(c["goodput"])}
        for c in saved.get("curve") or []
        if isinstance(c, dict)
        and all(number(c.get(k)) for k in ("timesteps", "seconds", "goodput"))
        and c["timesteps"] <= step
    ]
    secs, wall = saved.get("seconds"), saved.get("wall_s")
    return points, float(secs) if number(secs) else 0.0, float(wall) if number(wall) else 0.0


def describe(policy: Any) -> str:
    p = getattr(policy, "params", lambda: {})()
    return json.dumps({k: v for k, v in p.items() if k != "cost"})


__all__ = ["BatchTablePolicy", "BucketUCB", "SmartSpecPolicy", "fit_batch_table", "run_policy", "static_goodputs",
           "train_serve_ppo", "trt_auto"]  # fmt: skip
