"""stable-baselines3 networks as data: nothing here unpickles, so no file read here can run code at load.

stable-baselines3's own ``load`` unpickles the ``data`` entries marked ``:serialized:`` and its replay buffers are
pickles (LIBRARY-FACTS.md), so draftgym never calls it. Instead:

- a draftgym ``sb3`` (or per-row ``sb3_rows``) policy file carries ``network.json`` (``SB3Policy.network()``:
  algorithm, layer sizes, activation, observation and action sizes, hyper-parameters; for a per-row policy its row
  slots, drafters and shapes) and ``policy.safetensors`` (the policy's state dict); the model is rebuilt from the
  description (a fresh ``MlpPolicy``, or ``policies.rl_rows``' network, on ``SpacesEnv``) and the tensors are
  loaded with ``strict=True``;
- a plain stable-baselines3 zip (``model.save``) is read by ``read_sb3_zip``: only its ``policy.pth``
  (``torch.load(weights_only=True)``) and the plain JSON fields of ``data`` (never the ``:serialized:`` ones);
  the algorithm, layer sizes, observation size and action count come from the weights' shapes, the activation
  from ``policy_kwargs`` (stable-baselines3's default when absent); ``load_sb3_zip`` names its arms.

Training checkpoints, read the same way, are ``policies.sb3_checkpoints``.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from policies.archive import ARCHIVE_BYTES, one_line
from policies.base import PolicyError

# activation name in our files -> torch.nn class name (what stable-baselines3's ``activation_fn`` holds)
ACTIVATIONS = {
    "tanh": "Tanh",
    "relu": "ReLU",
    "elu": "ELU",
    "leaky_relu": "LeakyReLU",
    "gelu": "GELU",
    "silu": "SiLU",
}
DEFAULT_ACTIVATION = {"ppo": "tanh", "a2c": "tanh", "dqn": "relu"}  # stable-baselines3's MlpPolicy defaults


def activation_module(name: str) -> Any:
    import torch

    if name not in ACTIVATIONS:
        raise PolicyError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}")
    return getattr(torch.nn, ACTIVATIONS[name])


class SpacesEnv(gymnasium.Env):
    """Only the spaces of the replay env (stable-baselines3 builds its networks from them); it cannot step."""

    def __init__(self, obs_size: int, n_actions: int, slots: int = 0) -> None:
        """``slots`` > 0: one action per slot (``MultiDiscrete([n_actions] * slots)``, a per-row policy)."""
        self.observation_space = spaces.Box(-np.inf, np.inf, (obs_size,), dtype=np.float32)
        self.action_space = spaces.MultiDiscrete([n_actions] * slots) if slots else spaces.Discrete(n_actions)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, dtype=np.float32), {}

    def step(self, action: int):
        raise PolicyError("this model was rebuilt for acting; train on the replay env instead")


# ---- the state dict of an MlpPolicy ------------------------------------------------------------------------------


def mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, sizes: Sequence[int], d: int) -> int:
    """Add the shapes of an MLP ``prefix`` (``nn.Sequential`` of Linear and activation: Linear at even indices)
    from ``d`` inputs through ``sizes``; returns its output width."""
    for i, h in enumerate(sizes):
        shapes[f"{prefix}.{2 * i}.weight"], shapes[f"{prefix}.{2 * i}.bias"] = (h, d), (h,)
        d = h
    return d


def state_shapes(
    algo: str, obs_size: int, n_actions: int, net_arch: list[int], vf_net_arch: list[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the state dict of stable-baselines3's ``MlpPolicy`` (Linear layers at even indices, the
    activation between them)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def mlp(prefix: str, sizes: list[int], d: int) -> int:
        return mlp_shapes(shapes, prefix, sizes, d)

    if algo == "dqn":
        for net in ("q_net", "q_net_target"):
            d = mlp(f"{net}.q_net", net_arch, obs_size)
            last = f"{net}.q_net.{2 * len(net_arch)}"
            shapes[f"{last}.weight"], shapes[f"{last}.bias"] = (n_actions, d), (n_actions,)
    else:
        d = mlp("mlp_extractor.policy_net", net_arch, obs_size)
        shapes["action_net.weight"], shapes["action_net.bias"] = (n_actions, d), (n_actions,)
        d = mlp("mlp_extractor.value_net", net_arch if vf_net_arch is None else vf_net_arch, obs_size)
        shapes["value_net.weight"], shapes["value_net.bias"] = (1, d), (1,)
    return shapes


def check_state(state: dict[str, Any], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse a state dict whose keys or shapes are not those of the network described."""
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got == expected:
        return
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    wrong = [k for k in expected if k in got and got[k] != expected[k]]
    if missing:
        what = f"missing {missing[:3]}"
    elif extra:
        what = f"unexpected {extra[:3]}"
    else:
        what = f"{wrong[0]} has shape {list(got[wrong[0]])}, expected {list(expected[wrong[0]])}"
    raise PolicyError(f"{source}: the weights do not fit the network described ({what})")


