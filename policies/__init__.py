"""Policies choose an arm (drafter + tree shape) each step: static and heuristic schedules, bandits learned online,
stable-baselines3 RL and scikit-learn accept-length predictors trained in the replay env, and the replay oracles.

``load_policy(path)`` restores any saved policy (the registry ``POLICY_TYPES`` maps its header's type to a class).
"""

from policies.base import (
    KINDS,
    POLICY_TYPES,
    BasePolicy,
    OnlinePolicy,
    Policy,
    PolicyError,
    check_compatible,
    load_policy,
)

__all__ = [
    "KINDS",
    "POLICY_TYPES",
    "BasePolicy",
    "OnlinePolicy",
    "Policy",
    "PolicyError",
    "check_compatible",
    "load_policy",
]
