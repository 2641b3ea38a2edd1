"""A warning for runs in which nothing trains: the first steps' gradient norm is exactly 0 and the
loss never moves. Such a run exits 0 and writes checkpoints; without this line the first sign is
a flat loss curve after hours."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FIRST_STEPS = 3
"""How many of a run's first step records the check looks at (the Trainer checks once, then)."""


def nothing_trains_warning(records: Sequence[Mapping[str, float]]) -> str | None:
    """A paragraph for the log when every record (a step's metrics: `step`, `loss`, `grad_norm`)
    has grad_norm exactly 0.0 and all carry the same loss; None otherwise (and for no records)."""
    if not records or any(r["grad_norm"] != 0.0 for r in records) or len({r["loss"] for r in records}) != 1:
        return None
    steps = [int(r["step"]) for r in records]
    loss = records[0]["loss"]
    masked = " (a loss of exactly 0 points here)" if loss == 0.0 else ""
    return (
        f"nothing is training: steps {steps[0]}-{steps[-1]} all had grad_norm 0.0 and loss {loss:.6g} "
        f"(unchanged). Usual causes: no parameter receives a gradient (every parameter frozen, or LoRA "
        f"model.peft.target_modules matching only frozen or unused layers); every target masked to -100, so "
        f"nothing is scored{masked}: check the data's labels and chat masking; or weights and buffers left "
        f"uninitialised after to_empty() (NaN or garbage that makes the output constant, such as non-persistent "
        f"buffers never recomputed). A learning rate of 0 in warmup does not cause this: it leaves the gradient "
        f"norm above 0."
    )