def _layers(state: dict[str, Any], prefix: str) -> list[tuple[int, int]]:
    """(out, in) of the Linear layers ``prefix.<i>.weight``, in index order."""
    found = sorted(
        (int(m.group(1)), tuple(v.shape))
        for k, v in state.items()
        if (m := re.fullmatch(re.escape(prefix) + r"\.(\d+)\.weight", k)) and v.dim() == 2
    )
    return [s for _, s in found]


def infer_network(state: dict[str, Any], source: str) -> tuple[str, int, int, list[int], list[int] | None]:
    """(family "dqn" | "actor_critic", obs size, action count, net_arch, value net_arch or None when the same)
    from the weights' shapes; refuses anything but a discrete-action ``MlpPolicy``."""
    if "q_net.q_net.0.weight" in state:
        layers = _layers(state, "q_net.q_net")
        family, obs, n, pi, vf = "dqn", layers[0][1], layers[-1][0], [o for o, _ in layers[:-1]], None
    elif "action_net.weight" in state and "value_net.weight" in state:
        pi_l, vf_l = _layers(state, "mlp_extractor.policy_net"), _layers(state, "mlp_extractor.value_net")
        n = int(state["action_net.weight"].shape[0])
        obs = pi_l[0][1] if pi_l else int(state["action_net.weight"].shape[1])
        pi, vf = [o for o, _ in pi_l], [o for o, _ in vf_l]
        family, vf = "actor_critic", None if vf == pi else vf
    else:
        raise PolicyError(
            f"{source} is not a stable-baselines3 MlpPolicy of PPO, A2C or DQN with discrete actions "
            f"(its weights: {sorted(state)[:4]})"
        )
    check_state(state, state_shapes("dqn" if family == "dqn" else "ppo", obs, n, pi, vf), source)
    return family, int(obs), int(n), pi, vf


# ---- tensors -------------------------------------------------------------------------------------------------------


def tensor_bytes(state: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in state.items()})


def read_tensors(data: bytes, source: str) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        state = load(data)
    except Exception as err:  # safetensors raises its own error types; the file is not a tensor file
        raise PolicyError(f"{source} is not a safetensors file ({one_line(err)})") from err
    finite_tensors(state, source)
    return state


def finite_tensors(state: dict[str, Any], source: str) -> None:
    """Refuse weights that are not dense real floating-point arrays finite in float32, the dtype of the network
    they load into: NaN or infinity (a network of them acts, but on nothing: argmax of NaN is arm 0), 1e300 in
    float64 (infinite once loaded), complex or integer tensors, or a strided view (a few bytes of storage seen as
    GBs of elements)."""
    import torch

    for key, t in state.items():
        if not t.is_floating_point():
            raise PolicyError(f"{source}: tensor {key} has dtype {t.dtype}, not a real floating-point one")
        if not t.is_contiguous():
            raise PolicyError(f"{source}: tensor {key} is not a dense array (a strided view of its storage)")
        if not bool(t.to(torch.float32).isfinite().all()):
            raise PolicyError(f"{source}: tensor {key} holds NaN or values that are infinite in float32")


