"""Training a stable-baselines3 policy (``policies.rl.SB3Policy``) on the vectorized replay env: the time-saved
reward, checkpoints (tensors and JSON, ``policies.sb3_checkpoints``; a killed run resumes from the latest readable one),
the replay evaluation callback, ``best.zip``, and when training reached its plateau.

``train_sb3`` writes into its run directory: ``tb/`` (TensorBoard), ``checkpoints/`` (every ``checkpoint_freq``
steps, atomically), ``eval.jsonl`` (the replay speedup of the deterministic policy on validation prompts every
``eval_freq`` steps, with the wall and CPU seconds spent so far), ``best.zip`` (the best policy by that speedup) and
``best.json`` (the step and speedup of the evaluation that made it). Each new best is kept in ``best_history/``
(``best_STEP.zip``, small policy files) until a checkpoint makes it unreachable, so that a resumed run, which drops
the evaluations after the checkpoint it resumes from, also drops the bests they made: ``best.zip`` is then the best
of the evaluations kept.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from env.files import Appending, atomic_write_bytes, atomic_write_text, jsonl_lines, settings_conflict
from policies.archive import is_policy_zip, is_sb3_zip
from policies.base import PolicyError, load_policy
from policies.rl import SB3Policy
from policies.sb3_checkpoints import apply_checkpoint, read_checkpoint, save_checkpoint


def time_saved_wrapper(venv: Any) -> Any:
    """Replace the env's reward by ``tokens - cost_s / ar_cost_s`` (autoregressive steps saved by the step)."""
    from stable_baselines3.common.vec_env import VecEnvWrapper

    class TimeSaved(VecEnvWrapper):
        def reset(self) -> np.ndarray:
            return self.venv.reset()

        def step_wait(self):
            obs, _, dones, infos = self.venv.step_wait()
            reward = np.array([i["tokens"] - i["cost_s"] / i["ar_cost_s"] for i in infos], dtype=np.float32)
            return obs, reward, dones, infos

    return TimeSaved(venv)


