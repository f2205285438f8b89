"""PPO that picks an arm for each row of the batch (``ppo-rows``): the tree shape for the batch, the drafter per row.

A batch verifies one tree per row, padded to the deepest (the batch cost model prices the step so), so what one
row drafts every row pays for. A policy that draws each row's arm on its own learns that slowly: one row moved to a
shallower arm saves nothing while another still drafts deep, and a gradient only appears when all of them move
at once. The actions are therefore split the way the cost is:

- one **shape** for the batch (``none``, or a depth and tree of the menu): a categorical over the menu's shapes
  from an MLP over the whole observation;
- one **drafter per row** (or none for that row): a categorical from one small MLP shared by every row slot,
  reading the batch's load and pooled features (the head of the serving observation, ``env.serve_obs``) next to
  the row's own block (active, context, acceptance estimate, last accepted length, match depth, progress) — what
  a batch of one row teaches serves a batch of sixteen.

Row ``i`` gets the arm of (its drafter, the batch's shape); the batch shape ``none``, or the row's choice of none,
gives ``none``. The menu must therefore hold every drafter at every shape, and ``none`` (``menu_grid``). The env
sees one arm per row slot (``action="row"``: ``MultiDiscrete([K] * max_batch)``), and stable-baselines3's PPO
trains the policy unchanged but for its distribution: the log-probability of a step's arms is the exact one of the
joint choice over the active rows (``none`` on every row is reachable through the shape ``none`` and through every
shape with each row choosing none: all are summed), and empty slots count for nothing — the server ignores their
arm. Acting deterministically, the policy takes the likeliest shape and each row's likeliest drafter.

The shape's MLP has the critic's layer sizes (``vf_net_arch``), the row actor ``net_arch``'s.

Saved as the other RL policies are: ``network.json`` and ``policy.safetensors``, the network rebuilt from the
description, never unpickled (``policies.sb3_files``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.base import PolicyError
from policies.rl import SB3Policy, _forward, numpy_layers
from policies.sb3_files import mlp_shapes
from policies.serving import ROW_BLOCK_AT, ROW_WIDTH, _check_serving

GLOBAL = ROW_BLOCK_AT  # load and pooled features, at the head of the observation
ROW_IN = GLOBAL + ROW_WIDTH  # what the row actor reads for one row slot
NEG = -1e9  # the log-probability of an arm the batch's shape rules out (finite: no NaN in gradients)


def menu_grid(arms: Sequence[str]) -> tuple[list[str], list[str], np.ndarray]:
    """``(drafters, shapes, arm_of)`` of a menu that holds ``none`` and every drafter at every shape:
    ``arm_of[s, d]`` is the arm index of drafter ``d`` at shape ``s`` (row ``s`` = 0: the batch shape ``none``),
    column ``d`` = ``len(drafters)`` the row's own ``none``. Any other menu is a ``PolicyError``."""
    from env.engine import parse_arm

    try:
        parsed = [parse_arm(a) for a in arms]
    except ValueError as err:
        raise PolicyError(f"ppo-rows: {err}") from None
    names = [a.name for a in parsed]
    if "none" not in names:
        raise PolicyError(f"ppo-rows needs 'none' in the menu, got {list(arms)}")
    drafters = sorted({a.drafter for a in parsed if a.drafter is not None})

    def order(shape: str) -> tuple[int, int, int, str]:
        t = parse_arm(f"{drafters[0]}-{shape}").shape
        return t.depth, t.topk, t.budget, shape

    shapes = sorted({a.name.split("-", 1)[1] for a in parsed if a.drafter is not None}, key=order)
    none = names.index("none")
    arm_of = np.full((len(shapes) + 1, len(drafters) + 1), none, np.int64)
    for s, shape in enumerate(shapes, start=1):
        for d, drafter in enumerate(drafters):
            name = parse_arm(f"{drafter}-{shape}").name
            if name not in names:
                raise PolicyError(
                    f"ppo-rows needs every drafter at every shape of the menu: {name} is missing "
                    f"(drafters {drafters}, shapes {shapes})"
                )
            arm_of[s, d] = names.index(name)
    if not drafters or len(names) != len(set(names)) or 1 + len(drafters) * len(shapes) != len(names):
        raise PolicyError(f"ppo-rows needs a menu of none and every drafter at every shape, got {list(arms)}")
    return drafters, shapes, arm_of


