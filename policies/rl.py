"""Reinforcement learning with stable-baselines3: PPO, DQN and A2C trained on the vectorized replay env, saved as
draftgym policies that act with ``predict(obs, deterministic=True)``.

This is the context-aware drafter choice of Huang et al. (arXiv 2408.08470), made per step rather than per query,
in the spirit of "Learning to Draft" (arXiv 2603.01639): the policy sees the observation of ``env.features`` and
picks an arm of the menu every step.

Reward used for training (``reward``):

- ``"time_saved"`` (default): ``tokens - cost_s / ar_cost_s``, the autoregressive steps the step saved. Its sum
  over an episode is the time saved on the prompt, so maximizing the return is maximizing the prompt's speedup;
- ``"speedup"``: the env's own reward, the step's instantaneous speedup. Its sum over an episode favours many
  short steps (plain decoding earns 1 per token), which is not the speedup of the episode.

Training (``train_sb3``) writes into its run directory: ``tb/`` (TensorBoard), ``checkpoints/`` (every
``checkpoint_freq`` steps, written atomically; a killed run resumes from the latest one, DQN with its replay
buffer), ``eval.jsonl`` (the replay speedup of the deterministic policy on validation prompts every ``eval_freq``
steps, with the wall and CPU seconds spent so far) and ``best.zip`` (the best policy by that speedup).
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from policies.base import BasePolicy, PolicyError

ALGOS = ("ppo", "dqn", "a2c")
REWARDS = ("time_saved", "speedup")
# Hyper-parameters each algorithm takes (None: stable-baselines3's default).
_HYPER = {
    "ppo": (
        "learning_rate",
        "gamma",
        "n_steps",
        "batch_size",
        "n_epochs",
        "gae_lambda",
        "ent_coef",
        "clip_range",
    ),
    "a2c": ("learning_rate", "gamma", "n_steps", "gae_lambda", "ent_coef"),
    "dqn": (
        "learning_rate",
        "gamma",
        "batch_size",
        "buffer_size",
        "learning_starts",
        "train_freq",
        "gradient_steps",
        "target_update_interval",
        "exploration_fraction",
        "exploration_final_eps",
    ),
}


# Our defaults where stable-baselines3's do not suit this env (short episodes, rewards in AR steps, a few thousand
# states per trace): shorter rollouts and horizons, a larger learning rate. Tuned on the synthetic test trace.
DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {"n_steps": 128, "batch_size": 256, "n_epochs": 4, "gamma": 0.9, "learning_rate": 1e-3},
    "a2c": {"n_steps": 8, "gamma": 0.9, "learning_rate": 1e-3},
    "dqn": {
        "buffer_size": 50_000,
        "learning_starts": 1_000,
        "gamma": 0.9,
        "learning_rate": 5e-4,
        "exploration_fraction": 0.2,
        "target_update_interval": 1_000,
    },
}


def algo_class(algo: str) -> Any:
    import stable_baselines3 as sb3

    if algo not in ALGOS:
        raise PolicyError(f"unknown RL algorithm {algo!r}; valid: {', '.join(ALGOS)}")
    return {"ppo": sb3.PPO, "dqn": sb3.DQN, "a2c": sb3.A2C}[algo]


class SB3Policy(BasePolicy):
    """A stable-baselines3 model behind the policy protocol. Untrained until ``train_sb3`` or ``load_policy``."""

    type_name = "sb3"
    kind = "rl"

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        algo: str = "ppo",
        net_arch: str = "64,64",
        reward: str = "time_saved",
        seed: int = 0,
        learning_rate: float | None = None,
        gamma: float | None = None,
        n_steps: int | None = None,
        batch_size: int | None = None,
        n_epochs: int | None = None,
        gae_lambda: float | None = None,
        ent_coef: float | None = None,
        clip_range: float | None = None,
        buffer_size: int | None = None,
        learning_starts: int | None = None,
        train_freq: int | None = None,
        gradient_steps: int | None = None,
        target_update_interval: int | None = None,
        exploration_fraction: float | None = None,
        exploration_final_eps: float | None = None,
    ) -> None:
        super().__init__(arms, obs_size, features)
        algo_class(algo)  # validates the name
        if reward not in REWARDS:
            raise PolicyError(f"unknown RL reward {reward!r}; valid: {', '.join(REWARDS)}")
        if self.obs_size < 1:
            raise PolicyError("an RL policy needs an observation (obs_size >= 1)")
        try:
            self.net_arch = [int(x) for x in str(net_arch).split(",") if x.strip()]
        except ValueError as err:
            raise PolicyError(
                f"net_arch must be comma-separated layer sizes like '64,64', got {net_arch!r}"
            ) from err
        self.algo, self.reward, self.seed = algo, reward, int(seed)
        given = {
            "learning_rate": learning_rate,
            "gamma": gamma,
            "n_steps": n_steps,
            "batch_size": batch_size,
            "n_epochs": n_epochs,
            "gae_lambda": gae_lambda,
            "ent_coef": ent_coef,
            "clip_range": clip_range,
            "buffer_size": buffer_size,
            "learning_starts": learning_starts,
            "train_freq": train_freq,
            "gradient_steps": gradient_steps,
            "target_update_interval": target_update_interval,
            "exploration_fraction": exploration_fraction,
            "exploration_final_eps": exploration_final_eps,
        }
        wrong = [k for k, v in given.items() if v is not None and k not in _HYPER[algo]]
        if wrong:
            raise PolicyError(f"{algo} does not take {wrong}; it takes {list(_HYPER[algo])}")
        self.hyper = {k: v for k, v in given.items() if v is not None}
        self.model: Any = None
        self._layers: list[tuple[str, Any, Any]] | None = None  # numpy copy of the actor (``numpy_actor``)

    @property
    def name(self) -> str:
        return self.algo

    def params(self) -> dict[str, Any]:
        return {
            "algo": self.algo,
            "net_arch": ",".join(str(n) for n in self.net_arch),
            "reward": self.reward,
            "seed": self.seed,
            **self.hyper,
        }

    def build(self, venv: Any, tensorboard_log: str | None = None) -> Any:
        """A fresh model on ``venv`` with this policy's hyper-parameters."""
        cls = algo_class(self.algo)
        defaults = DEFAULTS[self.algo]
        self.model = cls(
            "MlpPolicy",
            venv,
            policy_kwargs={"net_arch": list(self.net_arch)},
            tensorboard_log=tensorboard_log,
            seed=self.seed,
            device="cpu",
            verbose=0,
            **{**defaults, **self.hyper},
        )
        if tensorboard_log is None:  # else stable-baselines3 makes an empty SB3-<date> folder in the temp dir
            from stable_baselines3.common.logger import Logger

            self.model.set_logger(Logger(folder=None, output_formats=[]))
        return self.model

    # ---- acting ----
    def predict(self, obs: np.ndarray, deterministic: bool = True) -> tuple[np.ndarray, Any]:
        """stable-baselines3's ``predict`` (one observation or a batch)."""
        if self.model is None:
            raise PolicyError("the RL policy is not trained (draftgym train CONFIG)")
        return self.model.predict(obs, deterministic=deterministic)

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        if self._layers is not None:
            return np.argmax(_forward(self._layers, np.asarray(obs, dtype=np.float32)), axis=-1)
        return np.asarray(self.predict(np.asarray(obs, dtype=np.float32), deterministic=True)[0]).reshape(-1)

    def act(self, obs: np.ndarray | None) -> int:
        """``predict(obs, deterministic=True)``, through a numpy copy of the network when it is a plain MLP (tens
        of microseconds instead of milliseconds: this runs every decoding step)."""
        x = self._check_obs(obs).astype(np.float32)
        if self._layers is not None:
            return int(np.argmax(_forward(self._layers, x)))
        return int(np.asarray(self.predict(x, deterministic=True)[0]).reshape(-1)[0])

    # ---- saving ----
    def state(self) -> dict[str, bytes]:
        if self.model is None:
            raise PolicyError("cannot save an untrained RL policy")
        buf = io.BytesIO()
        self.model.save(buf, exclude=["tensorboard_log"])  # a path of the training machine
        return {"model.zip": buf.getvalue()}

    def restore(self, files: dict[str, bytes]) -> None:
        if "model.zip" not in files:
            raise PolicyError("RL policy file has no model.zip")
        model = algo_class(self.algo).load(io.BytesIO(files["model.zip"]), device="cpu")
        self.attach(model)

    def attach(self, model: Any) -> None:
        """Use ``model`` (checked against this policy's observation size and arm count)."""
        obs_shape = tuple(model.observation_space.shape)
        n = int(model.action_space.n)
        if obs_shape != (self.obs_size,) or n != self.num_arms:
            raise PolicyError(
                f"the {self.algo} model takes observations {obs_shape} and {n} actions, "
                f"but the policy header says ({self.obs_size},) and {self.num_arms} arms"
            )
        self.model = model
        self._layers = numpy_actor(model)