def stored_records(data: bytes, source: str) -> None:
    """A ``torch.save`` file is a zip whose records are stored, not compressed (torch writes them so); torch's
    reader would inflate a deflated record whole, so a file of KBs could unpack to GBs before any check. Refused:
    another format (torch's legacy one allocates the sizes its pickle declares), a compressed or encrypted
    record, records declaring more bytes than the file holds."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except Exception as err:  # BadZipFile, EOFError, OSError, ValueError, ...: not a zip
        raise PolicyError(
            f"{source} is not a plain tensor file (not a torch.save zip: {one_line(err)})"
        ) from None
    for info in infos:
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.flag_bits & 0x1
            or info.file_size != info.compress_size
        ):
            raise PolicyError(
                f"{source}: record {info.filename[:80]!r} is compressed or encrypted "
                "(torch.save stores its records; refused before unpacking)"
            )
    declared = sum(i.file_size for i in infos)
    if declared > len(data):
        raise PolicyError(f"{source}: its records declare {declared} bytes, more than the file's {len(data)}")


def read_torch_tensors(data: bytes, source: str) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary objects; its records
    checked first (``stored_records``: what torch unpacks is at most the file's size)."""
    import warnings

    import torch

    stored_records(data, source)
    try:
        with warnings.catch_warnings():  # (torch warns of a pickle's protocol on stderr: not ours to print)
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for objects other than tensors, RuntimeError for garbage
        if type(err).__name__ == "UnpicklingError":  # (torch's text goes on to suggest turning its check off)
            raise PolicyError(
                f"{source} is not a plain tensor file: it holds objects other than tensors, which draftgym never "
                "loads (that would run code from the file)"
            ) from None
        raise PolicyError(f"{source} is not a plain tensor file ({one_line(err)[:200]})") from err


def torch_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- a plain stable-baselines3 zip ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SB3Zip:
    """What a ``model.save`` zip tells when read as data."""

    algo: str
    obs_size: int
    n_actions: int
    net_arch: list[int]
    vf_net_arch: list[int] | None
    activation: str
    state: dict[str, Any]
    hyper: dict[str, Any] = field(default_factory=dict)  # the plain numeric fields of ``data``
    version: str | None = None


def read_sb3_zip(src: str | Path | bytes, source: str) -> SB3Zip:
    """Read a stable-baselines3 ``model.save`` zip as data: ``policy.pth`` with ``weights_only=True`` and the
    plain fields of ``data``; the ``:serialized:`` (pickled) payloads are never decoded."""
    from env.safe_zip import ArchiveProblem, parse_json, read_zip

    members = ("policy.pth", "data", "_stable_baselines3_version")
    try:  # the optimizer's and pytorch_variables' members are neither read nor counted
        files = read_zip(src, max_bytes=ARCHIVE_BYTES, only=members)
        if "policy.pth" not in files:
            raise PolicyError(f"{source} is not a stable-baselines3 zip (no policy.pth)")
        raw = files["policy.pth"]
        data = parse_json(files["data"]) if "data" in files else {}
    except ArchiveProblem as err:
        raise PolicyError(f"{source} is not a readable stable-baselines3 zip ({err})") from None
    version = (
        files["_stable_baselines3_version"].decode(errors="replace").strip()[:40]
        if "_stable_baselines3_version" in files
        else None
    )
    state = read_torch_tensors(raw, f"{source}: policy.pth")
    import torch

    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise PolicyError(f"{source}: policy.pth is not a state dict of tensors")
    finite_tensors(state, f"{source}: policy.pth")
    data = data if isinstance(data, dict) else {}
    family, obs, n, pi, vf = infer_network(state, source)
    if family == "dqn":
        algo = "dqn"
    else:  # PPO and A2C have the same network; PPO's data has n_epochs and clip_range
        algo = "ppo" if not data or "n_epochs" in data or "clip_range" in data else "a2c"
    _check_spaces(data, obs, n, source)
    hyper = {}
    for key, value in data.items():  # plain numbers only (a schedule or a TrainFreq is a pickle: skipped)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            hyper[key] = value
    return SB3Zip(algo, obs, n, pi, vf, _activation(data, algo, source), state, hyper, version)


def _check_spaces(data: dict[str, Any], obs: int, n: int, source: str) -> None:
    """The plain fields next to the pickled spaces (``_shape``, ``n``, ``start``) must agree with the weights."""
    ospace, aspace = data.get("observation_space"), data.get("action_space")
    if isinstance(ospace, dict):
        if "Box" not in str(ospace.get(":type:", "Box")):
            raise PolicyError(f"{source}: the observation space is {ospace.get(':type:')}, not a Box")
        shape = ospace.get("_shape")
        if shape is not None and list(shape) != [obs]:
            raise PolicyError(f"{source}: the observation space has shape {shape}, the weights take {obs}")
    if isinstance(aspace, dict):
        if "Discrete" not in str(aspace.get(":type:", "Discrete")):
            raise PolicyError(f"{source}: the action space is {aspace.get(':type:')}, not Discrete")
        if str(aspace.get("start", "0")) != "0":
            raise PolicyError(f"{source}: the action space starts at {aspace.get('start')}, not 0")
        if aspace.get("n") is not None and str(aspace["n"]) != str(n):
            raise PolicyError(f"{source}: the action space has {aspace['n']} actions, the weights {n}")


