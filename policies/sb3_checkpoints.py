"""stable-baselines3 training checkpoints as data (``policies.rl_train`` resumes from them): nothing here unpickles.

A checkpoint (``save_checkpoint``) is a zip of ``state.json`` (counters: ``num_timesteps``, ...),
``policy.safetensors``, ``optimizer.pt`` (``torch.save`` of the optimizer's state dict, read back with
``weights_only=True``, its records stored, not deflated) and, for DQN, ``replay_buffer.npz`` (read with
``allow_pickle=False``); ``read_checkpoint`` checks every part's types, shapes and finiteness before
``apply_checkpoint`` puts it into a model.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.archive import npz_bytes, one_line, read_archive, read_npz, write_archive
from policies.base import PolicyError
from policies.sb3_files import (
    read_tensors,
    read_torch_tensors,
    tensor_bytes,
    torch_bytes,
)

CHECKPOINT_FORMAT = "draftgym-sb3-checkpoint"
CHECKPOINT_VERSION = 1
COUNTERS = ("num_timesteps", "_n_updates", "_episode_num", "_n_calls", "exploration_rate")
BUFFER_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")

# ---- training checkpoints ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    network: dict[str, Any]
    counters: dict[str, Any]
    state: dict[str, Any]
    optimizer: dict[str, Any]
    buffer: dict[str, np.ndarray] | None
    buffer_pos: dict[str, Any] | None


def save_checkpoint(model: Any, network: dict[str, Any], path: Path) -> None:
    """Write ``model``'s training state atomically (temporary name, then rename)."""
    meta: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "network": network,
        "counters": {k: getattr(model, k) for k in COUNTERS if hasattr(model, k)},
    }
    files = {
        "policy.safetensors": tensor_bytes(model.policy.state_dict()),
        "optimizer.pt": torch_bytes(model.policy.optimizer.state_dict()),
    }
    rb = getattr(model, "replay_buffer", None)
    if rb is not None:
        arrays = {k: getattr(rb, k) for k in BUFFER_ARRAYS if getattr(rb, k, None) is not None}
        files["replay_buffer.npz"] = npz_bytes(**arrays)
        meta["replay_buffer"] = {"pos": int(rb.pos), "full": bool(rb.full)}
    write_archive(path, "state.json", meta, files, compression=zipfile.ZIP_STORED)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint as data; a torn or foreign file is a ``PolicyError``."""
    if not path.is_file():  # a FIFO would block the read, a device (/dev/zero) never end it
        raise PolicyError(f"checkpoint {path} is not a regular file")
    meta, files = read_archive(
        path, "state.json", CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "draftgym checkpoint"
    )
    for name in ("policy.safetensors", "optimizer.pt"):
        if name not in files:
            raise PolicyError(f"{path} lacks {name}")
    optimizer = read_torch_tensors(files["optimizer.pt"], f"{path}: optimizer.pt")
    if not isinstance(optimizer, dict):
        raise PolicyError(f"{path}: optimizer.pt is not an optimizer state dict")
    buffer = None
    if "replay_buffer.npz" in files:
        buffer = read_npz(files["replay_buffer.npz"], f"{path}: replay_buffer.npz")
    network, counters = meta.get("network", {}), meta.get("counters", {})
    if not isinstance(network, dict):
        raise PolicyError(f"{path}: state.json's network is {type(network).__name__}, not an object")
    if not isinstance(counters, dict):
        raise PolicyError(f"{path}: state.json's counters is {type(counters).__name__}, not an object")
    for key, value in counters.items():
        if key not in COUNTERS or isinstance(value, bool) or not isinstance(value, int | float):
            raise PolicyError(
                f"{path}: state.json's counter {key[:40]!r} is {str(value)[:40]} "
                f"(counters: numbers named {', '.join(COUNTERS)})"
            )
    return Checkpoint(
        network=network,
        counters=counters,
        state=read_tensors(files["policy.safetensors"], f"{path}: policy.safetensors"),
        optimizer=optimizer,
        buffer=buffer,
        buffer_pos=meta.get("replay_buffer"),
    )


def apply_checkpoint(model: Any, ckpt: Checkpoint, network: dict[str, Any], source: str) -> None:
    """Load ``ckpt`` into a fresh ``model`` built for ``network``; a checkpoint of another network is refused."""
    if ckpt.network != network:
        diff = sorted(k for k in {*ckpt.network, *network} if ckpt.network.get(k) != network.get(k))
        raise PolicyError(
            f"{source} was written by a training with other settings ({', '.join(diff)}); "
            "train into another run directory or delete its checkpoints"
        )
    try:  # a checkpoint of this network whose tensors or counters were mangled: one line, not torch's paragraph
        model.policy.load_state_dict(ckpt.state, strict=True)
        model.policy.optimizer.load_state_dict(ckpt.optimizer)
        check_optimizer(model.policy.optimizer)
        counters = {}
        for key, value in ckpt.counters.items():
            if key in COUNTERS and hasattr(model, key):
                kind = type(getattr(model, key))
                if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) < 2**62:
                    raise ValueError(f"counter {key} is {str(value)[:40]}")
                counters[key] = kind(value)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, OverflowError) as err:
        raise PolicyError(f"{source} is corrupted ({one_line(err)})") from None
    for key, value in counters.items():
        setattr(model, key, value)
    rb = getattr(model, "replay_buffer", None)
    if rb is None or ckpt.buffer is None or ckpt.buffer_pos is None:
        return
    pos, full = (
        (ckpt.buffer_pos.get(k) for k in ("pos", "full"))
        if isinstance(ckpt.buffer_pos, dict)
        else (None,) * 2
    )
    if (
        isinstance(pos, bool)
        or not isinstance(pos, int)
        or not 0 <= pos < rb.buffer_size
        or not isinstance(full, bool)
    ):
        raise PolicyError(
            f"{source}: the replay buffer's position is corrupted ({str(ckpt.buffer_pos)[:60]})"
        )
    for key, arr in ckpt.buffer.items():
        target = getattr(rb, key, None) if key in BUFFER_ARRAYS else None
        if (
            target is None
            or target.shape != arr.shape
            or not np.can_cast(arr.dtype, target.dtype, "same_kind")
        ):
            raise PolicyError(f"{source}: replay buffer {key} does not fit this training's buffer")
        with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, refused below
            arr = arr.astype(target.dtype, copy=False)
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            raise PolicyError(f"{source}: replay buffer {key} holds NaN or infinite values")
        target[...] = arr
    rb.pos, rb.full = pos, full


def check_optimizer(optimizer: Any) -> None:
    """The optimizer state just loaded (torch checks none of it: a moment of another shape fails mid-training, a
    NaN one trains NaN weights): every moment a dense finite tensor of its parameter's shape, every step count a
    finite number >= 0, every setting (lr, betas, eps, ...) free of NaN and infinity. A ``ValueError`` names the
    first problem."""
    import torch

    for group in optimizer.param_groups:
        for key, value in group.items():
            if key != "params" and not _finite(value):
                raise ValueError(f"optimizer setting {key} is {str(value)[:40]}")
        for p in group["params"]:
            for key, v in optimizer.state.get(p, {}).items():
                if key == "step":
                    n = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                    if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n) or n < 0:
                        raise ValueError(f"optimizer step count is {str(v)[:40]}")
                elif v is None:  # SGD's momentum_buffer without momentum
                    continue
                elif not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(p.shape):
                    shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise ValueError(
                        f"optimizer state {key} is {shape}, its parameter has shape {list(p.shape)}"
                    )
                elif not v.is_contiguous() or not bool(torch.isfinite(v).all()):
                    raise ValueError(f"optimizer state {key} is not a dense tensor of finite values")


def _finite(value: Any) -> bool:
    """No NaN or infinity in an optimizer setting (a number, a tensor, or a tuple of them)."""
    import torch

    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return True
