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

Training: ``policies.rl_train`` (``train_sb3``, checkpoints, the evaluation callback, the plateau).

Saved policies and checkpoints hold tensors and JSON, never pickles (``policies.sb3_files``,
``policies.sb3_checkpoints``): stable-baselines3's own ``load`` and replay-buffer files are not used, so no file read
here runs code at load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.archive import json_bytes
from policies.base import BasePolicy, PolicyError, real
from policies.sb3_files import (
    DEFAULT_ACTIVATION,
    SpacesEnv,
    activation_module,
    check_state,
    read_sb3_zip,
    read_tensors,
    state_shapes,
    tensor_bytes,
)

MAX_LAYER = 1 << 12  # units of a hidden layer ("100000000,100000000" asked for 4e16 bytes)

ALGOS = ("ppo", "dqn", "a2c")
REWARDS = ("time_saved", "speedup")
# Hyper-parameters each algorithm takes (None: stable-baselines3's default).
# the range of each hyper-parameter (low, high, low open, integer): a value outside fails in one line at build
# time, not as a stable-baselines3 assertion or a diverging run mid-training
HYPER_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "learning_rate": (0.0, 10.0, True, False),
    "gamma": (0.0, 1.0, False, False),
    "n_steps": (1, 1 << 20, False, True),
    "batch_size": (
        2,
        1 << 24,
        False,
        True,
    ),  # PPO normalizes advantages over a mini-batch: one sample is refused
    "n_epochs": (1, 10_000, False, True),
    "gae_lambda": (0.0, 1.0, False, False),
    "ent_coef": (0.0, 100.0, False, False),
    "clip_range": (0.0, 10.0, True, False),
    "buffer_size": (1, 1 << 26, False, True),
    "learning_starts": (0, 1 << 40, False, True),
    "train_freq": (1, 1 << 20, False, True),
    "gradient_steps": (-1, 1 << 20, False, True),  # -1: as many as env steps (stable-baselines3's convention)
    "target_update_interval": (1, 1 << 30, False, True),
    "exploration_fraction": (0.0, 1.0, False, False),
    "exploration_final_eps": (0.0, 1.0, False, False),
}

