"""What a sweep trial scores, on cases whose answer is known: the analytic backend's per-prompt values for a tree
(``n`` nodes over ``d`` levels, acceptance spread +-0.1 over the prompts) and their mean, and which prompts of a
replay trace the workload selection keeps (categories, then ``per_category``, then ``limit``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from env.metrics import chain_expected_tokens
from experiments.config import ConfigError, load_config
from experiments.objective import AnalyticEvaluator, replay_prompts


def _analytic(objective: str = "speedup", limit: int = 3):
    text = (f'methods = ["ar", "ngram-d3-k2-b6"]\n[workload]\nlimit = {limit}\n[sweep]\nanalytic_alpha = 0.7\n'
            f'objective = "{objective}"\n')  # fmt: skip
    seen = []
    out = AnalyticEvaluator()(load_config(None, text=text), {}, lambda step, v, n: seen.append((step, v, n)))
    return out, seen


def _tree_tau(alpha: float) -> float:
    # 6 nodes over 3 levels: each level accepted with probability 1 - (1 - alpha)^(6/3)
    return chain_expected_tokens(1 - (1 - alpha) ** 2, 3)


def test_the_analytic_tree_spreads_alpha_over_the_prompts_and_averages():
    out, seen = _analytic()
    taus = [_tree_tau(a) for a in (0.6, 0.7, 0.8)]  # 0.7 - 0.1, 0.7, 0.7 + 0.1
    speedups = [t / (1 + 0.05 * 6) for t in taus]  # a cost of one AR step plus 0.05 per node
    assert out["per_prompt"] == pytest.approx(speedups)
    assert out["value"] == pytest.approx(sum(speedups) / 3)
    assert [(s, n) for s, _, n in seen] == [(0, 3), (1, 3), (2, 3)]
    tau, _ = _analytic("tau")
    assert tau["per_prompt"] == pytest.approx(taus)


def test_the_analytic_backend_scores_four_prompts_without_a_limit():
    out, _ = _analytic(limit=0)
    assert len(out["per_prompt"]) == 4


def _trace(cats: list[str]):
    return SimpleNamespace(
        prompt_ids=[f"p{i}" for i in range(len(cats))], header={"prompts": {"categories": cats}}
    )


def _cfg(workload: str):
    return load_config(None, text=f'methods = ["ar", "ngram-d2"]\n[workload]\n{workload}\n')


CATS = ["qa", "code", "qa", "code", "qa", "copy"]
PIDS = [f"p{i}" for i in range(6)]


@pytest.mark.parametrize(
    "workload, kept",
    [
        ("", PIDS),
        ('categories = ["qa"]', ["p0", "p2", "p4"]),
        ("per_category = 2", ["p0", "p1", "p2", "p3", "p5"]),
        ("per_category = 1", ["p0", "p1", "p5"]),
        ("limit = 2", ["p0", "p1"]),
        ('categories = ["qa", "copy"]\nper_category = 2\nlimit = 3', ["p0", "p2", "p5"]),
    ],
)
def test_a_replay_sweep_scores_the_prompts_the_workload_keeps(workload, kept):
    assert replay_prompts(_cfg(workload), _trace(CATS), PIDS) == kept


def test_a_replay_selection_of_an_unknown_category_is_refused():
    with pytest.raises(ConfigError, match="workload.categories \\['math'\\]"):
        replay_prompts(_cfg('categories = ["math"]'), _trace(CATS), PIDS)
