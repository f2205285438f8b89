"""The static policy: the same arm every step. The baseline every adaptive policy is measured against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.base import BasePolicy, PolicyError


class StaticPolicy(BasePolicy):
    """Always ``arm`` (an arm name from the menu)."""

    type_name = "static"
    kind = "static"

    def __init__(
        self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *, arm: str
    ) -> None:
        super().__init__(arms, obs_size, features)
        if arm not in self.arm_names:
            raise PolicyError(f"static arm {arm!r} is not in the arm menu {list(self.arm_names)}")
        self.arm = arm
        self.index = self.arm_names.index(arm)

    @property
    def name(self) -> str:
        return f"static:{self.arm}"

    def params(self) -> dict[str, Any]:
        return {"arm": self.arm}

    @property
    def static_arm(self) -> int:
        """Served live as an engine configured with this arm: no observation (``env.serving.serve``)."""
        return self.index

    def act(self, obs: np.ndarray | None) -> int:
        return self.index
