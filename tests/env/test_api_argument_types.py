"""The Python API given arguments of the wrong type or size: the project's own error, one line naming the argument,
where it raised a bare ``AttributeError``, ``TypeError`` or ``MemoryError`` from deep inside, or a torch error."""

from __future__ import annotations

import numpy as np
import pytest

from drafters import DrafterError, make_drafter
from env.arms import make_arms
from env.batch_cost import CostModelError, load_batch_cost
from env.model import ModelError
from env.serve_env import ServeEnvError, SpecServeVectorEnv
from env.spec_env import EnvError, SpecDecodeEnv
from env.trace import TraceError, load_trace
from env.vector_env import SpecDecodeVectorEnv


@pytest.mark.parametrize(
    "call, error, needle",
    [
        (
            lambda: load_batch_cost(5),
            CostModelError,
            "a batch cost model is a path",
        ),  # 'int' has no 'draft_s'
        (lambda: SpecServeVectorEnv(2, cost=5), CostModelError, "got int 5"),
        (
            lambda: load_trace(5),
            TraceError,
            "a trace is named by a path, got int 5",
        ),  # expected str, PathLike
        (lambda: make_arms(5), DrafterError, "an arm menu is a list of arms"),  # int is not iterable
        (
            lambda: make_drafter(["ngram"]),
            DrafterError,
            "unknown drafter ['ngram']",
        ),  # unhashable type: 'list'
        (
            lambda: SpecDecodeVectorEnv(10**12),
            EnvError,
            "num_envs must be in 1..16777216",
        ),  # 76 TiB asked of numpy
        (lambda: SpecDecodeVectorEnv(2, device="nope"), EnvError, "device 'nope' is not a torch device"),
        (
            lambda: SpecDecodeEnv(model=5),
            ModelError,
            "a model is a name or a folder, got int 5",
        ),  # no 'startswith'
    ],
)
def test_a_wrong_argument_is_the_projects_error_in_one_line(call, error, needle):
    with pytest.raises(error) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("make", [lambda: SpecDecodeVectorEnv(2), lambda: SpecServeVectorEnv(2)])
def test_a_zero_dimensional_seed_array_is_one_seed(make):
    """``reset(seed=np.array(3))``: ``len() of unsized object``; it is the seed 3."""
    a, b = make(), make()
    assert np.array_equal(a.reset(seed=np.array(3))[0], b.reset(seed=3)[0])
    assert np.array_equal(a.step(a.action_space.sample() * 0)[0], b.step(b.action_space.sample() * 0)[0])


def test_a_reset_mask_of_integers_is_zeros_and_ones():
    """``reset_mask=[2, -1, 0, 0]`` was read as [True, True, False, False]."""
    env = SpecServeVectorEnv(4)
    env.reset(seed=0)
    with pytest.raises(ServeEnvError, match="reset_mask must be an array of 4 booleans, got the value 2"):
        env.reset(options={"reset_mask": [2, -1, 0, 0]})
    env.reset(options={"reset_mask": np.array([1, 0, 0, 1])})  # 0/1 integers are booleans


def test_a_drafter_given_what_is_not_its_own():
    """eagle's propose_batch over another drafter's rows (an AttributeError for its head); ``weights=""`` took the
    default head instead, silently."""
    from drafters import DraftContext, TreeShape
    from drafters.heads import find_head

    with pytest.raises(DrafterError, match="propose_batch drafts its own kind's rows, got a NGramDrafter"):
        make_drafter("eagle").propose_batch([(make_drafter("ngram"), DraftContext([1, 2], 2), TreeShape(2))])
    with pytest.raises(DrafterError, match="eagle: its weights option names no file"):
        find_head("eagle", "smollm2-135m-instruct", " ")
