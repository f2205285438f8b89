"""Checks of ``reset()`` arguments shared by the vector envs (replay and serving): a seed, the reset options, a
``reset_mask``; and of their integer arguments (``whole``). Each raises the env's own error class (``err``) with
one line naming the problem."""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from typing import Any

import numpy as np
import torch


def whole(value: Any, name: str, err: type[Exception], low: int = 1, high: int | None = None) -> int:
    """An integer argument in ``[low, high]``: a bool, a float or a string is refused, not rounded."""
    if (
        isinstance(value, bool)
        or not isinstance(value, Integral)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise err(f"{name} must be an integer {bounds}, got {repr(value)[:60]}")
    return int(value)


def seed_value(seed: Any, err: type[Exception]) -> int:
    """``seed`` as an int: a non-negative integer (numpy's generators refuse negative ones)."""
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise err(f"seed must be a non-negative integer or None, got {seed!r}")
    return int(seed)


def check_options(options: Any, valid: Iterable[str], err: type[Exception]) -> dict[str, Any]:
    """``options`` as a dict whose keys are all in ``valid`` (a misspelt option is refused, not ignored)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise err(f"reset options must be a dict, got {type(options).__name__}")
    valid = tuple(valid)
    unknown = sorted(map(str, set(options) - set(valid)))
    if unknown:
        raise err(f"unknown reset options {unknown}; valid: {', '.join(valid)}")
    return dict(options)


def reset_mask(mask: Any, num_envs: int, started: bool, err: type[Exception]) -> np.ndarray:
    """A boolean mask of ``num_envs`` envs (``None``: all of them). Before the first reset every env must start:
    an env left out would step from a state no episode set up."""
    if mask is None:
        return np.ones(num_envs, dtype=bool)
    try:
        m = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask)
    except (TypeError, ValueError) as e:
        raise err(f"reset_mask must be an array of {num_envs} booleans: {e}") from None
    if m.shape != (num_envs,) or m.dtype.kind not in "biu":
        raise err(f"reset_mask must be an array of {num_envs} booleans, got shape {m.shape} ({m.dtype})")
    if m.dtype.kind != "b" and not np.isin(m, (0, 1)).all():  # 0/1 are booleans; 2 or -1 were read as True
        raise err(
            f"reset_mask must be an array of {num_envs} booleans, got the value {m[~np.isin(m, (0, 1))][0]}"
        )
    m = m.astype(bool)
    if not started and not m.all():
        raise err("the first reset() starts every env: reset_mask leaves out envs that have no episode yet")
    return m