def checkpoint_files(folder: Path) -> list[tuple[int, Path]]:
    """The training checkpoints in ``folder`` (``model_STEP_steps.zip``), by step, oldest first."""
    out = []
    for p in folder.glob("model_*_steps.zip"):
        m = re.fullmatch(r"model_(\d+)_steps\.zip", p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _callbacks(policy: SB3Policy, out: Path, eval_fn, eval_freq: int, checkpoint_freq: int, n_envs: int):
    """Checkpoints (atomic, replay buffer included: ``policies.sb3_checkpoints.save_checkpoint``) and the replay eval."""
    from stable_baselines3.common.callbacks import BaseCallback

    log = out / "eval.jsonl"
    prev = eval_rows(log)
    base_wall = prev[-1]["wall_s"] if prev else 0.0
    base_cpu = prev[-1]["cpu_s"] if prev else 0.0
    best = _best_speedup(out, prev)

    class Train(BaseCallback):
        def _on_training_start(self) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.next_eval = (self.num_timesteps // eval_freq + 1) * eval_freq
            self.next_ckpt = (self.num_timesteps // checkpoint_freq + 1) * checkpoint_freq
            self.best = best
            self.evaluated_at = prev[-1]["timesteps"] if prev else -1
            if not prev:
                self._evaluate()

        def _evaluate(self) -> None:
            if self.num_timesteps == self.evaluated_at:  # the closing evaluation at a step just evaluated
                return
            self.evaluated_at = int(self.num_timesteps)
            speedup = float(eval_fn(policy))
            row = {
                "timesteps": int(self.num_timesteps),
                "wall_s": round(base_wall + time.perf_counter() - self.t0, 2),
                "cpu_s": round(base_cpu + time.process_time() - self.c0, 2),
                "replay_speedup": speedup,
            }
            if speedup > self.best:  # saved before its row: a row that says best always has its file
                self.best = speedup
                _save_best(policy, out, int(self.num_timesteps), speedup)
            with Appending(log) as fh:
                fh.write(json.dumps(row) + "\n")
            self.logger.record("eval/replay_speedup", speedup)

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.next_eval += eval_freq
                self._evaluate()
            if self.num_timesteps >= self.next_ckpt:
                self.next_ckpt += checkpoint_freq
                ckpt = out / "checkpoints"
                ckpt.mkdir(parents=True, exist_ok=True)
                save_checkpoint(self.model, policy.network(), ckpt / f"model_{self.num_timesteps}_steps.zip")
                for _, old in checkpoint_files(ckpt)[:-2]:  # keep the last two
                    old.unlink(missing_ok=True)
                _prune_bests(out, checkpoint_files(ckpt)[0][0])
            return True

    return Train()


def eval_rows(log: Path) -> list[dict[str, Any]]:
    """The evaluations in ``eval.jsonl`` (a torn last line, from a kill mid-write, is cut from the file; a line
    that is not an evaluation row of finite numbers is skipped)."""
    rows = []
    for line in jsonl_lines(log):
        try:
            r = json.loads(line)
            row = {"timesteps": int(r["timesteps"]), "wall_s": float(r["wall_s"]),
                   "cpu_s": float(r["cpu_s"]), "replay_speedup": float(r["replay_speedup"])}  # fmt: skip
        except (ValueError, RecursionError, KeyError, TypeError, OverflowError):  # Overflow: int(Infinity)
            continue
        if all(math.isfinite(v) for v in row.values()):
            rows.append(row)
    return rows


def _resume(policy: SB3Policy, model: Any, folder: Path) -> None:
    """Load the latest readable checkpoint of ``folder`` into the fresh ``model`` (none: start afresh). The
    evaluations a killed run logged after that checkpoint are dropped from ``eval.jsonl``: they are run again; so
    are the bests they made (``_resume_best``)."""
    resume_model(policy, model, folder)
    log = folder.parent / "eval.jsonl"
    rows = eval_rows(log)
    keep = [r for r in rows if r["timesteps"] <= model.num_timesteps]
    if len(keep) < len(rows):
        atomic_write_text(log, "".join(json.dumps(r) + "\n" for r in keep))
    _resume_best(folder.parent, int(model.num_timesteps), rows, keep)


def _bests(out: Path) -> list[tuple[int, Path]]:
    """The bests kept in ``out/best_history`` (``best_STEP.zip``), by step."""
    found = []
    for p in (out / "best_history").glob("best_*.zip"):
        m = re.fullmatch(r"best_(\d+)\.zip", p.name)
        if m and p.is_file():  # not a FIFO, whose read would block
            found.append((int(m.group(1)), p))
    return sorted(found)


def _save_best(policy: SB3Policy, out: Path, step: int, speedup: float) -> None:
    """A new best: kept in the history, then as ``best.zip`` and ``best.json`` (each written atomically)."""
    kept = out / "best_history" / f"best_{step}.zip"
    kept.parent.mkdir(parents=True, exist_ok=True)
    policy.save(kept)  # a draftgym policy file, written atomically
    atomic_write_bytes(out / "best.zip", kept.read_bytes())
    atomic_write_text(out / "best.json", json.dumps({"timesteps": step, "replay_speedup": speedup}))


def _prune_bests(out: Path, floor: int) -> None:
    """Drop the bests no resume can come back to: a resume starts at a kept checkpoint (step >= ``floor``), and
    needs only the latest best at or before it."""
    below = [p for s, p in _bests(out) if s <= floor]
    for p in below[:-1]:
        p.unlink(missing_ok=True)


def _saved(path: Path) -> bool:
    """Whether ``path`` is a saved model: a draftgym policy file, or stable-baselines3's own (older runs')."""
    return is_policy_zip(path) or is_sb3_zip(path)


def _resume_best(out: Path, step: int, rows: list[dict[str, Any]], keep: list[dict[str, Any]]) -> None:
    """After a resume at ``step``: the bests made after it are dropped, and ``best.zip``/``best.json`` are the
    latest best at or before it (none: no best yet). A ``best.zip`` without a history (a run from before it was
    kept) was made at ``best.json``'s step, or else by the first evaluation of the highest speedup: adopted into
    the history when that step is kept, removed when it is dropped, left as it is when nothing tells."""
    best, meta = out / "best.zip", out / "best.json"
    if best.is_file() and not _bests(out) and not _saved(best):  # (adopted, it would be refused as history)
        raise PolicyError(f"{best} is not a saved model (damaged?); delete it to resume without it")
    if best.is_file() and not _bests(out):
        made = _recorded_step(meta)
        if made is None and rows:
            top = max(r["replay_speedup"] for r in rows)
            made = next(r["timesteps"] for r in rows if r["replay_speedup"] == top)
        if made is None:
            return
        if made <= step:
            atomic_write_bytes(out / "best_history" / f"best_{made}.zip", best.read_bytes())
    history = _bests(out)
    for s, p in history:
        if s > step:
            p.unlink(missing_ok=True)
    reachable = [(s, p) for s, p in history if s <= step]
    if not reachable:
        best.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        return
    s, p = reachable[-1]
    if not _saved(p):  # a damaged one replaced a good best.zip, and was refused after the training
        raise PolicyError(f"{p} is not a saved model (damaged?); delete it to resume without it")
    data = p.read_bytes()
    if not best.is_file() or best.read_bytes() != data:
        atomic_write_bytes(best, data)
    speedup = next((r["replay_speedup"] for r in keep if r["timesteps"] == s), None)
    if speedup is None and _recorded_step(meta) == s:
        return  # best.json says it already
    atomic_write_text(meta, json.dumps({"timesteps": s, "replay_speedup": speedup}))


def _best_json(meta: Path) -> dict[str, Any]:
    """What ``best.json`` holds (empty: none, not a regular file, or not a JSON object)."""
    if not meta.is_file():
        return {}
    try:
        d = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {}
    return d if isinstance(d, dict) else {}


def _recorded_step(meta: Path) -> int | None:
    """The step ``best.json`` names (None: no readable one)."""
    v = _best_json(meta).get("timesteps")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _best_speedup(out: Path, rows: list[dict[str, Any]]) -> float:
    """The speedup a new evaluation must beat to be the best: that of ``best.zip`` (``best.json``); none there,
    -inf (the next evaluation makes one)."""
    if not (out / "best.zip").is_file():
        return -np.inf
    v = _best_json(out / "best.json").get("replay_speedup")
    try:
        speedup = float(v) if isinstance(v, int | float | str) and not isinstance(v, bool) else math.nan
    except (ValueError, OverflowError):  # a string that is no number, an integer of 400 digits
        speedup = math.nan
    if math.isfinite(speedup):
        return speedup
    return max((r["replay_speedup"] for r in rows), default=-np.inf)


def resume_model(policy: SB3Policy, model: Any, folder: Path) -> None:
    """Load the latest readable checkpoint of ``folder`` into ``model`` (a torn one: the one before; none: as built).
    A checkpoint that is not a regular file (a FIFO would block the read) is refused."""
    for step, path in reversed(checkpoint_files(folder)):
        if not path.is_file():
            raise PolicyError(
                f"checkpoint {path} is not a regular file; delete it to resume from the one before"
            )
        try:
            ckpt = read_checkpoint(path)
        except PolicyError:
            if is_sb3_zip(path):
                raise PolicyError(
                    f"{path} is a checkpoint of an earlier draftgym (a pickled stable-baselines3 zip, not read); "
                    f"delete {folder} to train afresh"
                ) from None
            continue  # torn by a kill: try the one before
        done = ckpt.counters.get("num_timesteps")
        if (
            done != step
        ):  # (a counter past the budget skipped the training, and the policy was saved as trained)
            raise PolicyError(
                f"checkpoint {path} counts {str(done)[:40]} steps, not the {step} of its name: it is corrupted; "
                "delete it to resume from the one before"
            )
        apply_checkpoint(model, ckpt, policy.network(), str(path))
        return


def _check_budget(out: Path, total_timesteps: int, done: int) -> None:
    """A folder remembers the largest ``total_timesteps`` it trained toward (``budget.json``). A rerun may extend
    the run, or finish a longer run killed before the new budget; one that asks for fewer steps than the run
    already resumed from (``done``) of a longer budget would return a best model trained past its budget, labelled
    with it (``PolicyError``). (A run finished at its own budget stops a rollout past it: not refused.)"""
    path = out / "budget.json"
    try:
        before = json.loads(path.read_text(encoding="utf-8"))["total_timesteps"] if path.is_file() else None
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        before = None  # torn or odd: written again below
    if not isinstance(before, int) or isinstance(before, bool):
        before = None
    if before is not None and total_timesteps < min(before, done):
        raise PolicyError(
            f"{out} holds a run toward {before} timesteps already {done} steps in, past {total_timesteps}: "
            f"use another output folder, or total_timesteps >= {done} to resume or extend it"
        )
    if before is None or total_timesteps > before:
        atomic_write_text(path, json.dumps({"total_timesteps": total_timesteps}))


def train_sb3(
    policy: SB3Policy,
    venv: Any,
    out: str | Path,
    *,
    total_timesteps: int,
    eval_fn,
    eval_freq: int = 20_000,
    checkpoint_freq: int = 20_000,
    progress: bool = False,
    settings: dict[str, Any] | None = None,
) -> SB3Policy:
    """Train ``policy`` on the stable-baselines3 VecEnv ``venv`` (``env.vector_env.make_sb3_vec_env``) for
    ``total_timesteps`` env steps in all, resuming from ``out/checkpoints`` when a killed run left one there.
    ``eval_fn(policy) -> replay speedup`` scores the deterministic policy on validation prompts. Returns the policy
    holding the best model by that score. ``settings``: what else the run depends on (trace, cost model, prompts),
    kept in ``out/settings.json`` with the policy's parameters, network and env count: a folder holding a run of
    other settings is refused (``PolicyError``), not resumed."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small MLPs: one thread is fastest, and the machine is shared
    try:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("eval.jsonl", "best.json", "best.zip", "budget.json", "settings.json"):
            f = out / name  # read as absent (jsonl_lines) and then appended to: a FIFO there blocked for ever
            if (f.exists() or f.is_symlink()) and not f.is_file():
                raise PolicyError(f"{f} is not a regular file; move it away to train in {out}")
        ident = {
            "params": policy.params(),
            "network": policy.network(),
            "n_envs": venv.num_envs,
            # what an action and an observation mean: another menu of the same size reuses the network's shapes
            "arms": list(policy.arm_names),
            "features": None if policy.features is None else list(policy.features),
            **(settings or {}),
        }
        started = bool(checkpoint_files(out / "checkpoints")) or bool(eval_rows(out / "eval.jsonl"))
        why = settings_conflict(out, ident, started, command="train")  # (an RL training's folder)
        if why:
            raise PolicyError(f"{why}: use another output folder, or the same settings to resume" if "holds" in why
                              else why)  # fmt: skip
        if policy.reward == "time_saved":
            venv = time_saved_wrapper(venv)
        model = policy.build(venv, tensorboard_log=str(out / "tb"))
        _resume(policy, model, out / "checkpoints")
        _check_budget(out, int(total_timesteps), int(model.num_timesteps))
        policy._layers = None  # the numpy copy would go stale while training
        remaining = int(total_timesteps) - int(model.num_timesteps)
        if remaining > 0:
            callback = _callbacks(policy, out, eval_fn, eval_freq, checkpoint_freq, venv.num_envs)
            model.learn(
                total_timesteps=remaining,
                callback=callback,
                reset_num_timesteps=model.num_timesteps == 0,
                tb_log_name=policy.algo,
                progress_bar=progress,
            )
            callback._evaluate()
        best = out / "best.zip"
        if best.is_file():
            policy.attach(load_policy(best, arms=policy.arm_names, obs_size=policy.obs_size).model)
        return policy
    finally:
        torch.set_num_threads(threads)


def plateau(out: str | Path, tol: float = 0.01) -> dict[str, float] | None:
    """When training reached its plateau: the first evaluation within ``tol`` (relative) of the best replay
    speedup in ``out/eval.jsonl``, with its step count and the wall and CPU seconds spent until then."""
    log = Path(out) / "eval.jsonl"
    if not log.is_file():
        return None
    rows = eval_rows(log)
    if not rows:
        return None
    best = max(r["replay_speedup"] for r in rows)
    first = next(r for r in rows if r["replay_speedup"] >= best * (1 - tol))
    return {"best": best, **{k: first[k] for k in ("timesteps", "wall_s", "cpu_s", "replay_speedup")}}
