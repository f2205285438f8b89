"""``draftgym/SpecServe-v0``: speculative decoding under load as a Gymnasium environment — a server's stream of
requests, continuously batched, where each step the agent picks the arm of the whole batch (``Discrete``) or of
every row (``MultiDiscrete``), replayed from a recorded trace and priced by a batch cost model
(``env.batch_cost``: fitted on this machine, or a roofline model of a named accelerator, simulated).

``SpecServeEnv`` (one server) and ``SpecServeVectorEnv`` (many, usable by stable-baselines3 through
``make_sb3_serve_env``) are thin adapters over the simulator ``env.serve_sim.ServeSim``, whose names (loads,
observation, ``LiveObserver``) are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from env.render import RENDER_FPS, RENDER_MODES, VECTOR_RENDER, check_render_mode, no_render_mode, serve_line
from env.reset_checks import check_options, reset_mask, seed_value
from env.serve_sim import *  # noqa: F403  (the simulator's names, re-exported)
from env.serve_sim import ACTIONS, ServeEnvError, ServeSim, feature_names, obs_bounds
from env.serve_sim import __all__ as _sim_names

_DOC_ARGS = """trace, arms, cost, max_batch, loads, requests, max_new_tokens, prompt_ids, reward, seed: as ``ServeSim``;
    ``action``: ``"batch"`` (``Discrete(K)``, one arm for every row) or ``"row"`` (``MultiDiscrete([K] * M)``,
    one arm per row slot; ``info["row_mask"]`` marks the slots that hold a request, the others are ignored)."""


class ServeRenderModeError(ServeEnvError, TypeError):
    """A render mode this env does not have: a ``TypeError`` too (``env.spec_env.RenderModeError``)."""


class SpecServeEnv(gym.Env):
    (
        """
    ## Description

    A server decoding a stream of requests with continuous batching and speculative decoding. Requests arrive
    under a load (closed loop at a concurrency, a ramp 1 -> 16 -> 1, open-loop Poisson or bursty arrivals), enter
    the batch when a slot is free (paying their prefill), and leave at end of sequence or ``max_new_tokens``. Each
    step every row in the batch drafts with its arm and the target verifies all trees in one forward; the step
    costs what the batch cost model says for (rows, nodes per row, mean context) plus the drafters' time. Which
    arm pays depends on the load: a deep draft that pays at one row can lose at sixteen.

    ## Action Space

    ``Discrete(K)`` over the arm menu (``arm_names``; arm 0 is "none" by default) with ``action="batch"``, or
    ``MultiDiscrete([K] * max_batch)`` with ``action="row"``.

    ## Observation Space

    ``Box(float32)`` of ``feature_names`` (``env.serve_env.feature_names``): load features (rows / max_batch,
    queue / max_batch, tokens in flight / (``CTX_NORM`` x max_batch), the longest context / ``CTX_NORM``, the rows
    whose drafter has a match / max_batch), pooled
    per-request features (acceptance estimate, last accepted length, the drafter's match depth, progress) and the
    same per row slot (zeros for an empty slot). All in [0, 1] except queue and context-like features in [0, 4].

    ## Rewards

    ``reward="goodput_ratio"`` (default): the step's goodput relative to autoregressive decoding at the same
    batch, ``tokens * ar_s / (rows * cost_s)``, where ``tokens`` are committed by all rows, ``cost_s`` the step's
    seconds and ``ar_s`` those of one autoregressive step of the same rows (1.0 for plain decoding).
    ``reward="time_saved"``: ``tokens / rows - cost_s / ar_s``, the autoregressive steps the step saved (0 for
    plain decoding), whose sum over an episode tracks the time the episode saved. Prefill time is not part of any
    step's reward.

    ## Starting State

    An empty server at time 0 whose first requests have entered (closed loop: up to the concurrency; open
    loop: those arriving at 0). The load and the prompts are drawn from ``loads`` and the trace per episode.

    ## Episode End

    Terminated when every request of the episode has finished. Never truncated.

    ## Arguments

    """
        + _DOC_ARGS
        + """

    ## Info

    ``tokens``, ``accepted`` (draft tokens accepted, all rows), ``arm`` (its name; with ``action="row"`` the names
    of the rows served, in slot order), ``rows``, ``nodes``, ``cost_s``, ``ar_cost_s``, ``queue``, ``clock_s``,
    ``load`` (the episode's load), ``row_mask`` (the slots holding a request after the step) and, at the end, ``goodput`` (committed tokens per simulated
    second of the episode, prefills included).
    """
    )

    metadata = {"render_modes": RENDER_MODES, "render_fps": RENDER_FPS}

    def __init__(self, *, action: str = "batch", render_mode: str | None = None, **kwargs: Any) -> None:
        if action not in ACTIONS:
            raise ServeEnvError(f"unknown action mode {action!r}; valid: {', '.join(ACTIONS)}")
        self.render_mode = check_render_mode(render_mode, ServeRenderModeError)
        self._render: str | None = None
        self.sim = ServeSim(1, **kwargs)
        self.action_mode = action
        self.arms, self.arm_names = self.sim.arms, self.sim.arm_names
        self.feature_names = feature_names(self.sim.max_batch)
        low, high = obs_bounds(self.sim.max_batch)
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        k = len(self.arms)
        self.action_space = (
            spaces.Discrete(k) if action == "batch" else spaces.MultiDiscrete([k] * self.sim.max_batch)
        )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = check_options(options, ("load",), ServeEnvError)
        seed = None if seed is None else seed_value(seed, ServeEnvError)
        super().reset(seed=seed)
        if seed is not None:
            self.sim.seed(seed)
        self.sim.reset(load=options.get("load"))
        info = self._info(None)
        self._steps, self._return = 0, 0.0
        if self.render_mode is not None:
            self._render = serve_line(0, info, None, 0.0)
        return self.sim.observe()[0].copy(), info

    def render(self) -> str | None:
        """``render_mode="ansi"``: the last reset's or step's line (``env.render.serve_line``); without a render
        mode a warning and ``None``, as Gymnasium's envs do."""
        if self.render_mode is None:
            no_render_mode(self)
            return None
        return self._render or "no episode yet: call reset()"

    def _info(
        self, o: dict[str, np.ndarray] | None, a: np.ndarray | None = None, rows: np.ndarray | None = None
    ):
        sim = self.sim
        info: dict[str, Any] = {"queue": int(sim.queue()[0]), "clock_s": float(sim.clock[0]),
                                "row_mask": sim.active[0].copy(), "load": sim.load_name[0]}  # fmt: skip
        if o is not None:
            info.update(tokens=int(o["tokens"][0]), accepted=int(o["acc"][0].sum()), rows=int(o["rows"][0]),
                        nodes=int(o["nodes"][0]), cost_s=float(o["cost"][0]), ar_cost_s=float(o["ar"][0]))  # fmt: skip
        if (
            a is not None and rows is not None
        ):  # the arm's name; per row: the served rows' arms, in slot order
            names = self.arm_names
            info["arm"] = (
                names[int(a[0])] if self.action_mode == "batch" else [names[int(i)] for i in a[0][rows]]
            )
        if sim.done()[0]:
            info["goodput"] = float(sim.goodput()[0])
        return info

    def step(self, action: Any):
        if self.sim.done()[0]:
            raise ServeEnvError("the episode has ended: call reset()")
        a = np.asarray(action)
        if self.action_mode == "batch":
            if a.ndim != 0 and a.shape != (1,):
                raise ServeEnvError(f"a batch action is one arm index, got shape {a.shape}")
            a = a.reshape(1)
        else:
            if a.shape != (self.sim.max_batch,):
                raise ServeEnvError(f"a row action has shape ({self.sim.max_batch},), got {a.shape}")
            a = a.reshape(1, -1)
        served = self.sim.active[0].copy()
        reward, o = self.sim.step(a)
        terminated = bool(self.sim.done()[0])
        info = self._info(o, a, served)
        if self.render_mode is not None:
            self._steps, self._return = self._steps + 1, self._return + float(reward[0])
            self._render = serve_line(self._steps, info, float(reward[0]), self._return)
        return self.sim.observe()[0].copy(), float(reward[0]), terminated, False, info


class SpecServeVectorEnv(VectorEnv):
    """``num_envs`` servers of ``SpecServeEnv`` in one numpy simulator (``ServeSim``). ``autoreset_mode``:
    ``"next_step"`` (Gymnasium's default) or ``"same_step"`` (``info["final_obs"]``, ``info["_final_obs"]``).
    ``info``: ``tokens``, ``accepted``, ``rows``, ``cost_s``, ``ar_cost_s``, ``arm`` (the actions, arm indices)
    (arrays) and ``goodput`` (NaN but on the step an episode terminates: one truncated did not finish). ``max_episode_steps``: an episode is truncated
    after that many steps (as Gymnasium's ``TimeLimit`` does to each env of a ``sync`` vector env;
    ``gymnasium.make_vec(..., max_episode_steps=N)`` passes it here)."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(self, num_envs: int = 256, *, action: str = "batch",
                 autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP, max_episode_steps: int | None = None,
                 render_mode: str | None = None, **kwargs: Any) -> None:  # fmt: skip
        if action not in ACTIONS:
            raise ServeEnvError(f"unknown action mode {action!r}; valid: {', '.join(ACTIONS)}")
        if render_mode is not None:
            raise ServeRenderModeError(VECTOR_RENDER.format(mode=render_mode, id="SpecServe"))
        limit = max_episode_steps
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, Integral) or limit < 1):
            raise ServeEnvError(f"max_episode_steps must be an integer >= 1, got {limit!r}")
        self.max_episode_steps = None if limit is None else int(limit)
        self.sim = ServeSim(num_envs, **kwargs)
        self.num_envs, self.action_mode = num_envs, action
        mode = _autoreset(autoreset_mode)
        self.metadata = {**self.metadata, "autoreset_mode": mode}
        self.arms, self.arm_names = self.sim.arms, self.sim.arm_names
        self.feature_names = feature_names(self.sim.max_batch)
        low, high = obs_bounds(self.sim.max_batch)
        k = len(self.arms)
        self.single_observation_space = spaces.Box(low, high, dtype=np.float32)
        self.single_action_space = (
            spaces.Discrete(k) if action == "batch" else spaces.MultiDiscrete([k] * self.sim.max_batch)
        )
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self._pending = np.zeros(num_envs, bool)
        self._steps = np.zeros(num_envs, np.int64)  # each episode's steps so far (max_episode_steps)
        self._started = False  # no episode to step before the first reset()

    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        opts = check_options(options, ("load", "reset_mask"), ServeEnvError)
        given_mask = opts.get("reset_mask")
        mask = reset_mask(given_mask, self.num_envs, self._started, ServeEnvError)
        only = None if given_mask is None else np.flatnonzero(mask)
        if isinstance(seed, np.ndarray) and seed.ndim == 0:  # np.array(3): one seed (len() of it failed)
            seed = seed.item()
        if seed is not None and np.isscalar(seed):
            self.sim.seed(seed_value(seed, ServeEnvError), only)  # server i: [seed, i]
        elif seed is not None:  # one seed per server (None: it keeps its stream), as Gymnasium's vector envs
            if isinstance(seed, (str, bytes)) or not isinstance(seed, (Sequence, np.ndarray)):
                raise ServeEnvError(f"seed must be an integer, one per server or None, got {seed!r}")
            if len(seed) != self.num_envs:
                raise ServeEnvError(f"reset: {len(seed)} seeds for {self.num_envs} servers")
            seeds = [None if s is None else seed_value(s, ServeEnvError) for s in seed]
            given = [i for i in (range(self.num_envs) if only is None else only) if seeds[i] is not None]
            self.sim.seed_each([0 if s is None else s for s in seeds], given)
        self.sim.reset(None if given_mask is None else mask, load=opts.get("load"))
        self._pending[:] = False if given_mask is None else self._pending & ~mask
        self._steps[:] = 0 if given_mask is None else self._steps * ~mask
        self._started = True
        return self.sim.observe().copy(), {}

    def step(self, actions: Any):
        if not self._started:
            raise ServeEnvError("no episode has started: call reset() before step()")
        a = np.asarray(actions)
        pending = self._pending
        reward, o = self.sim.step(a)
        done = self.sim.done()
        info: dict[str, Any] = {"tokens": o["tokens"], "accepted": o["acc"].sum(1), "rows": o["rows"],
                                "cost_s": o["cost"], "ar_cost_s": o["ar"], "arm": a,
                                "goodput": np.where(done & ~pending, self.sim.goodput(), np.nan)}  # fmt: skip
        terminated = done.copy()
        truncated = np.zeros(self.num_envs, bool)
        if self.max_episode_steps is not None:
            self._steps += 1
            truncated = self._steps >= self.max_episode_steps
        ended = terminated | truncated
        mode = self.metadata["autoreset_mode"]
        if mode == AutoresetMode.NEXT_STEP:
            if (
                pending.any()
            ):  # ended last step: reset now, this step's outcome dropped (a truncated server's too)
                self.sim.reset(pending)
                self._steps[pending] = 0
                reward = reward * ~pending
                for key in ("tokens", "accepted", "rows", "cost_s", "ar_cost_s"):
                    info[key] = info[key] * ~pending
                terminated &= ~pending
                truncated &= ~pending
            self._pending = terminated | truncated
            obs = self.sim.observe().copy()
        else:
            obs = self.sim.observe().copy()
            if mode == AutoresetMode.SAME_STEP and ended.any():
                info["final_obs"], info["_final_obs"] = obs, ended
                self.sim.reset(ended)
                self._steps[ended] = 0
                obs = self.sim.observe(np.flatnonzero(ended)).copy()  # the new episodes' rows only
        return obs, reward, terminated, truncated, info


def _autoreset(mode: str | AutoresetMode) -> AutoresetMode:
    if isinstance(mode, AutoresetMode):
        return mode
    table = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP,
             "disabled": AutoresetMode.DISABLED}  # fmt: skip
    key = str(mode).lower().replace("-", "_")
    if key in table:
        return table[key]
    for m in AutoresetMode:
        if m.value == mode:
            return m
    raise ServeEnvError(f"unknown autoreset_mode {mode!r}; valid: {', '.join(table)}")


def make_sb3_serve_env(num_envs: int = 64, **kwargs: Any):
    """A stable-baselines3 ``VecEnv`` over ``num_envs`` replayed servers (``SpecServeEnv`` arguments)."""
    from stable_baselines3.common.vec_env import VecEnv

    venv = SpecServeVectorEnv(num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **kwargs)

    class SB3ServeVecEnv(VecEnv):
        def __init__(self) -> None:
            self.venv = venv
            super().__init__(num_envs, venv.single_observation_space, venv.single_action_space)

        def reset(self) -> np.ndarray:
            obs, _ = venv.reset(seed=self._seeds[0])
            self._reset_seeds()
            self._reset_options()
            return obs

        def step_async(self, actions: np.ndarray) -> None:
            self._actions = np.asarray(actions)

        def step_wait(self):
            obs, reward, term, trunc, info = venv.step(self._actions)
            dones = term | trunc  # (truncated: max_episode_steps)
            infos = [{} for _ in range(num_envs)]
            for i in np.flatnonzero(dones):
                infos[i]["terminal_observation"] = info["final_obs"][i]
                infos[i]["TimeLimit.truncated"] = bool(trunc[i] and not term[i])
                if term[i]:
                    infos[i]["goodput"] = float(info["goodput"][i])
            return obs, reward, dones, infos

        def close(self) -> None:
            venv.close()

        def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
            return [getattr(venv, attr_name)] * len(list(self._get_indices(indices)))

        def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
            setattr(venv, attr_name, value)

        def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
            return [getattr(venv, method_name)(*args, **kwargs)] * len(list(self._get_indices(indices)))

        def env_is_wrapped(self, wrapper_class: Any, indices: Any = None) -> list[bool]:
            return [False] * len(list(self._get_indices(indices)))

    return SB3ServeVecEnv()


__all__ = [*_sim_names, "ServeRenderModeError", "SpecServeEnv", "SpecServeVectorEnv", "make_sb3_serve_env"]