def numpy_actor(model: Any) -> list[tuple[str, Any, Any]] | None:
    """The deterministic action head of an MLP policy as numpy layers ``[("linear", W, b) | ("tanh"|"relu", ..)]``
    whose argmax is ``predict(obs, deterministic=True)``; None when the network is not a plain MLP."""
    import torch

    policy = model.policy
    if hasattr(policy, "q_net"):  # DQN: argmax of the Q-network
        mods = list(policy.q_net.q_net)
    elif hasattr(policy, "mlp_extractor") and hasattr(policy, "action_net"):  # PPO, A2C: logits of the actor
        mods = [*policy.mlp_extractor.policy_net, policy.action_net]
    else:
        return None
    extractor = getattr(policy, "pi_features_extractor", None) or getattr(
        policy.q_net, "features_extractor", None
    )
    if type(extractor).__name__ != "FlattenExtractor":
        return None
    layers: list[tuple[str, Any, Any]] = []
    for m in mods:
        if isinstance(m, torch.nn.Linear):
            layers.append(("linear", m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()))
        elif isinstance(m, (torch.nn.Tanh, torch.nn.ReLU)):
            layers.append((type(m).__name__.lower(), None, None))
        else:
            return None
    return layers


def _forward(layers: list[tuple[str, Any, Any]], x: np.ndarray) -> np.ndarray:
    for kind, w, b in layers:
        if kind == "linear":
            x = x @ w + b
        elif kind == "tanh":
            x = np.tanh(x)
        else:
            x = np.maximum(x, 0.0)
    return x