HYPER = {
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


INT_HYPER = frozenset(
    ("n_steps", "batch_size", "n_epochs", "buffer_size", "learning_starts", "train_freq", "gradient_steps",
     "target_update_interval")
)  # fmt: skip
# A model rebuilt only to act needs no rollout or replay buffer: the smallest ones stable-baselines3 accepts.
_ACTING = {"ppo": {"n_steps": 2, "batch_size": 2}, "a2c": {"n_steps": 2}, "dqn": {"buffer_size": 1}}


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
        vf_net_arch: str | None = None,
        activation: str | None = None,
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
        self.net_arch = _layer_sizes("net_arch", net_arch)
        self.vf_net_arch = None if vf_net_arch is None else _layer_sizes("vf_net_arch", vf_net_arch)
        if self.vf_net_arch is not None and algo == "dqn":
            raise PolicyError("vf_net_arch is the value network of PPO and A2C; DQN has none")
        self.activation = DEFAULT_ACTIVATION[algo] if activation is None else activation
        activation_module(self.activation)  # validates the name
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
        wrong = [k for k, v in given.items() if v is not None and k not in HYPER[algo]]
        if wrong:
            raise PolicyError(f"{algo} does not take {wrong}; it takes {list(HYPER[algo])}")
        real("seed", seed, lo=0, hi=2**32 - 1, integer=True)  # (numpy's seed range, which the build uses)
        for k, v in given.items():
            if v is not None:
                lo, hi, lo_open, integer = HYPER_RANGES[k]
                real(f"{algo} {k}", v, lo=lo, hi=hi, lo_open=lo_open, integer=integer)
        self.hyper = {k: v for k, v in given.items() if v is not None}
        self.model: Any = None
        self._layers: list[tuple[str, Any, Any]] | None = None  # numpy copy of the actor (``numpy_actor``)

    @property
    def name(self) -> str:
        return self.algo

    def params(self) -> dict[str, Any]:
        out = {"algo": self.algo, "net_arch": ",".join(str(n) for n in self.net_arch)}
        if self.vf_net_arch is not None:
            out["vf_net_arch"] = ",".join(str(n) for n in self.vf_net_arch)
        return {**out, "activation": self.activation, "reward": self.reward, "seed": self.seed, **self.hyper}

    def network(self) -> dict[str, Any]:
        """What rebuilds the model (``network.json`` of the saved file, ``state.json`` of a checkpoint)."""
        return {
            "algo": self.algo,
            "observation_shape": [self.obs_size],
            "action_n": self.num_arms,
            "net_arch": list(self.net_arch),
            "vf_net_arch": None if self.vf_net_arch is None else list(self.vf_net_arch),
            "activation": self.activation,
            "hyper": dict(self.hyper),
        }

    def build(self, venv: Any, tensorboard_log: str | None = None) -> Any:
        """A fresh model on ``venv`` with this policy's network and hyper-parameters."""
        self.model = self._new_model(venv, tensorboard_log, seed=self.seed, acting=False)
        return self.model

    def _new_model(self, venv: Any, tensorboard_log: str | None, seed: int | None, acting: bool) -> Any:
        arch: Any = list(self.net_arch)
        if self.vf_net_arch is not None:
            arch = {"pi": list(self.net_arch), "vf": list(self.vf_net_arch)}
        model = algo_class(self.algo)(
            self._policy_class(),
            venv,
            policy_kwargs={
                "net_arch": arch,
                "activation_fn": activation_module(self.activation),
                **self._policy_kwargs(),
            },
            tensorboard_log=tensorboard_log,
            seed=seed,
            device="cpu",
            verbose=0,
            **{**DEFAULTS[self.algo], **self.hyper, **(_ACTING[self.algo] if acting else {})},
        )
        if tensorboard_log is None:  # else stable-baselines3 makes an empty SB3-<date> folder in the temp dir
            from stable_baselines3.common.logger import Logger

            model.set_logger(Logger(folder=None, output_formats=[]))
        return model

    def acting_model(self, state: dict[str, Any], source: str = "the RL policy") -> Any:
        """A model of this policy's network holding ``state`` (checked, then loaded with ``strict=True``), for
        acting: minimal buffers, and the global random generators left as they were."""
        import torch

        check_state(state, self.state_shapes(), source)
        with torch.random.fork_rng(devices=[]):  # weight initialization draws from torch's global generator
            model = self._new_model(self._spaces_env(), None, seed=None, acting=True)
        model.policy.load_state_dict(state, strict=True)
        return model

    # ---- the network's class, spaces and weights' shapes (a per-row policy, ``policies.rl_rows``, has others) ----
    def _policy_class(self) -> Any:
        return "MlpPolicy"

    def _policy_kwargs(self) -> dict[str, Any]:
        return {}

    def _spaces_env(self) -> Any:
        return SpacesEnv(self.obs_size, self.num_arms)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return state_shapes(self.algo, self.obs_size, self.num_arms, self.net_arch, self.vf_net_arch)

    def _check_spaces(self, model: Any) -> None:
        obs_shape = tuple(model.observation_space.shape)
        n = int(getattr(model.action_space, "n", -1))
        if obs_shape != (self.obs_size,) or n != self.num_arms:
            raise PolicyError(
                f"the {self.algo} model takes observations {obs_shape} and {model.action_space} actions, "
                f"but the policy header says ({self.obs_size},) and {self.num_arms} arms"
            )

    def _numpy_actor(self, model: Any) -> list[tuple[str, Any, Any]] | None:
        return numpy_actor(model)

    # ---- acting ----
    def predict(self, obs: np.ndarray, deterministic: bool = True) -> tuple[np.ndarray, Any]:
        """stable-baselines3's ``predict`` (one observation or a batch)."""
        if self.model is None:
            raise PolicyError("the RL policy is not trained (draftgym train CONFIG)")
        return self.model.predict(obs, deterministic=deterministic)

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        obs = self._check_batch(obs)
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

    # ---- saving: tensors and JSON, never pickles (policies.sb3_files) ----
    def state(self) -> dict[str, bytes]:
        if self.model is None:
            raise PolicyError("cannot save an untrained RL policy")
        return {
            "network.json": json_bytes(self.network()),
            "policy.safetensors": tensor_bytes(self.model.policy.state_dict()),
        }

    def restore(self, files: dict[str, bytes]) -> None:
        if "policy.safetensors" in files:
            if "network.json" not in files:
                raise PolicyError("RL policy file has policy.safetensors but no network.json")
            try:
                described = json.loads(files["network.json"])
            except (ValueError, RecursionError) as err:
                raise PolicyError(f"RL policy file: network.json is corrupted ({err})") from err
            if described != self.network():
                raise PolicyError(
                    f"RL policy file: network.json ({described}) disagrees with its header ({self.network()})"
                )
            state = read_tensors(files["policy.safetensors"], "RL policy file: policy.safetensors")
        elif (
            "model.zip" in files and self._policy_class() == "MlpPolicy"
        ):  # written by an earlier draftgym: stable-baselines3's zip, read as data
            z = read_sb3_zip(files["model.zip"], "RL policy file: model.zip")
            if z.activation != self.activation:
                raise PolicyError(
                    f"RL policy file: model.zip uses {z.activation}, its header {self.activation}"
                )
            state = z.state
        else:
            raise PolicyError(
                "RL policy file has no policy.safetensors (nor an older model.zip)"
                if self._policy_class() == "MlpPolicy" or "model.zip" not in files
                else f"RL policy file: a {self.type_name} policy has no stable-baselines3 zip form (model.zip); "
                "it needs policy.safetensors and network.json"
            )
        self.attach(self.acting_model(state, "RL policy file"))

    def attach(self, model: Any) -> None:
        """Use ``model`` (checked against this policy's observation size and arm count)."""
        self._check_spaces(model)
        self.model = model
        self._layers = self._numpy_actor(model)


def _layer_sizes(name: str, value: Any) -> list[int]:
    try:
        sizes = [int(x) for x in str(value).split(",") if x.strip()]
    except ValueError as err:
        raise PolicyError(f"{name} must be comma-separated layer sizes like '64,64', got {value!r}") from err
    if any(n < 1 for n in sizes) or any(n > MAX_LAYER for n in sizes) or len(sizes) > 64:
        raise PolicyError(
            f"{name} must list at most 64 positive layer sizes of at most {MAX_LAYER}, got {str(value)[:60]!r}"
        )
    return sizes


def numpy_actor(model: Any) -> list[tuple[str, Any, Any]] | None:
    """The deterministic action head of an MLP policy as numpy layers ``[("linear", W, b) | ("tanh"|"relu", ..)]``
    whose argmax is ``predict(obs, deterministic=True)``; None when the network is not a plain MLP."""
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
    return numpy_layers(mods)


def numpy_layers(mods: Sequence[Any]) -> list[tuple[str, Any, Any]] | None:
    """Torch ``Linear`` / ``Tanh`` / ``ReLU`` modules as numpy layers (``_forward``); None for any other module."""
    import torch

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
