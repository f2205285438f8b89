"""Batched trace replay: thousands of episodes stepped at once in numpy (CPU) or torch (CPU or GPU) arrays, through
the same ``env.replay`` functions the single env uses.

- ``SpecDecodeVectorEnv``: a ``gymnasium.vector.VectorEnv``, the ``vector_entry_point`` of
  ``draftgym/SpecDecode-v0``: ``gymnasium.make_vec("draftgym/SpecDecode-v0", num_envs=4096,
  vectorization_mode="vector_entry_point")``;
- ``SB3VecEnv``: the same env as a stable-baselines3 ``VecEnv`` (``make_sb3_vec_env(num_envs, ...)``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from env.render import VECTOR_RENDER
from env.replay import replay_observe, replay_step
from env.reset_checks import check_options, reset_mask, seed_value
from env.spec_env import EnvError, RenderModeError, SpecDecodeEnv, count_of

MAX_ENVS = 1 << 24  # replayed envs at most: ~80 bytes each (1.3 GB); the GPU benchmark steps 262,144


class SpecDecodeVectorEnv(VectorEnv):
    """``num_envs`` independent replay episodes of ``SpecDecodeEnv`` (same arguments, replay backend only), plus:

    - ``device``: ``None`` for numpy arrays (the default), or a torch device (``"cpu"``, ``"cuda"``): tables,
      state, observations, rewards and flags are then torch tensors there; actions may be numpy or torch;
    - ``autoreset_mode``: ``"next_step"`` (Gymnasium's default: the step after an episode ends resets it, with
      reward 0) or ``"same_step"`` (reset at once; ``info["final_obs"]`` holds the final observations, rows
      marked in ``info["_final_obs"]``);
    - ``max_episode_steps``: an episode is truncated after that many steps (as Gymnasium's ``TimeLimit`` does to
      each env of a ``sync`` vector env; ``gymnasium.make_vec(..., max_episode_steps=N)`` passes it here).

    ``info`` of a step: ``tokens``, ``accepted``, ``drafted``, ``cost_s``, ``ar_cost_s`` (arrays [B]) and ``arm``
    (arm names with numpy; arm indices with torch; names in ``arm_names``). Reset options: ``prompt_id`` (every
    reset env starts on that prompt) and ``reset_mask`` (reset only those envs).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int = 1024,
        *,
        device: str | torch.device | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        backend: str = "replay",
        max_episode_steps: int | None = None,
        render_mode: str | None = None,
        **kwargs: Any,
    ) -> None:
        if backend != "replay":
            raise EnvError(
                "the vector env replays traces only; for live envs use "
                "gymnasium.make_vec(..., vectorization_mode='sync', backend='live')"
            )
        if render_mode is not None:
            raise RenderModeError(VECTOR_RENDER.format(mode=render_mode, id="SpecDecode"))
        num_envs = count_of("num_envs", num_envs, 1024)  # a bool or a float is refused, not rounded
        if max_episode_steps is not None and count_of("max_episode_steps", max_episode_steps, 0) < 1:
            raise EnvError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        self.max_episode_steps = None if max_episode_steps is None else int(max_episode_steps)
        if not 1 <= num_envs <= MAX_ENVS:  # (10^12 asked numpy for 76 TiB)
            raise EnvError(f"num_envs must be in 1..{MAX_ENVS}, got {num_envs}")
        mode = (
            AutoresetMode(autoreset_mode)
            if isinstance(autoreset_mode, AutoresetMode)
            else _mode(autoreset_mode)
        )
        self.metadata = {"autoreset_mode": mode, "render_modes": []}
        self.render_mode = None
        single = SpecDecodeEnv(backend="replay", **kwargs)  # validates arguments, builds the tables
        self.single = single
        self.arms, self.arm_names, self.feature_names = single.arms, single.arm_names, single.feature_names
        self.prompt_ids = single.prompt_ids
        self.num_envs = num_envs
        self.single_observation_space = single.observation_space
        self.single_action_space = single.action_space
        self.observation_space = batch_space(single.observation_space, self.num_envs)
        self.action_space = spaces.MultiDiscrete(np.full(self.num_envs, len(self.arms)))
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise EnvError(
                f"device {device!r:.40} is not a torch device ({str(err).splitlines()[0]:.80})"
            ) from None
        tb = single.tables
        self.tables = tb if self.device is None else tb.to(self.device)
        self._names = np.array(self.arm_names)
        b, k = self.num_envs, len(self.arms)
        if self.device is None:
            self._rows = np.arange(b)
            self._prompt = np.zeros(b, dtype=np.int64)
            self._pos = np.zeros(b, dtype=np.int64)
            self._hist = np.zeros((b, 2 + k), dtype=np.float32)
            self._pending = np.zeros(b, dtype=bool)
            self._steps = np.zeros(b, dtype=np.int64)
        else:
            kw = {"device": self.device}
            self._rows = torch.arange(b, **kw)
            self._prompt = torch.zeros(b, dtype=torch.long, **kw)
            self._pos = torch.zeros(b, dtype=torch.long, **kw)
            self._hist = torch.zeros(b, 2 + k, dtype=torch.float32, **kw)
            self._pending = torch.zeros(b, dtype=torch.bool, **kw)
            self._steps = torch.zeros(b, dtype=torch.long, **kw)
        self._startable = tb.startable
        self._started = False  # no episode to step before the first reset()

    # ---- helpers ----
    def _array(self, x: Any, dtype: Any) -> Any:
        if self.device is None:
            return np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=dtype)
        tdt = {np.int64: torch.long, np.float32: torch.float32, bool: torch.bool}[dtype]
        return torch.as_tensor(
            np.asarray(x) if not isinstance(x, torch.Tensor) else x, device=self.device
        ).to(tdt)

    def _empty_obs(self, n: int) -> Any:
        f = len(self.feature_names)
        if self.device is None:
            return np.empty((n, f), dtype=np.float32)
        return torch.empty(n, f, dtype=torch.float32, device=self.device)

    def _observe(self) -> Any:
        return replay_observe(
            self.tables, self._prompt, self._pos, self._hist, self._empty_obs(self.num_envs)
        )

    def _reset_rows(self, mask: Any, prompt: int | None = None) -> None:
        """Start new episodes in the rows of ``mask``: a prompt drawn with ``self.np_random``, position 0."""
        idx = np.flatnonzero(mask.cpu().numpy() if isinstance(mask, torch.Tensor) else mask)
        if not idx.size:
            return
        if prompt is None:
            draws = self._startable[self.np_random.integers(len(self._startable), size=idx.size)]
        else:
            draws = np.full(idx.size, prompt, dtype=np.int64)
        rows = self._array(idx, np.int64)
        self._prompt[rows] = self._array(draws, np.int64)
        self._pos[rows] = 0
        self._hist[rows] = 0.0
        self._steps[rows] = 0

    # ---- Gymnasium VectorEnv API ----
    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        if isinstance(seed, np.ndarray) and seed.ndim == 0:  # np.array(3): one seed (len() of it failed)
            seed = seed.item()
        s = seed
        if seed is not None and not isinstance(seed, Integral):  # one seed per env: the first seeds them all
            if not isinstance(seed, (Sequence, np.ndarray)) or isinstance(seed, str) or len(seed) == 0:
                raise EnvError(f"seed must be an integer, a sequence of them or None, got {seed!r}")
            if len(seed) != self.num_envs:  # Gymnasium's rule: one seed per env, no more and no fewer
                raise EnvError(
                    f"seed lists {len(seed)} seeds for {self.num_envs} envs: give one per env or one integer"
                )
            for other in seed[1:]:  # checked as the first is (a -1 after it passed unread)
                if other is not None:
                    seed_value(other, EnvError)
            s = seed[0]
        if s is not None:
            self._np_random, self._np_random_seed = seeding.np_random(seed_value(s, EnvError))
        elif self._np_random is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        options = check_options(options, ("prompt_id", "reset_mask"), EnvError)
        prompt = None
        if "prompt_id" in options:
            pid = str(options["prompt_id"])
            if pid not in self.prompt_ids:
                raise EnvError(f"unknown prompt_id {pid!r}; the trace has {self.prompt_ids[:5]}...")
            prompt = self.prompt_ids.index(pid)
            if int(self.single.tables.length[prompt]) < 2:
                raise EnvError(f"prompt {pid!r} ends after its first token: nothing to decode")
        mask = reset_mask(options.get("reset_mask"), self.num_envs, self._started, EnvError)
        self._reset_rows(mask, prompt)
        self._pending = self._pending & ~self._array(mask, bool)
        self._started = True
        return self._observe(), {}

    def step(self, actions: Any):
        if not self._started:
            raise EnvError("no episode has started: call reset() before step()")
        kind = (
            (
                "i"
                if not (actions.is_floating_point() or actions.is_complex() or actions.dtype == torch.bool)
                else "f"
            )
            if isinstance(actions, torch.Tensor)
            else np.asarray(actions).dtype.kind
        )
        if kind not in "iu":  # as the single env: a float, bool or object action is not an arm index
            raise EnvError(
                f"actions must be integer arm indices (0..{len(self.arms) - 1}), got dtype kind {kind!r}"
            )
        a = self._array(actions, np.int64)
        if a.shape != (self.num_envs,):
            raise EnvError(f"actions must have shape ({self.num_envs},), got {tuple(a.shape)}")
        k = len(self.arms)
        pending = self._pending  # envs that ended last step (next-step autoreset)
        if self.device is None:
            lo, hi, any_pending = int(a.min()), int(a.max()), bool(pending.any())
        else:  # one read back from the device per step, not three
            lo, hi, any_pending = torch.stack([a.min(), a.max(), pending.any().long()]).tolist()
        if lo < 0 or hi >= k:
            bad = lo if lo < 0 else hi
            raise EnvError(
                f"action {bad} is not a valid arm index; valid: 0..{k - 1} ({', '.join(self.arm_names)})"
            )
        mode = self.metadata["autoreset_mode"]
        out = replay_step(self.tables, self._prompt, self._pos, self._hist, self._rows, a)
        self._pos = out.pos
        terminated, truncated = out.terminated, out.truncated
        if self.max_episode_steps is not None:
            self._steps += 1
            truncated = truncated | (self._steps >= self.max_episode_steps)
        reward = out.reward.astype(np.float32) if self.device is None else out.reward.float()
        infos: dict[str, Any] = {
            "tokens": out.tokens,
            "accepted": out.accepted,
            "drafted": out.drafted,
            "cost_s": out.cost_s,
            "ar_cost_s": out.ar_cost_s,
            "arm": self._names[a] if self.device is None else a,
        }
        if mode == AutoresetMode.NEXT_STEP:
            if any_pending:  # these envs ended last step: reset them now, reward 0
                for key in ("tokens", "accepted", "drafted", "cost_s", "ar_cost_s"):
                    infos[key] = infos[key] * ~pending
                reward = reward * ~pending
                self._reset_rows(pending)
                terminated = terminated & ~pending
                truncated = truncated & ~pending
            obs = self._observe()
            self._pending = terminated | truncated
        else:
            done = terminated | truncated
            obs = self._observe()
            if mode == AutoresetMode.SAME_STEP and bool(done.any()):
                infos["final_obs"] = obs  # a fresh array each step: safe to hand out
                infos["_final_obs"] = done
                self._reset_rows(done)
                obs = self._observe()
            elif mode == AutoresetMode.DISABLED:
                self._pending = done
        return obs, reward, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        self.single.close()


