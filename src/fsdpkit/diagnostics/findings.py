"""What a diagnostic check found, and how findings reach the user: warnings are logged on rank 0,
errors raise `FSDPContractError` on every rank (or are logged when strict=False)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from fsdpkit import dist
from fsdpkit.log import get_logger

ERROR = "error"
WARNING = "warning"

# One code per contract; tests and callers match on these rather than on wording.
NOT_SHARDED = "not-sharded"
ONLY_ROOT_SHARDED = "only-root-sharded"
PARAMS_OUTSIDE_UNITS = "params-outside-units"
OPTIMIZER_BEFORE_SHARDING = "optimizer-before-sharding"
PARAMS_NOT_IN_OPTIMIZER = "params-not-in-optimizer"
REGISTERED_TWICE = "registered-twice"
SHARED_ACROSS_UNITS = "shared-across-units"
MIXED_PRECISION_NOT_PROPAGATED = "mixed-precision-not-propagated"
FP32_IN_FORWARD = "fp32-in-forward"
FORWARD_BYPASSED_HOOKS = "forward-bypassed-hooks"
NO_FORWARD_SEEN = "no-forward-seen"
PER_SHARD_GRAD_NORM = "per-shard-grad-norm"
GRAD_NORM_MISMATCH = "grad-norm-mismatch"
PARAM_SKEW = "param-skew"

log = get_logger("diagnostics")


@dataclass(frozen=True)
class Finding:
    """One problem: `level` is ERROR or WARNING, `code` one of the constants above, `message`
    says what is wrong, where, and how to fix it."""

    level: str
    code: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "code": self.code, "message": self.message}


class FSDPContractError(ValueError):
    """A setup mistake that makes FSDP training silently wrong; the text says how to fix it.

    A ValueError so that the `fsdpkit` CLI prints it as a user error, like a bad config value.
    """

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        lines = [f"[{f.code}] {f.message}" for f in findings]
        head = "FSDP setup check failed" if len(lines) == 1 else f"FSDP setup check failed ({len(lines)} problems)"
        super().__init__(head + ":\n  " + "\n  ".join(lines))


def report_findings(findings: Iterable[Finding], *, strict: bool = True,
                    logger: logging.Logger | None = None) -> list[Finding]:
    """Log warnings (rank 0) and raise on errors (every rank) unless strict=False, in which case
    errors are logged (rank 0) too. Returns the findings.

    Raises:
        FSDPContractError: strict and at least one finding is an error.
    """
    findings = list(findings)
    logger = logger or log
    errors = [f for f in findings if f.level == ERROR]
    if dist.is_main():
        for f in findings:
            if f.level == WARNING or not strict:
                logger.log(logging.ERROR if f.level == ERROR else logging.WARNING, "[%s] %s", f.code, f.message)
    if errors and strict:
        raise FSDPContractError(errors)
    return findings
