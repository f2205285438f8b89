"""Fixtures of the policies tests: the synthetic replay env (built once per session; building imports the env
stack, which is slow on a loaded machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def synth_trace():
    from tests.policies.synthetic import synthetic_trace

    return synthetic_trace()


@pytest.fixture(scope="session")
def synth_env(synth_trace):
    from tests.policies.synthetic import synthetic_env

    return synthetic_env(trace=synth_trace)


@pytest.fixture(scope="session")
def synth_split(synth_trace):
    from policies.split import trace_split

    return trace_split(synth_trace, test_per_category=4, seed=0)


@pytest.fixture(scope="session")
def synth_train_env(synth_trace, synth_split):
    from policies.split import subset_trace
    from tests.policies.synthetic import synthetic_env

    return synthetic_env(trace=subset_trace(synth_trace, synth_split.train))
