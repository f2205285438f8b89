"""``ServePredictorPolicy`` (``serve-predictor``): the accept-length predictor with a batch-aware cost rule, for a
serving batch. SmartSpec's rule (``policies.serving.SmartSpecPolicy``) prices every arm of the menu under the batch
cost model and picks the one with the most expected tokens a second; it expects a row's tokens from one acceptance
estimate, the same for every drafter, accepted one by one. This policy learns them instead: a regressor
(``policies.net_arrays``, an MLP by default) maps a row's features — its acceptance estimate, its last accepted
length, the table drafter's match depth, and the batch's rows — to the draft tokens every arm of the menu would
get accepted at that row. Context length and progress are left out: with a few dozen training prompts they name
the prompt, and a regressor that reads them learns the prompts rather than the rows.

Training (``train_serve_predictor``) is replay: at every step of a stream the trace tells what every arm would get
accepted at every row (full information), so one visited state labels all K outputs. States are visited by
SmartSpec with random steps first, then by the learned policy itself (DAgger-style). A regressor trained on few
prompts expects too much on new ones, and argmax over many arms picks the overestimated: a per-load ``shrink``
table scales its predictions down, ``[[max_rows, factor], ...]``, each factor chosen by replay on half the
training prompts with the regressor fitted on the other half (held out from the fit, not from the training
split), then the regressor fitted again on all of them.

The file holds the network as arrays (``model.npz``, no pickle) and the shrink table and cost model as JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from policies.base import PolicyError, real
from policies.net_arrays import NetArrays, check_net_params
from policies.serving import ROW_BLOCK_AT, ROW_WIDTH, ROWS_AT, SmartSpecPolicy, merge_levels, run_policy

ROW_INPUTS = (2, 3, 4)  # the row block's acceptance estimate, last accepted length and match depth
SHRINKS = (0.0, 0.15, 0.3, 0.5, 0.8)  # the factors the fit chooses among, per load level
MAX_FIT_ROWS = 150_000  # rows a fit reads at most (a random subset): a minute of fitting on two cores


class ServePredictorPolicy(NetArrays, SmartSpecPolicy):
    """SmartSpec's pricing with every arm's accepted tokens at every row predicted by a regressor (module doc)."""

    type_name = "serve_predictor"
    kind = "predictor"
    net_name = "serve predictor"

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 cost: dict[str, Any], model: str = "mlp", hidden: int = 64, layers: int = 2, alpha: float = 1e-4,
                 max_iter: int = 200, seed: int = 0,
                 shrink: Sequence[Sequence[Any]] = ((1 << 30, 0.0),)) -> None:  # fmt: skip
        super().__init__(arms, obs_size, features, cost=cost)
        check_net_params(model, hidden, layers, alpha, max_iter, seed, "serve predictor")
        self.model, self.hidden, self.layers = model, int(hidden), int(layers)
        self.alpha, self.max_iter, self.seed = float(alpha), int(max_iter), int(seed)
        self.set_shrink(shrink)
        self.init_net(len(ROW_INPUTS) + 1, self.num_arms)
        self._plain = np.asarray(self.depths == 0)

    def set_shrink(self, table: Any) -> None:
        """``[[max_rows, factor], ...]`` by increasing ``max_rows`` (the last covers every batch), factors in [0, 1)."""
        if not isinstance(table, (list, tuple)) or not table:
            raise PolicyError("serve predictor: shrink must be a non-empty list of [max_rows, factor]")
        rows_seen, rules = 0, []
        for entry in table:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise PolicyError(
                    f"serve predictor: shrink entry {str(entry)[:60]} is not [max_rows, factor]"
                )
            r = int(real("serve predictor shrink max_rows", entry[0], lo=1, hi=1 << 30, integer=True))
            f = real("serve predictor shrink factor", entry[1], lo=0.0, hi=0.99)
            if r <= rows_seen:
                raise PolicyError("serve predictor: max_rows must increase down the shrink table")
            rows_seen = r
            rules.append([r, f])
        self.shrink = rules

    def params(self) -> dict[str, Any]:
        return {"cost": self.cost, "model": self.model, "hidden": self.hidden, "layers": self.layers,
                "alpha": self.alpha, "max_iter": self.max_iter, "seed": self.seed, "shrink": self.shrink}  # fmt: skip

    def factor(self, rows: int) -> float:
        """The shrink factor of a batch of ``rows``: its level's, the last level's above them all."""
        return next((f for r, f in self.shrink if rows <= r), self.shrink[-1][1])

    def expected_tokens(self, obs: np.ndarray, rows: np.ndarray, dd: np.ndarray) -> np.ndarray:
        """Each arm's predicted accepted draft tokens at each live row, shrunk by the batch's factor and kept
        within the chain it drafts there, plus the row's own token."""
        if not self.fitted:
            raise PolicyError("the serve predictor is not trained (draftgym serve-train)")
        x = np.concatenate([rows[:, ROW_INPUTS], np.full((len(rows), 1), obs[ROWS_AT])], 1)
        acc = self.forward(x)  # [R, K]
        if not np.isfinite(acc).all():
            raise PolicyError(
                "the serve predictor's predictions overflow at this observation (corrupted weights?)"
            )
        acc = np.clip(acc.T * (1.0 - self.factor(len(rows))), 0.0, dd)  # [K, R]
        acc[self._plain] = 0.0
        return (1.0 + acc).sum(1)

    def state(self) -> dict[str, bytes]:
        return self.net_state()

    def restore(self, files: dict[str, bytes]) -> None:
        self.restore_net(files, f"{self.n_in} row inputs and {self.num_arms} arms")


