"""A training checkpoint of a draft head (``drafters.train.train_head``: the head, AdamW's state, the counters, the
batch generator and the settings the run's trajectory depends on), read back without running anything from the
file and checked before training steps it: every problem is a one-line ``DrafterError`` (``load_train_state``) or
``ValueError`` (``check_adamw``, once the state is loaded into the optimizer), not a failure mid-training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drafters.base import DrafterError, reason, shown


def load_train_state(path: Path) -> dict[str, Any]:
    """A training checkpoint: tensors and plain data only (``weights_only``), so a file that pickles anything
    else is refused, never run. Every problem is a one-line ``DrafterError``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
        raise DrafterError(
            f"training checkpoint {path} is corrupted ({reason(err)}); delete it to start over"
        ) from err
    if not isinstance(state, dict) or not {"head", "opt", "step", "cpu_s", "epoch"} <= set(state):
        raise DrafterError(
            f"training checkpoint {path} is not a draftgym head checkpoint; delete it to start over"
        )

    def corrupted(what: str) -> DrafterError:
        return DrafterError(f"training checkpoint {path} is corrupted ({what}); delete it to start over")

    counters = [state[k] for k in ("step", "epoch", "cpu_s")]
    counts = [isinstance(v, int) for v in counters[:2]] + [isinstance(counters[2], int | float)]
    if not all(ok and not isinstance(v, bool) and 0 <= v < 1e12 for ok, v in zip(counts, counters)):
        raise corrupted(f"its counters: {counters}")
    opt = state["opt"]  # (its param_groups: torch checks them, ``check_adamw`` their values)
    if not isinstance(opt, dict) or not isinstance(opt.get("state", {}), dict):
        raise corrupted("its optimizer state is not AdamW's")
    # AdamW's per parameter: step (a count, a tensor or an older checkpoint's number), exp_avg, exp_avg_sq
    for i, entries in opt.get("state", {}).items():
        if not isinstance(entries, dict):
            raise corrupted(f"optimizer state of parameter {shown(i)}: {shown(entries)}")
        for k, v in entries.items():
            count = k == "step" and isinstance(v, int | float) and not isinstance(v, bool)
            if not (isinstance(v, torch.Tensor) or count):
                raise corrupted(
                    f"optimizer state {shown(k)} of parameter {shown(i)}: {shown(v)}, not a tensor"
                )
    gen, settings = state.get("gen"), state.get("settings")
    size = torch.Generator().get_state().numel()  # the batch generator's state, as a resume sets it
    if gen is not None and not (
        isinstance(gen, torch.Tensor) and gen.dtype == torch.uint8 and tuple(gen.shape) == (size,)
    ):
        raise DrafterError(
            f"training checkpoint {path} is corrupted (its generator state); delete it to start over"
        )
    if "settings" in state and not isinstance(settings, dict):  # (a checkpoint from before settings: none)
        raise corrupted(f"its settings: {shown(settings)}")
    return state


def check_adamw(opt: torch.optim.Optimizer, fresh: list[dict[str, Any]]) -> None:
    """A loaded AdamW state that training can step (else ``ValueError``): state only for the head's parameters,
    each with its step count and moments of the parameter's shape, and hyperparameters of the types of the
    ``fresh`` ones (those of the optimizer before loading) -- a mangled one would fail mid-training."""
    params = [q for g in opt.param_groups for q in g["params"]]
    if any(not isinstance(k, torch.Tensor) for k in opt.state):
        raise ValueError("optimizer state for a parameter the head does not have")
    for i, p in enumerate(params):
        entries = opt.state.get(p, {})
        if entries and not {"step", "exp_avg", "exp_avg_sq"} <= set(entries):
            raise ValueError(f"optimizer state of parameter {i} holds {sorted(map(str, entries))}")
        for k, t in entries.items():
            if k == "step":
                ok = isinstance(t, torch.Tensor) and t.numel() == 1 and bool(torch.isfinite(t).all())
            else:
                ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape
            if not ok:
                what = f"of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else shown(t)
                raise ValueError(f"optimizer state {k} {what} for a parameter of shape {tuple(p.shape)}")

    def kind(v: Any) -> type:
        return float if isinstance(v, int | float) and not isinstance(v, bool) else type(v)

    for g, want in zip(opt.param_groups, fresh):
        for k, v in want.items():
            if kind(g.get(k)) is not kind(v):  # (lr is set at every step: a number too)
                raise ValueError(f"optimizer setting {k} = {shown(g.get(k))}")


__all__ = ["check_adamw", "load_train_state"]
