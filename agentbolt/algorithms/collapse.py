"""The collapse watch: GRPO warns, in its table and its metrics, when a run shows the signs of a
policy that stopped learning, so a user does not spend hours on steps that change nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CollapseWatch"]

# the share of groups without a reward spread above which a step teaches (almost) nothing
_FLAT_SHARE = 0.75


@dataclass
class CollapseWatch:
    """Signs that learning stalled: the policy entropy below ``min_entropy``, or more than 75% of
    groups without a reward spread for ``steps`` steps in a row. Warns once per such stretch."""

    min_entropy: float
    steps: int
    zero_spread_run: int = 0
    warned: bool = False

    def check(self, row: dict[str, Any]) -> str | None:
        """The warning for a step's ``row``, or None (a validation-only row counts for nothing)."""
        if "reward_mean" not in row:
            return None
        self.zero_spread_run = self.zero_spread_run + 1 if _mostly_flat(row) else 0
        reasons = self._reasons(row.get("entropy"))
        if not reasons:
            self.warned = False
            return None
        if self.warned:
            return None
        self.warned = True
        return "possible collapse: " + "; ".join(reasons)

    def _reasons(self, entropy: float | None) -> list[str]:
        reasons = []
        if self.min_entropy and entropy is not None and entropy < self.min_entropy:
            reasons.append(f"policy entropy {entropy:.3f} is below {self.min_entropy:g}")
        if self.steps and self.zero_spread_run >= self.steps:
            reasons.append(
                f"more than 75% of groups had zero reward spread for {self.zero_spread_run} steps in a row"
            )
        return reasons


def _mostly_flat(row: dict[str, Any]) -> bool:
    groups = row.get("groups") or 0
    return bool(groups) and row.get("zero_spread_groups", 0) / groups > _FLAT_SHARE