def _activation(data: dict[str, Any], algo: str, source: str) -> str:
    """The activation named in ``policy_kwargs`` (a plain string even when the dict is pickled), or the default."""
    kwargs = data.get("policy_kwargs")
    if not isinstance(kwargs, dict):
        return DEFAULT_ACTIVATION[algo]
    extractor = kwargs.get("features_extractor_class")
    if extractor is not None and "FlattenExtractor" not in str(extractor):
        raise PolicyError(f"{source}: uses the features extractor {extractor}; only FlattenExtractor is read")
    act = kwargs.get("activation_fn")
    if act is None:
        return DEFAULT_ACTIVATION[algo]
    m = re.fullmatch(r"<class 'torch\.nn\.modules\.activation\.(\w+)'>", str(act))
    names = {cls: name for name, cls in ACTIVATIONS.items()}
    if not m or m.group(1) not in names:
        raise PolicyError(f"{source}: activation {act} is not one of {', '.join(ACTIVATIONS.values())}")
    return names[m.group(1)]


DEFAULT_ENV = "draftgym/SpecDecode-v0"


def default_env_menu() -> tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]:
    """(arm names, feature names, feature spec) of ``gymnasium.make("draftgym/SpecDecode-v0")``."""
    import gymnasium

    import env  # noqa: F401  (registers draftgym/SpecDecode-v0)

    e = gymnasium.make(DEFAULT_ENV)
    try:
        u = e.unwrapped
        return tuple(u.arm_names), tuple(u.feature_names), u.feature_spec.as_dict()
    finally:
        e.close()


def load_sb3_zip(path: str | Path, *, arms: Sequence[str] | None = None, obs_size: int | None = None) -> Any:
    """A plain stable-baselines3 zip (``model.save`` of an ``MlpPolicy`` trained on the env) as an ``SB3Policy``,
    read as data (``policies.sb3_files.read_sb3_zip``). Its arms are named by ``arms`` (the decoder's or env's
    menu), or else by the default env's menu, whose feature spec it then takes too; a model with another
    number of actions or another observation size than that menu is refused."""
    from policies.rl import HYPER, INT_HYPER, SB3Policy

    z = read_sb3_zip(Path(path), str(path))
    features: tuple[str, ...] | None = None
    spec: dict[str, Any] | None = None
    where = "this decoder/env"
    if arms is None:
        arms, features, spec = default_env_menu()
        where = f"the default env {DEFAULT_ENV}"
    if z.n_actions != len(arms):
        raise PolicyError(
            f"{path}: the stable-baselines3 model has {z.n_actions} actions, but {where} has {len(arms)} arms "
            f"({', '.join(arms)})"
        )
    if obs_size is not None and z.obs_size != obs_size:
        raise PolicyError(
            f"{path}: the stable-baselines3 model takes observations of size {z.obs_size}, "
            f"but this decoder/env gives {obs_size}"
        )
    if features is not None and len(features) != z.obs_size:
        if obs_size is None:
            raise PolicyError(
                f"{path}: the stable-baselines3 model takes observations of size {z.obs_size}, "
                f"but {where} gives {len(features)}"
            )
        features = spec = None  # the caller's observation, not the default env's
    hyper = {
        k: v for k, v in z.hyper.items() if k in HYPER[z.algo] and (isinstance(v, int) or k not in INT_HYPER)
    }
    policy = SB3Policy(arms, z.obs_size, features, algo=z.algo, net_arch=",".join(map(str, z.net_arch)),
                       vf_net_arch=None if z.vf_net_arch is None else ",".join(map(str, z.vf_net_arch)),
                       activation=z.activation, **hyper)  # fmt: skip
    policy.attach(policy.acting_model(z.state, str(path)))
    policy.meta = {"source": "stable-baselines3 zip", "stable_baselines3": z.version}
    if spec is not None:
        policy.meta["feature_spec"] = spec
    return policy
