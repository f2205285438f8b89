"""Text renders of the envs (``render_mode="ansi"``): one line for the last reset or step, what a researcher
watching a policy reads — the prompt or load, how far the episode is, the arm taken, what it drafted and kept,
the step's price against a plain autoregressive step, the reward and the return so far."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

RENDER_MODES = ["ansi"]
VECTOR_RENDER = (
    'render_mode {mode!r}: the vector entry point does not render; gymnasium.make_vec("draftgym/{id}-v0", '
    'vectorization_mode="sync", render_mode="ansi") renders each env'
)
RENDER_FPS = 4  # Gymnasium's checkers ask for one; text is not paced (its toy-text envs declare 4 too)


def check_render_mode(mode: Any, error: type[Exception]) -> str | None:
    """``mode`` if it is ``None`` or one of ``RENDER_MODES``; ``error`` naming the valid ones otherwise."""
    if mode is None or (isinstance(mode, str) and mode in RENDER_MODES):
        return mode
    raise error(f"render_mode {mode!r} is not supported; valid: None, {', '.join(map(repr, RENDER_MODES))}")


def no_render_mode(env: Any) -> None:
    """What ``render()`` does without a render mode (as Gymnasium's own envs): a warning, nothing rendered."""
    gym.logger.warn(
        f"render() called on {type(env).__name__} made without a render mode: make it with render_mode='ansi' "
        "for a line per step"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def decode_line(prompt_id: str, generated: int, max_new: int, info: dict[str, Any] | None, reward: float,
                ret: float, done: bool, tail: str | None = None) -> str:  # fmt: skip
    """SpecDecode: ``info`` is the last step's (``None`` right after a reset); ``tail``: the last generated text
    (live only: replay holds no text)."""
    head = f"prompt {prompt_id} · {generated}/{max_new} tokens"
    if info is None:
        return f"{head} · reset"
    line = (
        f"{head} · {info['arm']}: drafted {info['drafted']}, accepted {info['accepted']}, +{info['tokens']} · "
        f"step {_ms(info['cost_s'])} (plain {_ms(info['ar_cost_s'])}) · reward {reward:.3f}, return {ret:.3f}"
        f"{' · done' if done else ''}"
    )
    return line if tail is None else f"{line}\n  …{tail!r}"


def serve_line(step: int, info: dict[str, Any], reward: float | None, ret: float) -> str:
    """SpecServe: ``info`` as the env returns it (after a reset: no ``tokens``)."""
    head = f"load {info['load']} · step {step} · clock {info['clock_s']:.3f} s · queue {info['queue']}"
    if "tokens" not in info:
        return f"{head} · reset"
    arm = info["arm"] if isinstance(info["arm"], str) else " ".join(info["arm"]) or "-"
    line = (
        f"{head} · rows {info['rows']}, nodes {info['nodes']} · {arm}: +{info['tokens']} tokens, accepted "
        f"{info['accepted']} · step {_ms(info['cost_s'])} (plain {_ms(info['ar_cost_s'])}) · reward {reward:.3f}, "
        f"return {ret:.3f}"
    )
    return f"{line} · done, goodput {info['goodput']:.1f} tokens/s" if "goodput" in info else line


__all__ = [
    "RENDER_FPS",
    "RENDER_MODES",
    "VECTOR_RENDER",
    "check_render_mode",
    "decode_line",
    "no_render_mode",
    "serve_line",
]
