"""The trainer's own counters, a `Stateful` saved with every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Training tokens consumed over all ranks."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