def row_inputs(x: np.ndarray, slots: int) -> np.ndarray:
    """``(..., obs)`` -> ``(..., slots, ROW_IN)``: each slot's row block after the batch's own features."""
    g = x[..., :GLOBAL]
    r = x[..., GLOBAL:].reshape(*x.shape[:-1], slots, ROW_WIDTH)
    return np.concatenate([np.broadcast_to(g[..., None, :], (*r.shape[:-1], GLOBAL)), r], axis=-1)


def compose(shape: np.ndarray, drafter: np.ndarray, arm_of: np.ndarray) -> np.ndarray:
    """Arm index per row slot from the batch's shape ``(N,)`` and each row's drafter ``(N, slots)``."""
    return arm_of[shape[:, None], drafter]


@functools.cache
def row_policy_class() -> type:
    """The stable-baselines3 policy class (built on first use: importing this module does not import torch)."""
    import torch as th
    from stable_baselines3.common.policies import ActorCriticPolicy
    from torch import nn

    def mlp(sizes: list[int], d: int, act: Any) -> tuple[nn.Sequential, int]:
        layers: list[nn.Module] = []
        for h in sizes:
            layers += [nn.Linear(d, h), act()]
            d = h
        return nn.Sequential(*layers), d

    class RowExtractor(nn.Module):
        """``forward_actor``: ``(B, obs)`` -> the row actor's latent of every slot, then the shape actor's;
        ``forward_critic``: an MLP over the whole observation (stable-baselines3's ``MlpExtractor`` interface)."""

        def __init__(self, feature_dim: int, slots: int, net_arch: Any, act: Any) -> None:
            super().__init__()
            pi, vf = (
                (net_arch.get("pi", []), net_arch.get("vf", []))
                if isinstance(net_arch, dict)
                else (net_arch,) * 2
            )
            self.slots = slots
            self.policy_net, self.hidden = mlp(list(pi), ROW_IN, act)  # one per row slot, shared
            self.batch_net, self.batch_hidden = mlp(list(vf), feature_dim, act)  # the batch's shape
            self.value_net, self.latent_dim_vf = mlp(list(vf), feature_dim, act)
            self.latent_dim_pi = slots * self.hidden + self.batch_hidden

        def forward_actor(self, f: th.Tensor) -> th.Tensor:
            b = f.shape[0]
            g = f[:, :GLOBAL].unsqueeze(1).expand(b, self.slots, GLOBAL)
            x = th.cat([g, f[:, GLOBAL:].reshape(b, self.slots, ROW_WIDTH)], dim=2)
            return th.cat([self.policy_net(x).reshape(b, -1), self.batch_net(f)], dim=1)

        def forward_critic(self, f: th.Tensor) -> th.Tensor:
            return self.value_net(f)

        def forward(self, f: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
            return self.forward_actor(f), self.forward_critic(f)

    class GridHead(nn.Module):
        """The latent -> ``(row logits (B, slots, drafters + 1), shape logits (B, shapes + 1))``."""

        def __init__(self, hidden: int, batch_hidden: int, drafters: int, shapes: int, slots: int) -> None:
            super().__init__()
            self.rows, self.shape = nn.Linear(hidden, drafters + 1), nn.Linear(batch_hidden, shapes + 1)
            self.slots, self.hidden = slots, hidden

        def forward(self, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
            b, cut = x.shape[0], self.slots * self.hidden
            return self.rows(x[:, :cut].reshape(b, self.slots, self.hidden)), self.shape(x[:, cut:])

    class GridDistribution:
        """The joint choice: a shape for the batch, a drafter (or none) per active row."""

        def __init__(self, rows: th.Tensor, shape: th.Tensor, active: th.Tensor, arm_of: th.Tensor,
                     cols: th.Tensor) -> None:  # fmt: skip
            self.rows, self.shape = th.log_softmax(rows, -1), th.log_softmax(shape, -1)
            self.active, self.arm_of, self.cols = active, arm_of, cols

        def get_actions(self, deterministic: bool = False) -> th.Tensor:
            if deterministic:
                s, d = self.shape.argmax(-1), self.rows.argmax(-1)
            else:
                s = th.distributions.Categorical(logits=self.shape).sample()
                d = th.distributions.Categorical(logits=self.rows).sample()
            return self.arm_of[s.unsqueeze(1), d]

        def log_prob(self, actions: th.Tensor) -> th.Tensor:
            """log P(arms) over the active rows, summed over the shapes that could have given them."""
            a = actions.long()
            terms = []
            for s in range(self.cols.shape[0]):
                c = self.cols[s][a]  # each row's column under shape s (-1: an arm shape s cannot give)
                if s == 0:  # the batch shape none: every row none, whatever the rows' own choices
                    row_lp = th.where(
                        c >= 0, th.zeros_like(self.rows[..., 0]), th.full_like(self.rows[..., 0], NEG)
                    )
                else:
                    got = self.rows.gather(2, c.clamp(min=0).unsqueeze(2)).squeeze(2)
                    row_lp = th.where(c >= 0, got, th.full_like(got, NEG))
                terms.append(self.shape[:, s] + (row_lp * self.active).sum(1))
            return th.logsumexp(th.stack(terms, dim=1), dim=1)

        def entropy(self) -> th.Tensor:
            """The shape's entropy and the active rows' mean (a bonus to explore, not the joint's entropy)."""
            h_rows = -(self.rows.exp() * self.rows).sum(-1)
            h_shape = -(self.shape.exp() * self.shape).sum(-1)
            return h_shape + (h_rows * self.active).sum(1) / self.active.sum(1).clamp(min=1.0)

    class RowSharedPolicy(ActorCriticPolicy):
        """An actor-critic acting by ``GridDistribution`` (see the module docstring)."""

        def __init__(self, observation_space: Any, action_space: Any, lr_schedule: Any, *, arm_of: Any = None,
                     **kwargs: Any) -> None:  # fmt: skip
            # the lookup tables are buffers (they move with the module), made in _build, once nn.Module is set up
            nvec = np.asarray(getattr(action_space, "nvec", []))
            if nvec.ndim != 1 or nvec.size < 1 or len(set(nvec.tolist())) != 1:
                raise PolicyError(
                    f"a per-row policy needs MultiDiscrete([K] * slots) actions, got {action_space}"
                )
            self.slots = int(nvec.size)
            if observation_space.shape != (GLOBAL + ROW_WIDTH * self.slots,):
                raise PolicyError(
                    f"a per-row policy over {self.slots} slots reads observations of "
                    f"{GLOBAL + ROW_WIDTH * self.slots}, got {observation_space.shape}"
                )
            grid = np.asarray(arm_of, np.int64)
            k = int(nvec[0])
            if (
                grid.ndim != 2
                or min(grid.shape) < 2
                or grid.min() < 0
                or grid.max() >= k
                or len(set(grid[0].tolist())) != 1  # the shape none: every row none
                or (grid[:, -1] != grid[0, 0]).any()  # the row's own none
                or any(len(set(r.tolist())) != len(r) for r in grid[1:])  # one arm per drafter at each shape
            ):
                raise PolicyError(
                    f"a per-row policy needs its menu's grid (menu_grid), got {str(arm_of)[:80]}"
                )
            cols = np.full((grid.shape[0], k), -1, np.int64)  # arm -> its column under each shape
            for s in range(grid.shape[0]):
                cols[s, grid[s]] = np.arange(grid.shape[1])
            self._grid, self._cols = grid, cols
            super().__init__(observation_space, action_space, lr_schedule, **kwargs)

        def _build_mlp_extractor(self) -> None:
            self.mlp_extractor = RowExtractor(
                self.features_dim, self.slots, self.net_arch, self.activation_fn
            )

        def _build(self, lr_schedule: Any) -> None:
            self.register_buffer("arm_of", th.as_tensor(self._grid), persistent=False)
            self.register_buffer("cols", th.as_tensor(self._cols), persistent=False)
            super()._build(lr_schedule)
            e = self.mlp_extractor
            shapes, drafters = self.arm_of.shape[0] - 1, self.arm_of.shape[1] - 1
            self.action_net = GridHead(e.hidden, e.batch_hidden, drafters, shapes, self.slots)
            if self.ortho_init:
                self.action_net.apply(functools.partial(self.init_weights, gain=0.01))
            self.optimizer = self.optimizer_class(
                self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs
            )

        def _dist(self, features: th.Tensor) -> GridDistribution:
            rows, shape = self.action_net(self.mlp_extractor.forward_actor(features))
            active = (features[:, GLOBAL::ROW_WIDTH] > 0.5).to(features.dtype)
            return GridDistribution(rows, shape, active, self.arm_of, self.cols)

        def forward(
            self, obs: th.Tensor, deterministic: bool = False
        ) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
            features = self.extract_features(obs)
            dist = self._dist(features)
            values = self.value_net(self.mlp_extractor.forward_critic(features))
            actions = dist.get_actions(deterministic=deterministic)
            return actions.reshape((-1, *self.action_space.shape)), values, dist.log_prob(actions)

        def evaluate_actions(
            self, obs: th.Tensor, actions: th.Tensor
        ) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
            features = self.extract_features(obs)
            dist = self._dist(features)
            values = self.value_net(self.mlp_extractor.forward_critic(features))
            return values, dist.log_prob(actions), dist.entropy()

        def get_distribution(self, obs: th.Tensor) -> Any:
            return self._dist(self.extract_features(obs))

    return RowSharedPolicy


class SB3RowPolicy(SB3Policy):
    """PPO (or A2C) with the batch's tree shape and each row's drafter (see the module docstring). ``act``
    returns one arm index per row slot (an empty slot's is ignored)."""

    type_name = "sb3_rows"
    per_row = True

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(arms, obs_size, features, **kwargs)
        if self.algo == "dqn":
            raise PolicyError("a per-row policy is an actor-critic (ppo or a2c); DQN scores one action")
        self.slots = _check_serving(self)
        self.drafters, self.shapes, self.arm_of = menu_grid(self.arm_names)

    @property
    def name(self) -> str:
        return f"{self.algo}-rows"

    def network(self) -> dict[str, Any]:
        return {**super().network(), "action": "row", "slots": self.slots, "drafters": list(self.drafters),
                "shapes": list(self.shapes)}  # fmt: skip

    def _policy_class(self) -> Any:
        return row_policy_class()

    def _policy_kwargs(self) -> dict[str, Any]:
        return {"arm_of": self.arm_of.tolist()}

    def _spaces_env(self) -> Any:
        from policies.sb3_files import SpacesEnv

        return SpacesEnv(self.obs_size, self.num_arms, slots=self.slots)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        vf = self.net_arch if self.vf_net_arch is None else self.vf_net_arch
        d = mlp_shapes(shapes, "mlp_extractor.policy_net", self.net_arch, ROW_IN)
        n = len(self.drafters) + 1
        shapes["action_net.rows.weight"], shapes["action_net.rows.bias"] = (n, d), (n,)
        d = mlp_shapes(shapes, "mlp_extractor.batch_net", vf, self.obs_size)
        n = len(self.shapes) + 1
        shapes["action_net.shape.weight"], shapes["action_net.shape.bias"] = (n, d), (n,)
        d = mlp_shapes(shapes, "mlp_extractor.value_net", vf, self.obs_size)
        shapes["value_net.weight"], shapes["value_net.bias"] = (1, d), (1,)
        return shapes

    def _check_spaces(self, model: Any) -> None:
        obs_shape = tuple(model.observation_space.shape)
        nvec = [int(n) for n in np.asarray(getattr(model.action_space, "nvec", [])).reshape(-1)]
        if obs_shape != (self.obs_size,) or nvec != [self.num_arms] * self.slots:
            raise PolicyError(
                f"the {self.algo} model takes observations {obs_shape} and actions {model.action_space}, but the "
                f"policy header says ({self.obs_size},) and {self.num_arms} arms for each of {self.slots} rows"
            )

    def _numpy_actor(self, model: Any) -> Any:
        p = model.policy
        rows = numpy_layers([*p.mlp_extractor.policy_net, p.action_net.rows])
        shape = numpy_layers([*p.mlp_extractor.batch_net, p.action_net.shape])
        return None if rows is None or shape is None else (rows, shape)

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """``(N, obs)`` -> ``(N, slots)`` arm indices."""
        x = self._check_batch(obs).astype(np.float32, copy=False)
        if self._layers is None:
            return np.asarray(self.predict(x, deterministic=True)[0]).reshape(-1, self.slots)
        rows, shape = self._layers
        d = np.argmax(_forward(rows, row_inputs(x, self.slots)), axis=-1)
        return compose(np.argmax(_forward(shape, x), axis=-1), d, self.arm_of)

    def act(self, obs: np.ndarray | None) -> np.ndarray:  # type: ignore[override]
        return self.act_batch(self._check_obs(obs)[None])[0].astype(np.int64)
