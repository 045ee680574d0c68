"""Priorities, tenants and lanes: how a burst shares a shard with the others
(docs/architecture.md, "Sharing a shard", has the design, the layout and its costs).

A burst has a **priority**, one of `PRIORITIES` (highest first; default ``normal``), and a
**tenant** (a name like a namespace's; default ``default``). Each shard has one *intake* stream per
priority (`Keys.intake`) and one *lane* stream per burst that sends it more than its head
(`Keys.lane`); the shard's lane index (`Keys.lanes`: burst -> `LaneInfo`) lists the lanes. Workers
share a shard by priority first (strictly), then by tenant weight (`parse_weights`), then equally
between a tenant's bursts; a tenant may be capped (`parse_caps`). Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prefixq.core.errors import ValidationError

__all__ = [
    "DEFAULT_PRIORITY",
    "DEFAULT_TENANT",
    "PRIORITIES",
    "LaneInfo",
    "band",
    "check_priority",
    "check_tenant",
    "parse_caps",
    "parse_weights",
    "valid_tenant",
]

#: priority levels, highest first; a worker admits a level only when no higher one has work
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BAND = {p: i for i, p in enumerate(PRIORITIES)}


def band(priority: str) -> int:
    """0 for the highest priority, 1 for the next, ..."""
    return _BAND[priority]


def check_priority(priority: object) -> str:
    """``priority`` if it is one of `PRIORITIES`, else ValidationError."""
    if not isinstance(priority, str) or priority not in _BAND:
        raise ValidationError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    return priority


def valid_tenant(tenant: str) -> bool:
    return bool(_NAME.fullmatch(tenant))


def check_tenant(tenant: object) -> str:
    """``tenant`` if it is 1 to 64 of A-Z a-z 0-9 _ . -, else ValidationError."""
    if not isinstance(tenant, str) or not _NAME.fullmatch(tenant):
        raise ValidationError(
            f"tenant must be 1 to 64 letters, digits, '_', '.' or '-', not {tenant!r}"
        )
    return tenant


def _pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not _NAME.fullmatch(name):
            raise ValidationError(f"{what}: {part.strip()!r} is not TENANT=VALUE")
        if name in out:
            raise ValidationError(f"{what}: tenant {name!r} is listed twice")
        out[name] = value
    return out


#: the range of a tenant's weight: shares are ratios of weights, and virtual times grow by
#: 1/weight per admission (a weight of 1e-308 made them infinite and the worker exit)
WEIGHT_MIN, WEIGHT_MAX = 1e-6, 1e6


def parse_weights(text: str) -> dict[str, float]:
    """``"teamA=3,teamB=1"`` -> {tenant: weight}; weights are numbers from `WEIGHT_MIN` to
    `WEIGHT_MAX` (unlisted: 1)."""
    out: dict[str, float] = {}
    for name, value in _pairs(text, "tenant_weights").items():
        try:
            w = float(value)
        except ValueError:
            w = 0.0
        if not WEIGHT_MIN <= w <= WEIGHT_MAX:
            raise ValidationError(
                f"tenant_weights: the weight of {name!r} must be a number from {WEIGHT_MIN:g} "
                f"to {WEIGHT_MAX:g}, not {value!r}"
            )
        out[name] = w
    return out


def parse_caps(text: str) -> dict[str, int]:
    """``"teamA=16"`` -> {tenant: most requests in one worker's engine} (unlisted: no cap)."""
    out: dict[str, int] = {}
    for name, value in _pairs(text, "tenant_caps").items():
        if not value.isdigit() or int(value) < 1:
            raise ValidationError(f"tenant_caps: the cap of {name!r} must be an integer >= 1")
        out[name] = int(value)
    return out


@dataclass(frozen=True, slots=True)
class LaneInfo:
    """One lane index value: the burst's priority and tenant, and whether its producer has sent
    every entry (a sealed lane that is empty is deleted by a worker: lua/close_lane.lua)."""

    priority: str = DEFAULT_PRIORITY
    tenant: str = DEFAULT_TENANT
    sealed: bool = False

    def encode(self) -> str:
        return f"{self.priority} {self.tenant} {int(self.sealed)}"

    @classmethod
    def decode(cls, raw: bytes | str) -> LaneInfo | None:
        """The value as written by `encode`; None for anything else (never trusted further)."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        parts = text.split(" ")
        if len(parts) != 3 or parts[0] not in _BAND or not _NAME.fullmatch(parts[1]):
            return None
        return cls(parts[0], parts[1], parts[2] == "1")
