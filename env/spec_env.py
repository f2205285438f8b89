"""``SpecDecodeEnv``: speculative decoding as a Gymnasium environment (``draftgym/SpecDecode-v0``).

A thin adapter: the live backend drives ``env.engine.Engine`` (the decoder's own step), the replay backend the
pure functions of ``env.replay`` (which the vector env shares); observations come from ``env.features`` either way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields, replace
from numbers import Integral
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from env.arms import arm_depths, arm_index, drafter_names, make_arms
from env.cost import CostModelError, load_cost_model
from env.engine import Arm, Sampling
from env.features import FeatureSpec, feature_names, observation_bounds
from env.render import RENDER_FPS, RENDER_MODES, check_render_mode, decode_line, no_render_mode
from env.replay import build_tables, replay_observe, replay_step
from env.reset_checks import check_options, seed_value
from env.trace import Trace, TraceError, load_trace, model_fingerprint

BACKENDS = ("replay", "live")


def sampling_of(value: Any) -> Sampling | None:
    """The env's ``sampling`` argument: a ``Sampling``, None, or a mapping of its fields (checked here)."""
    if value is None or isinstance(value, Sampling):
        return value
    if not isinstance(value, dict):
        raise EnvError(f"sampling must be a mapping of temperature, top_k, top_p; got {type(value).__name__}")
    names = [f.name for f in fields(Sampling)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise EnvError(f"unknown sampling keys {unknown}; valid: {', '.join(names)}")
    try:
        return Sampling(**value)
    except ValueError as err:
        raise EnvError(f"sampling: {err}") from None


def count_of(name: str, value: Any, default: int) -> int:
    """An integer argument: ``default`` when None; a bool, a float or a string is refused, not rounded."""
    if value is None:
        return int(default)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise EnvError(f"{name} must be an integer, got {value!r}")
    return int(value)


COSTS = ("model", "measured")


class EnvError(ValueError):
    """A bad env argument or action; the message is meant for the user."""


class RenderModeError(EnvError, TypeError):
    """A render mode this env does not have: a ``TypeError`` too, as an unknown keyword is, so that a builder that
    asks for one and retries without it on ``TypeError`` (stable-baselines3's ``make_vec_env`` asks for
    ``rgb_array``) builds the env."""


class SpecDecodeEnv(gym.Env):
    """
    ## Description

    Speculative decoding of one prompt, one verification step at a time. Each step the agent picks an *arm*: a
    drafter and a tree shape (depth, branching ``topk``, node ``budget``), or "none" (one plain autoregressive
    step). The drafter proposes a tree, the target verifies it in one forward pass, and the accepted tokens plus
    one bonus token are committed. A good policy drafts deep where the drafter is likely right and cheaply where
    it is not. Greedy output never depends on the arms; only the speed does.

    ## Action Space

    ``Discrete(K)`` over the arm menu ``env.unwrapped.arms`` (names in ``env.unwrapped.arm_names``); arm 0 is
    always "none". Default menu: ``env.arms.DEFAULT_ARMS``.

    ## Observation Space

    ``Box(float32)`` of ``len(env.unwrapped.feature_names)`` normalized features (``env.features``): position,
    target entropy / top-1 probability / margin at the root, n-gram suffix match length, a fixed 8-dim projection
    of the target's hidden state (in [-1, 1]), the previous step's tokens, the recent acceptance rate, and the
    recent acceptance of each drafting arm; all others in [0, 1].

    ## Rewards

    The step's instantaneous speedup: ``tokens * ar_cost_s / cost_s`` (``env.metrics.step_reward``), where
    ``tokens`` are the committed tokens (accepted drafts + bonus, cut at end of sequence / ``max_new_tokens``),
    ``cost_s`` the step's seconds (cost model, or measured wall time with ``cost="measured"``; with draft features,
    the proposals the observation at its root made, whichever arm runs, ``env.step``) and ``ar_cost_s``
    the cost-model seconds of one autoregressive token at the same context. Plain decoding earns 1.0 per step.
    ``info``: ``tokens``, ``accepted``, ``cost_s``, ``ar_cost_s``, ``arm`` (name), ``drafted``; live, the step's
    measured wall time is ``env.unwrapped.last_wall_s``. ``info`` is deterministic (a seeded episode repeats it)
    except with ``cost="measured"``, where ``cost_s`` (and so the reward) is that wall time.

    ## Starting State

    ``reset(seed=..., options={"prompt_id": ...})`` prefills a prompt (sampled with ``self.np_random`` unless
    given) and commits the first token; the root is that token.

    ## Episode End

    Terminated when the end-of-sequence token is committed; truncated at ``max_new_tokens`` generated tokens (or
    a full context, live).

    ## Arguments

    - ``backend``: ``"replay"`` (default; a recorded trace, greedy only) or ``"live"`` (the real target and
      drafters, greedy or sampling).
    - ``arms``: the menu: arm names (``"ngram-d8-k4-b24"``), mappings ``{drafter, depth, topk, budget}`` or ``Arm``.
    - ``max_new_tokens``: episode length limit (replay: at most what the trace recorded; default 128).
    - ``cost``: ``"model"`` (default) or ``"measured"`` (live only); ``cost_model``: a JSON path from
      ``draftgym calibrate`` (default: the shipped one, embedded model, fp32).
    - replay: ``trace`` (path or ``Trace``; default: the shipped trace of the built-in workload); ``model``
      (optional: refuse a trace recorded for another model).
    - live: ``model`` (``None`` = embedded, a folder, or a loaded ``LoadedModel``), ``dtype`` (``"fp32"``),
      ``device``, ``workload`` (a Spec-Bench JSONL path, ``"builtin"``, a list of ``Prompt``, or a ``Trace``:
      its recorded prompt tokens), ``sampling``
      (``Sampling`` or dict; greedy default), ``drafter_options`` ({drafter: kwargs}).
    - ``features``: a ``FeatureSpec`` or dict (replay: must equal the trace's).
    """

    metadata = {"render_modes": RENDER_MODES, "render_fps": RENDER_FPS}

    def __init__(
        self,
        backend: str = "replay",
        *,
        arms: Sequence[Any] | None = None,
        max_new_tokens: int | None = None,
        cost: str = "model",
        cost_model: Any = None,
        trace: str | Trace | None = None,
        model: Any = None,
        dtype: str = "fp32",
        device: str = "cpu",
        workload: Any = None,
        sampling: Sampling | dict[str, Any] | None = None,
        drafter_options: dict[str, dict[str, Any]] | None = None,
        features: FeatureSpec | dict[str, Any] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise EnvError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if cost not in COSTS:
            raise EnvError(f"unknown cost {cost!r}; valid: {', '.join(COSTS)}")
        self.render_mode = check_render_mode(render_mode, RenderModeError)
        self._render: str | None = None
        self.backend, self.cost = backend, cost
        self.arms: tuple[Arm, ...] = make_arms(arms)
        self.arm_names = tuple(a.name for a in self.arms)
        self.cost_model = load_cost_model(cost_model)
        spec = (
            features
            if isinstance(features, FeatureSpec) or features is None
            else FeatureSpec.from_dict(features)
        )
        if backend == "replay":
            live_only = {"dtype": dtype != "fp32", "device": device != "cpu", "workload": workload is not None,
                         "drafter_options": drafter_options is not None}  # fmt: skip
            given = [k for k, v in live_only.items() if v]
            if given:  # replay serves the trace's recorded drafters, dtype and prompts
                raise EnvError(f"{'=, '.join(given)}= {'is' if len(given) == 1 else 'are'} for backend='live' "
                               "(replay runs no model: it reads its trace's drafters, dtype and prompts)")  # fmt: skip
            self._init_replay(trace, model, spec, max_new_tokens, sampling)
        else:
            if trace is not None:
                raise EnvError("trace= is for backend='replay'")
            self._init_live(
                model,
                dtype,
                device,
                workload,
                spec or FeatureSpec(),
                max_new_tokens,
                sampling,
                drafter_options,
            )
        self.feature_names = tuple(feature_names(self.feature_spec, self.arm_names, arm_depths(self.arms)))
        low, high = observation_bounds(self.feature_spec, len(self.feature_names))
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        self.action_space = spaces.Discrete(len(self.arms))
        self._done = True

    # ---- construction ----
    def _init_replay(self, trace, model, spec, max_new_tokens, sampling) -> None:
        if self.cost == "measured":
            raise EnvError("cost='measured' needs backend='live' (replay has no wall time to measure)")
        s = sampling_of(sampling)
        if s is not None and s.temperature > 0:
            raise EnvError(
                "replay is greedy (traces record the greedy trajectory); use backend='live' to sample"
            )
        self.trace = trace if isinstance(trace, Trace) else load_trace(trace)
        if model is not None:
            from env.model import LoadedModel, load_model

            loaded = (
                model if isinstance(model, LoadedModel) else load_model(model, dtype="fp32", device="cpu")
            )
            self.trace.check_model(model_fingerprint(loaded))
        # draft features come from the recorded trees: any trace has them
        if spec is not None and replace(spec, draft_features=False) != replace(
            self.trace.spec, draft_features=False
        ):
            raise EnvError(f"features {spec} differ from the trace's {self.trace.spec}")
        self.feature_spec = replace(self.trace.spec, draft_features=bool(spec and spec.draft_features))
        self.cost_model.check_model(
            self.trace.header["model"]["model_id"], self.trace.header["model"]["dtype"]
        )
        self.max_new_tokens = count_of("max_new_tokens", max_new_tokens, self.trace.max_new_tokens)
        self.tables = build_tables(
            self.trace,
            self.arms,
            self.cost_model,
            self.max_new_tokens,
            draft_features=self.feature_spec.draft_features,
        )
        if not len(self.tables.startable):
            raise TraceError("no prompt of the trace has a step to take (all end after one token)")
        self.prompt_ids = self.trace.prompt_ids
        # which drafters replay exactly (stateless: proposal = pruned recorded tree) and which approximately
        self.replay_exact = {n: bool(d["exact"]) for n, d in self.trace.drafters.items()}
        self._hist = np.zeros((1, 2 + len(self.arms)), dtype=np.float32)

    def _init_live(
        self, model, dtype, device, workload, spec, max_new_tokens, sampling, drafter_options
    ) -> None:
        from drafters import make_drafter
        from env.batch import BatchEngine
        from env.model import LoadedModel, load_model
        from env.step import StepCosts, Stepper
        from env.workloads import Prompt, check_prompts, load_workload

        opts = drafter_options or {}
        if not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values()):
            raise EnvError(f"drafter_options must map drafter names to dicts of options, got {opts!r}")
        for name, kw in opts.items():  # every drafter and option named, those the menu does not use too
            make_drafter(name, **kw)  # (before the model loads; a head's weights load on first use)
        if (
            self.cost == "model"
        ):  # (a step priced by it would fail once it was taken; "measured" prices no draft)
            for arm in self.arms:
                self.cost_model.draft_cost(arm)
        if isinstance(workload, (list, tuple)):  # (before the model loads, as a workload file is read)
            prompts = check_prompts(workload)
        elif workload is None or isinstance(workload, (str, os.PathLike)):
            prompts = load_workload(workload)
        elif not isinstance(workload, Trace):
            raise EnvError(
                "workload must be a Spec-Bench JSONL path, 'builtin', a list of Prompt or a Trace, "
                f"got {type(workload).__name__}"
            )
        self.loaded = (
            model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
        )
        self.cost_model.check_model(self.loaded.model_id, str(self.loaded.dtype).removeprefix("torch."),
                                    str(getattr(self.loaded, "weights", "dense")))  # fmt: skip
        self.sampling = sampling_of(sampling) or Sampling()
        self._token_cache: dict[int, list[int]] = {}
        if isinstance(workload, Trace):  # decode exactly the prompts (token ids) a trace recorded
            workload.check_model(model_fingerprint(self.loaded))
            cats = workload.header["prompts"]["categories"]
            self.prompts = [Prompt(pid, c, "") for pid, c in zip(workload.prompt_ids, cats)]
            self._token_cache = {i: workload.prompt(i) for i in range(workload.num_prompts)}
        else:
            self.prompts = prompts
        self.prompt_ids = [str(p.prompt_id) for p in self.prompts]
        self.max_new_tokens = count_of("max_new_tokens", max_new_tokens, 128)
        if self.max_new_tokens < 2:
            raise EnvError(f"max_new_tokens must be >= 2, got {self.max_new_tokens}")
        self._drafter_options = opts
        self.drafters = {n: make_drafter(n, **opts.get(n, {})) for n in drafter_names(self.arms)}
        self.engine = BatchEngine(self.loaded, max_rows=1, sampling=self.sampling)
        self.feature_spec = spec
        costs = StepCosts(self.cost_model, measured=self.cost == "measured")
        self.stepper = Stepper(self.engine, self.arms, features=spec, costs=costs)
        self._seq = None

    # ---- Gymnasium API ----
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._check_open()
        options = check_options(options, ("prompt_id",), EnvError)
        super().reset(seed=None if seed is None else seed_value(seed, EnvError))
        if "prompt_id" in options:
            pid = str(options["prompt_id"])
            if pid not in self.prompt_ids:
                raise EnvError(
                    f"unknown prompt_id {pid!r}; this env has {len(self.prompt_ids)} prompts, e.g. {self.prompt_ids[:5]}"
                )
            p = self.prompt_ids.index(pid)
        else:
            p = None
        self._done = True  # until the backend's reset succeeds: a failed reset leaves no episode to step
        self._return, self._generated = 0.0, 1  # (the prefill's first token)
        if self.backend == "replay":
            out = self._reset_replay(p)
            self._done = False
            return self._rendered(out, None, 0.0)
        if seed is not None:  # a seeded episode repeats: drafters that learn across requests start afresh
            from drafters import make_drafter

            stateful = [n for n, d in self.drafters.items() if not getattr(d, "exact_replay", False)]
            for n in stateful:
                self.drafters[n] = make_drafter(n, **self._drafter_options.get(n, {}))
        out = self._reset_live(p)
        self._done = False
        return self._rendered(out, None, 0.0)

    def step(self, action: Any):
        self._check_open()
        a = self._check_action(action)
        if self._done:
            raise EnvError("the episode has ended: call reset() before step()")
        out = self._step_replay(a) if self.backend == "replay" else self._step_live(a)
        return self._rendered(out, out[4], out[1])

    def render(self) -> str | None:
        """``render_mode="ansi"``: the last reset's or step's line (``env.render.decode_line``; live, with the
        last generated text); without a render mode a warning and ``None``, as Gymnasium's envs do."""
        if self.render_mode is None:
            no_render_mode(self)
            return None
        return self._render or "no episode yet: call reset()"

    def _rendered(self, out: tuple, info: dict[str, Any] | None, reward: float) -> tuple:
        """``out`` unchanged; with a render mode, its line kept for ``render()``."""
        if self.render_mode is not None:
            self._return += reward
            self._generated += 0 if info is None else int(info["tokens"])
            tail = None
            if self.backend == "live":
                self._generated = len(self._seq.tokens)
                tail = self.loaded.tokenizer.decode(self._seq.tokens[-16:])[-60:]
            self._render = decode_line(self.prompt_ids[self._p], self._generated, self.max_new_tokens, info,
                                       reward, self._return, self._done, tail)  # fmt: skip
        return out

    def _check_open(self) -> None:
        if self.backend == "live" and not hasattr(self, "stepper"):
            raise EnvError("this env is closed (its model was released): make a new one")

    def _check_action(self, action: Any) -> int:
        try:
            return arm_index(action, self.arm_names)
        except ValueError as err:
            raise EnvError(str(err)) from None

    # ---- replay ----
    def _reset_replay(self, p: int | None):
        tb = self.tables
        if p is None:
            p = int(tb.startable[self.np_random.integers(len(tb.startable))])
        elif tb.length[p] < 2:
            raise EnvError(f"prompt {self.prompt_ids[p]!r} ends after its first token: nothing to decode")
        self._p, self._pos = p, 0
        self._hist[:] = 0.0
        obs = replay_observe(tb, p, 0, self._hist[0], np.empty(len(self.feature_names), np.float32))
        return obs, {"prompt_id": self.prompt_ids[p]}

    def _step_replay(self, a: int):
        tb = self.tables
        out = replay_step(tb, self._p, self._pos, self._hist, 0, a)
        self._pos = int(out.pos)
        terminated, truncated = bool(out.terminated), bool(out.truncated)
        self._done = terminated or truncated
        obs = replay_observe(
            tb, self._p, self._pos, self._hist[0], np.empty(len(self.feature_names), np.float32)
        )
        info = {
            "tokens": int(out.tokens),
            "accepted": int(out.accepted),
            "drafted": int(out.drafted),
            "cost_s": float(out.cost_s),
            "ar_cost_s": float(out.ar_cost_s),
            "arm": self.arm_names[a],
        }
        return obs, float(out.reward), terminated, truncated, info

    # ---- live ----
    def _prompt_tokens(self, p: int) -> list[int]:
        if p not in self._token_cache:
            from env.decoder import chat_prompt

            self._token_cache[p] = chat_prompt(self.loaded.tokenizer, self.prompts[p].text)
        return self._token_cache[p]

    def _reset_live(self, p: int | None):
        st = self.stepper
        for _ in range(16):
            q = int(self.np_random.integers(len(self.prompts))) if p is None else p
            self.engine.configure(self.sampling, int(self.np_random.integers(2**62)))
            if self._seq is not None:
                st.retire(self._seq)
                self._seq = None
            self._seq = st.start(self._prompt_tokens(q), self.max_new_tokens, self.drafters)
            if not self._seq.terminated or p is not None:
                break
        if self._seq.terminated:
            raise EnvError(f"prompt {self.prompt_ids[q]!r} ends after its first token: nothing to decode")
        self._p = q
        return self.stepper.observe(self._seq), {"prompt_id": self.prompt_ids[q]}

    def _step_live(self, a: int):
        (out,) = self.stepper.step([a])
        self._done = out.terminated or out.truncated
        self.last_wall_s = (
            out.wall_s
        )  # measured (with draft features' proposals); info's cost_s if cost="measured"
        obs = self.stepper.observe(self._seq)
        return obs, float(out.reward), out.terminated, out.truncated, dict(out.info)

    def close(self) -> None:
        for name in ("stepper", "engine", "loaded", "_seq"):
            if hasattr(self, name):
                delattr(self, name)


__all__ = ["CostModelError", "EnvError", "SpecDecodeEnv"]
