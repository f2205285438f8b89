"""A serving policy that picks an arm for each row of the batch, not one for all: ``TableFirstPolicy`` (``table-first``).

Where a table drafter (n-gram, suffix: proposals from the text itself) matches the context, the text repeats and
its chain is cheap and often accepted in full; where it matches nothing, it would draft nothing, and a model head
(eagle3) drafts instead. So, per row, from the row's match depth in the serving observation: the table drafter's
``repeat`` arm where the match reaches ``repeat_at`` tokens, its ``short`` arm where it matches fewer, and the
``other`` arm (a model head's, or ``none``) where it matches nothing (each role may take any arm of the menu;
the fit decides). One rule per batch-size bucket, fitted on
the training prompts in replay (``fit_table_first``: coordinate search over the menu's arms, the best static arm
of the table drafter its start). The batch then verifies one tree per row, padded to the deepest (the batch cost
model prices the step so).

The file is the rule table (JSON), never code (``policies.archive``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from policies.base import BasePolicy, PolicyError, real
from policies.serving import ROW_BLOCK_AT, ROW_WIDTH, _check_serving, merge_levels, rows_of

MATCH_IN_ROW = 4  # the row block's match depth (env.serve_obs.ROW_FEATURES), in units of DEPTH_NORM


class TableFirstPolicy(BasePolicy):
    """``table``: ``[[max_rows, repeat, short, other, repeat_at], ...]`` by increasing ``max_rows`` (the last one
    covers every batch): the arms of the rows whose table-drafter match is >= ``repeat_at`` tokens, shorter, none."""

    type_name = "table_first"
    kind = "heuristic"
    per_row = True  # act returns one arm per row slot

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 table: Sequence[Sequence[Any]], label: str = "table-first") -> None:  # fmt: skip
        super().__init__(arms, obs_size, features)
        self.max_batch = _check_serving(self)
        if not isinstance(table, (list, tuple)) or not table:
            raise PolicyError("table-first: the table must be a non-empty list of rules")
        rows_seen, self.table = 0, []
        for entry in table:
            if not isinstance(entry, (list, tuple)) or len(entry) != 5:
                raise PolicyError(
                    f"table-first: entry {str(entry)[:60]} is not [max_rows, repeat, short, other, repeat_at]"
                )
            r = int(real("table-first max_rows", entry[0], lo=1, hi=1 << 30, integer=True))
            at = int(real("table-first repeat_at", entry[4], lo=1, hi=1 << 10, integer=True))
            if r <= rows_seen:
                raise PolicyError("table-first: max_rows must increase down the table")
            idx = []
            for role, name in zip(("repeat", "short", "other"), entry[1:4]):
                if not isinstance(name, str) or name not in self.arm_names:
                    raise PolicyError(
                        f"table-first: the {role} arm {str(name)[:60]!r} is not in the menu {self.arm_names}"
                    )
                idx.append(self.arm_names.index(name))
            self.table.append((r, *idx, at))
            rows_seen = r
        self.label = str(label)

    def params(self) -> dict[str, Any]:
        names = self.arm_names
        return {"table": [[r, names[a], names[b], names[c], at] for r, a, b, c, at in self.table],
                "label": self.label}  # fmt: skip

    def _entry(self, rows: int) -> tuple[int, int, int, int, int]:
        return next((e for e in self.table if rows <= e[0]), self.table[-1])

    def act(self, obs: np.ndarray | None) -> np.ndarray:  # type: ignore[override]
        """One arm index per row slot (an empty slot: the ``other`` arm; it is ignored)."""
        from env.serve_obs import DEPTH_NORM

        obs = np.asarray(self._check_obs(obs), np.float64)
        _, repeat, short, other, at = self._entry(max(rows_of(obs, self.max_batch), 1))
        block = obs[ROW_BLOCK_AT:].reshape(self.max_batch, ROW_WIDTH)
        match = np.rint(block[:, MATCH_IN_ROW] * DEPTH_NORM)
        return np.where(match >= at, repeat, np.where(match >= 1, short, other)).astype(np.int64)


def has_table_and_other(arms: Sequence[str]) -> bool:
    """Whether a menu gives the rule a choice: arms of the match drafter (a table drafter) and of another drafter."""
    from env.engine import parse_arm
    from env.serve_obs import TABLE_DRAFTERS, match_drafter

    drafters = {parse_arm(a).drafter for a in arms} - {None}
    matched = match_drafter(sorted(drafters))
    return matched in TABLE_DRAFTERS and len(drafters) > 1


REPEAT_AT = (1, 2, 3, 4, 6)  # the match depths fit_table_first tries as the threshold of the repeat arm


def table_first_moves(arms: Sequence[str], levels: Sequence[int], sweeps: int = 2) -> int:
    """How many moves ``fit_table_first`` tries (its progress bar's total)."""
    from env.engine import parse_arm
    from env.serve_obs import match_drafter

    parsed = [parse_arm(a) for a in arms]
    matched = match_drafter([a.drafter for a in parsed if a.drafter is not None])
    table = sum(1 for a in parsed if a.drafter in (None, matched))
    return len(levels) * sweeps * (table + 2 * len(arms) + len(REPEAT_AT))


def fit_table_first(make: Callable[..., Any], arms: Sequence[str], obs_size: int, features: Sequence[str] | None,
                    levels: Sequence[int], goodputs: dict[str, dict[str, float]], *, episodes: int = 8,
                    seed: int = 0, sweeps: int = 2, tick: Callable[[], object] | None = None
                    ) -> TableFirstPolicy:  # fmt: skip
    """Fit the rule of each concurrency in ``levels`` on ``make(n, loads=[level], seed=...)`` streams (replay of the
    training prompts): coordinate search, ``sweeps`` passes over (repeat, short, other, repeat_at), each move kept
    when it raises the median goodput; it starts from the best static arm of the table drafter at that level
    (``goodputs``: ``static_goodputs``), that arm for all three roles (the rule then serves as that arm).
    ``tick``: called after each move tried (``table_first_moves`` of them), for a progress bar."""
    from env.engine import parse_arm
    from env.serve_obs import TABLE_DRAFTERS, match_drafter
    from policies.serving import run_policy

    parsed = [parse_arm(a) for a in arms]
    matched = match_drafter([a.drafter for a in parsed if a.drafter is not None])
    table_arms = [a.name for a in parsed if a.drafter in (None, matched)]
    if matched not in TABLE_DRAFTERS:
        raise PolicyError("table-first needs a table drafter's arms (ngram, suffix) in the menu")
    scores: dict[tuple, float] = {}

    def score(level: int, entry: tuple) -> float:
        if (level, *entry) not in scores:
            pol = TableFirstPolicy(arms, obs_size, features, table=[[1 << 30, *entry]])
            sim = make(episodes, loads=[str(level)], seed=seed)
            sim.reset()
            scores[(level, *entry)] = float(np.median(run_policy(sim, pol)))
        return scores[(level, *entry)]

    rows: list[list[Any]] = []
    choices = (table_arms, list(arms), list(arms), REPEAT_AT)
    for level in levels:
        best_static = max(table_arms, key=lambda a: goodputs[str(level)].get(a, -np.inf))  # noqa: B023
        entry: tuple = (best_static, best_static, best_static, 3)
        for _ in range(sweeps):
            for k, options in enumerate(choices):
                for v in options:
                    trial = entry[:k] + (v,) + entry[k + 1 :]
                    if score(level, trial) > score(level, entry):
                        entry = trial
                    if tick is not None:
                        tick()
        rows.append([int(level), *entry])
    return TableFirstPolicy(arms, obs_size, features, table=merge_levels(rows))


__all__ = ["TableFirstPolicy", "fit_table_first", "has_table_and_other", "table_first_moves"]