def _mode(name: str) -> AutoresetMode:
    table = {
        "next_step": AutoresetMode.NEXT_STEP,
        "same_step": AutoresetMode.SAME_STEP,
        "disabled": AutoresetMode.DISABLED,
    }
    key = str(name).lower().replace("-", "_")
    if key not in table:
        for m in AutoresetMode:
            if m.value == name:
                return m
        raise EnvError(f"unknown autoreset_mode {name!r}; valid: {', '.join(table)}")
    return table[key]


# ---- stable-baselines3 ------------------------------------------------------------------------------------------------


@functools.cache
def _sb3_class() -> type:
    """Built on first use, so that importing this module (``gymnasium.make_vec``) does not import SB3."""
    from stable_baselines3.common.vec_env import VecEnv

    class SB3VecEnv(VecEnv):
        """A ``SpecDecodeVectorEnv`` (numpy, same-step autoreset) as a stable-baselines3 ``VecEnv``: dones, and a
        list of info dicts with ``terminal_observation`` and ``TimeLimit.truncated`` where an episode ended."""

        def __init__(self, venv: SpecDecodeVectorEnv) -> None:
            if venv.device is not None or venv.metadata["autoreset_mode"] != AutoresetMode.SAME_STEP:
                raise EnvError("SB3VecEnv needs a numpy SpecDecodeVectorEnv with autoreset_mode='same_step'")
            self.venv = venv
            self._actions: np.ndarray | None = None
            super().__init__(venv.num_envs, venv.single_observation_space, venv.single_action_space)

        def reset(self) -> np.ndarray:
            obs, _ = self.venv.reset(seed=self._seeds[0])
            self._reset_seeds()
            self._reset_options()
            return obs

        def step_async(self, actions: np.ndarray) -> None:
            self._actions = np.asarray(actions).reshape(self.num_envs)

        def step_wait(self):
            obs, reward, term, trunc, info = self.venv.step(self._actions)
            dones = term | trunc
            cols = {k: info[k].tolist() for k in ("tokens", "accepted", "cost_s", "ar_cost_s", "arm")}
            infos = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
            for i in np.flatnonzero(dones):
                infos[i]["terminal_observation"] = info["final_obs"][i]
                infos[i]["TimeLimit.truncated"] = bool(trunc[i] and not term[i])
            return obs, reward, dones, infos

        def close(self) -> None:
            self.venv.close()

        def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
            return [getattr(self.venv, attr_name)] * len(list(self._get_indices(indices)))

        def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
            setattr(self.venv, attr_name, value)

        def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
            result = getattr(self.venv, method_name)(*args, **kwargs)
            return [result] * len(list(self._get_indices(indices)))

        def env_is_wrapped(self, wrapper_class: Any, indices: Any = None) -> list[bool]:
            return [False] * len(list(self._get_indices(indices)))

    return SB3VecEnv


def make_sb3_vec_env(num_envs: int = 64, **kwargs: Any):
    """A stable-baselines3 ``VecEnv`` over ``num_envs`` replay episodes (``SpecDecodeEnv`` arguments in kwargs)."""
    return _sb3_class()(SpecDecodeVectorEnv(num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **kwargs))


def __getattr__(name: str) -> Any:  # ``from env.vector_env import SB3VecEnv`` builds the class lazily
    if name == "SB3VecEnv":
        return _sb3_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