# ---- training in replay --------------------------------------------------------------------------------------------


def row_inputs(obs: np.ndarray, max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Serving observations ``[B, F]`` as the regressor's inputs ``[B, M, 4]``, and the live rows ``[B, M]``."""
    obs = np.asarray(obs, np.float64)
    block = obs[:, ROW_BLOCK_AT:].reshape(len(obs), max_batch, ROW_WIDTH)
    rows = np.broadcast_to(obs[:, ROWS_AT, None, None], (len(obs), max_batch, 1))
    return np.concatenate([block[..., ROW_INPUTS], rows], -1), block[..., 0] > 0.5


def collect(make: Callable[..., Any], behavior: Any, loads: Sequence[str], episodes: int, epsilon: float,
            rng: np.random.Generator, seed: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Rows visited by ``behavior`` (a policy; a random arm for the batch with probability ``epsilon``) over
    ``episodes`` streams at each load: their inputs ``[N, 4]`` and every arm's accepted draft tokens ``[N, K]``."""
    xs, ys = [], []
    for j, load in enumerate(loads):
        sim = make(episodes, loads=[load], seed=seed + j)
        sim.reset()
        k, m = len(sim.arms), sim.max_batch
        while not sim.done().all():
            obs = sim.observe().copy()
            x, live = row_inputs(obs, m)
            live &= sim.active
            labels = np.stack([sim.outcome(np.full((sim.num_envs, m), a))["acc"] for a in range(k)], -1)
            xs.append(x[live])
            ys.append(labels[live])
            running = ~sim.done()
            a = np.array([behavior.act(obs[i]) if running[i] else 0 for i in range(sim.num_envs)], np.int64)
            a = np.where(rng.random(sim.num_envs) < epsilon, rng.integers(k, size=sim.num_envs), a)
            sim.step(a)
    return np.concatenate(xs).astype(np.float64), np.concatenate(ys).astype(np.float64)


def _fit(policy: ServePredictorPolicy, make: Callable[..., Any], loads: Sequence[str], episodes: int, rounds: int,
         rng: np.random.Generator, seed: int, tick: Callable[[], object] | None) -> None:  # fmt: skip
    smart = SmartSpecPolicy(policy.arm_names, policy.obs_size, policy.features, cost=policy.cost)
    xs, ys = [], []
    for rnd in range(max(rounds, 1)):
        behavior, eps = (smart, 0.3) if rnd == 0 else (policy, 0.2)
        x, y = collect(make, behavior, loads, episodes, eps, rng, seed + 100 * rnd)
        xs.append(x)
        ys.append(y)
        x_all, y_all = np.concatenate(xs), np.concatenate(ys)
        if len(x_all) > MAX_FIT_ROWS:
            keep = rng.choice(len(x_all), MAX_FIT_ROWS, replace=False)
            x_all, y_all = x_all[keep], y_all[keep]
        policy.fit_net(x_all, y_all, model=policy.model, hidden=policy.hidden, layers=policy.layers,
                       alpha=policy.alpha, max_iter=policy.max_iter, seed=policy.seed)  # fmt: skip
        if tick is not None:
            tick()


def predictor_ticks(prompts: int, levels: int, rounds: int) -> int:
    """The calls ``train_serve_predictor`` makes to ``tick``: a progress bar's total."""
    held = levels if prompts > 1 else 0
    return (2 * rounds if held else rounds) + held


def train_serve_predictor(make_for: Callable[[Sequence[Any]], Any], prompts: Sequence[Any], arms: Sequence[str],
                          obs_size: int, features: Sequence[str], cost: dict[str, Any], *, loads: Sequence[str],
                          levels: Sequence[int], episodes: int = 16, rounds: int = 2, seed: int = 0,
                          tick: Callable[[], object] | None = None, **params: Any) -> ServePredictorPolicy:  # fmt: skip
    """Fit the serve predictor on the training ``prompts`` in replay (``make_for(prompts)``: a simulator factory
    over those prompts, as ``experiments.serve_policies._sim_factory`` makes). The shrink factor of each closed-loop
    concurrency in ``levels`` is the one of ``SHRINKS`` that replays the most goodput on the odd-numbered training
    prompts with the regressor fitted on the even-numbered ones; then the regressor is fitted on all of them.
    ``tick``: called after each fit and each level's choice (``predictor_ticks`` calls). With one training
    prompt there is nothing to hold out: no shrink."""
    rng = np.random.default_rng(seed)
    prompts = list(prompts)

    def new() -> ServePredictorPolicy:
        return ServePredictorPolicy(arms, obs_size, features, cost=cost, seed=seed, **params)

    levels = sorted(int(c) for c in levels) if len(prompts) > 1 else []
    table: list[list[Any]] = []
    if levels:
        half = new()
        _fit(half, make_for(prompts[0::2]), loads, episodes, rounds, rng, seed, tick)
        held = make_for(prompts[1::2])
    for level in levels:
        best = (-np.inf, 0.0)
        for f in SHRINKS:
            half.set_shrink([[1 << 30, f]])
            sim = held(episodes, loads=[str(level)], seed=seed + 7)
            sim.reset()
            best = max(best, (float(np.median(run_policy(sim, half))), -f))  # ties: the smaller factor
        table.append([level, -best[1]])
        if tick is not None:
            tick()
    policy = new()
    policy.set_shrink(merge_levels(table) if table else [[1 << 30, 0.0]])
    _fit(policy, make_for(prompts), loads, episodes, rounds, rng, seed + 1, tick)
    return policy
