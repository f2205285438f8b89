"""A training checkpoint of a draft head (``drafters.train.train_head``: the head, AdamW's state, the counters, the
batch generator and the settings the run's trajectory depends on), read back without running anything from the
file and checked before training steps it: every problem is a one-line ``DrafterError`` (``load_train_state``,
``resume``; ``check_adamw`` raises ``ValueError`` once the state is loaded into the optimizer), not a failure
mid-training nor a NaN head saved at its end; a diverged run saves nothing (``save_train_state``)."""

from __future__ import annotations

import io
import math
import os
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
        why = reason(err) or ("an empty file" if path.stat().st_size == 0 else type(err).__name__)
        raise DrafterError(
            f"training checkpoint {path} is corrupted ({why}); delete it to start over"
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
    head = state["head"]  # (``resume`` checks its names, shapes and values)
    if not isinstance(head, dict) or not all(isinstance(v, torch.Tensor) for v in head.values()):
        raise corrupted(f"its head state: {shown(head)}, not tensors by name")
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
        raise corrupted("its generator state")
    try:  # bytes of the right size may still be no mt19937 state: the resume would fail at its first epoch
        if gen is not None:
            torch.Generator().set_state(gen)
    except RuntimeError as err:
        raise corrupted(f"its generator state: {reason(err)}") from None
    if "settings" in state and not isinstance(settings, dict):  # (a checkpoint from before settings: none)
        raise corrupted(f"its settings: {shown(settings)}")
    return state


def resume(
    path: Path,
    state: dict[str, Any],
    head: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    run: dict[str, Any],
    defaults: dict[str, Any],
    steps: int,
) -> None:
    """Check that the checkpoint goes on with this run, then load its head and AdamW state into ``head`` and
    ``opt``. ``run``: the ``data`` digest, the head's ``config``, ``d2t``, the trajectory ``settings`` (a key an
    older checkpoint lacks: its value in ``defaults``) and ``steps_per_epoch`` (the step must be in its epoch). Once it has trained, a run that gives a step budget must give
    the checkpoint's: the learning-rate schedule follows it, so another (or a CPU budget's checkpoint) would train
    a head no uninterrupted run trains, or hand a longer run's head back as a shorter one's; a CPU budget (``steps``
    0) resumes any. A NaN weight or moment, or a negative step count, would train on into a NaN head."""
    from drafters.heads import load_state

    if state.get("data") is not None and state.get("data") != run["data"]:
        raise DrafterError(
            f"training checkpoint {path} was trained on other data (other prompts, prefills or text); "
            "give the same data to resume, or delete it or use another --work folder to start over"
        )
    d2t = state.get("d2t")
    same_d2t = (
        isinstance(d2t, torch.Tensor) and d2t.shape == run["d2t"].shape and torch.equal(d2t, run["d2t"])
    )
    if state.get("config") != run["config"] or not same_d2t:
        raise DrafterError(
            f"training checkpoint {path} has other head shapes or data ({state.get('config')}); "
            "delete it or use another --work folder"
        )
    saved = {**defaults, **state.get("settings", {})}  # (a checkpoint from before settings were kept: none)
    had = saved.pop("steps", None)  # (None: a checkpoint from before the step budget was kept)
    changed = sorted(k for k in {*saved, *run["settings"]} if saved.get(k) != run["settings"].get(k))
    if "settings" in state and changed:
        raise DrafterError(
            f"training checkpoint {path} was trained with other settings ({', '.join(changed)}: "
            f"{', '.join(str(saved.get(k)) for k in changed)}); give the same ones to resume, or "
            "delete it or use another --work folder to start over"
        )
    if had is not None and (isinstance(had, bool) or not isinstance(had, int) or had < 0):
        raise DrafterError(f"training checkpoint {path} is corrupted (its settings: steps {shown(had)}); "
                           "delete it to start over")  # fmt: skip
    step, epoch, per_epoch = state["step"], state["epoch"], run["steps_per_epoch"]
    if not 0 <= step - epoch * per_epoch <= per_epoch:  # the batches of an epoch it is in
        raise DrafterError(f"training checkpoint {path} is corrupted (step {step} is not in epoch {epoch} of "
                           f"{per_epoch} steps); delete it to start over")  # fmt: skip
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    try:  # the same shapes and data, but mangled tensors: one line, not torch's paragraph
        load_state(head, state["head"], "its head state")
        opt.load_state_dict(state["opt"])
        check_adamw(opt, fresh)
    except (DrafterError, RuntimeError, ValueError, TypeError, KeyError) as err:
        raise DrafterError(
            f"training checkpoint {path} is corrupted ({reason(err)}); delete it to start over"
        ) from None
    if steps and had is not None and had != steps and step > 0:  # (last: a corrupted file is deleted anyway)
        was, flag = (f"--steps {had}", f"--steps {had}") if had else ("a CPU budget", "no --steps")
        raise DrafterError(
            f"training checkpoint {path} is {step} steps into a run of {was} (its learning-rate schedule follows "
            f"it): resume it with {flag}, not --steps {steps}, or delete it or use another --work folder to start "
            "over"
        )


def check_state_path(path: Path) -> None:
    """Before any step: a folder (or other non-file) where the checkpoint or its temporary file goes would fail
    the first save, after the work it was to keep."""
    for p in (path, _tmp(path)):
        if p.exists() and not p.is_file():
            raise DrafterError(f"{p} is not a file (the training checkpoint is written there): remove it or use "
                               "another --work folder")  # fmt: skip


def save_train_state(path: Path, state: dict[str, Any], loss: torch.Tensor | None) -> None:
    """Write ``state`` atomically (a temporary file, then a rename): a kill mid-write keeps the last one. A
    diverged run (a NaN or infinite loss or weight) is refused instead: it saves nothing, so neither the last
    checkpoint nor the head file already there is replaced (the head is saved after its last checkpoint)."""
    from drafters.heads import _finite

    if (loss is not None and not _finite(loss.detach())) or not all(map(_finite, state["head"].values())):
        raise DrafterError(
            f"training diverged by step {state['step']}: the loss or the head's weights are NaN or infinite (try a "
            "lower --lr); nothing saved, the head already there and the last training checkpoint kept"
        )
    buffer = io.BytesIO()  # (torch's own file writer fails a full disk with a RuntimeError, and no file name)
    torch.save(state, buffer)
    try:
        _tmp(path).write_bytes(buffer.getbuffer())
        os.replace(_tmp(path), path)
    except BaseException as err:
        _tmp(path).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err  # (a write's error names no file)
        raise


def _tmp(path: Path) -> Path:
    return path.with_suffix(".tmp")


def check_adamw(opt: torch.optim.Optimizer, fresh: list[dict[str, Any]]) -> None:
    """A loaded AdamW state that training can step (else ``ValueError``): state only for the head's parameters,
    each with a whole step count >= 0 and finite moments of the parameter's shape (``exp_avg_sq`` >= 0), and finite
    hyperparameters of the types of the ``fresh`` ones (those of the optimizer before loading) -- a mangled one
    would fail mid-training, or train on into a NaN head."""
    from drafters.heads import _finite

    params = [q for g in opt.param_groups for q in g["params"]]
    if any(not isinstance(k, torch.Tensor) for k in opt.state):
        raise ValueError("optimizer state for a parameter the head does not have")
    for i, p in enumerate(params):
        entries = opt.state.get(p, {})
        if entries and not {"step", "exp_avg", "exp_avg_sq"} <= set(entries):
            raise ValueError(f"optimizer state of parameter {i} holds {sorted(map(str, entries))}")
        for k, t in entries.items():
            if k == "step":
                ok = isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_complex()
                n = float(t) if ok else math.nan
                if not (math.isfinite(n) and n >= 0 and n.is_integer()):
                    what = shown(t.tolist() if isinstance(t, torch.Tensor) else t)
                    raise ValueError(f"optimizer state step {what} of parameter {i}: not a count of steps")
                continue
            ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape
            if not ok:
                what = f"of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else shown(t)
                raise ValueError(f"optimizer state {k} {what} for a parameter of shape {tuple(p.shape)}")
            if not _finite(t) or (k == "exp_avg_sq" and bool((t < 0).any())):
                raise ValueError(
                    f"optimizer state {k} of parameter {i} holds NaN, infinite or negative values"
                )

    def kind(v: Any) -> type:
        return float if _number(v) else type(v)

    def finite(v: Any) -> bool:  # (betas: a pair)
        if isinstance(v, tuple | list):
            return all(_number(x) and math.isfinite(x) for x in v)
        return not _number(v) or math.isfinite(v)

    for g, want in zip(opt.param_groups, fresh):
        for k, v in want.items():
            got = g.get(k)  # (lr is set at every step: a number too)
            if kind(got) is not kind(v) or not finite(got):
                raise ValueError(f"optimizer setting {k} = {shown(got)}")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


__all__ = ["check_adamw", "check_state_path", "load_train_state", "resume", "save_train_state"]