# ---- training ------------------------------------------------------------------------------------------------------


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


def _checkpoints(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for p in folder.glob("model_*_steps.zip"):
        m = re.fullmatch(r"model_(\d+)_steps\.zip", p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _callbacks(policy: SB3Policy, out: Path, eval_fn, eval_freq: int, checkpoint_freq: int, n_envs: int):
    """Checkpoints (atomic; replay buffer first, so a model checkpoint implies its buffer) and the replay eval."""
    from stable_baselines3.common.callbacks import BaseCallback

    log = out / "eval.jsonl"
    prev = (
        [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    )
    base_wall = prev[-1]["wall_s"] if prev else 0.0
    base_cpu = prev[-1]["cpu_s"] if prev else 0.0
    best = max((r["replay_speedup"] for r in prev), default=-np.inf)

    class Train(BaseCallback):
        def _on_training_start(self) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.next_eval = (self.num_timesteps // eval_freq + 1) * eval_freq
            self.next_ckpt = (self.num_timesteps // checkpoint_freq + 1) * checkpoint_freq
            self.best = best
            if not prev:
                self._evaluate()

        def _evaluate(self) -> None:
            speedup = float(eval_fn(policy))
            row = {
                "timesteps": int(self.num_timesteps),
                "wall_s": round(base_wall + time.perf_counter() - self.t0, 2),
                "cpu_s": round(base_cpu + time.process_time() - self.c0, 2),
                "replay_speedup": speedup,
            }
            with log.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            self.logger.record("eval/replay_speedup", speedup)
            if speedup > self.best:
                self.best = speedup
                _atomic_save(self.model, out / "best.zip")

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.next_eval += eval_freq
                self._evaluate()
            if self.num_timesteps >= self.next_ckpt:
                self.next_ckpt += checkpoint_freq
                ckpt = out / "checkpoints"
                ckpt.mkdir(parents=True, exist_ok=True)
                if getattr(self.model, "replay_buffer", None) is not None:
                    buf = ckpt / f"buffer_{self.num_timesteps}_steps.pkl"
                    tmp = ckpt / f"buffer_{self.num_timesteps}_steps.tmp.pkl"
                    self.model.save_replay_buffer(tmp)
                    tmp.replace(buf)
                _atomic_save(self.model, ckpt / f"model_{self.num_timesteps}_steps.zip")
                for steps, old in _checkpoints(ckpt)[:-2]:  # keep the last two
                    old.unlink(missing_ok=True)
                    (ckpt / f"buffer_{steps}_steps.pkl").unlink(missing_ok=True)
            return True

    return Train()


def _atomic_save(model: Any, path: Path) -> None:
    tmp = path.with_name(path.stem + ".tmp.zip")
    model.save(tmp)
    tmp.replace(path)


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
) -> SB3Policy:
    """Train ``policy`` on the stable-baselines3 VecEnv ``venv`` (``env.vector_env.make_sb3_vec_env``) for
    ``total_timesteps`` env steps in all, resuming from ``out/checkpoints`` when a killed run left one there.
    ``eval_fn(policy) -> replay speedup`` scores the deterministic policy on validation prompts. Returns the policy
    holding the best model by that score."""
    import torch

    torch.set_num_threads(1)  # small MLPs: one thread is fastest, and the machine is shared
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if policy.reward == "time_saved":
        venv = time_saved_wrapper(venv)
    cls = algo_class(policy.algo)
    ckpts = _checkpoints(out / "checkpoints")
    model = None
    for steps, path in reversed(ckpts):  # the latest readable checkpoint
        try:
            model = cls.load(path, env=venv, device="cpu", tensorboard_log=str(out / "tb"))
        except Exception:  # a checkpoint torn by a kill: try the one before
            continue
        buf = path.with_name(f"buffer_{steps}_steps.pkl")
        if hasattr(model, "load_replay_buffer") and buf.is_file():
            model.load_replay_buffer(buf)
        break
    if model is None:
        model = policy.build(venv, tensorboard_log=str(out / "tb"))
    policy.model, policy._layers = model, None  # the numpy copy would go stale while training
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
        policy.attach(cls.load(best, device="cpu"))
    return policy


def plateau(out: str | Path, tol: float = 0.01) -> dict[str, float] | None:
    """When training reached its plateau: the first evaluation within ``tol`` (relative) of the best replay
    speedup in ``out/eval.jsonl``, with its step count and the wall and CPU seconds spent until then."""
    log = Path(out) / "eval.jsonl"
    if not log.is_file():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    best = max(r["replay_speedup"] for r in rows)
    first = next(r for r in rows if r["replay_speedup"] >= best * (1 - tol))
    return {"best": best, **{k: first[k] for k in ("timesteps", "wall_s", "cpu_s", "replay_speedup")}}
