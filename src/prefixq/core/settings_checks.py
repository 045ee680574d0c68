"""The values each setting may take, checked once when a `Settings` is built (`check`): choices,
types, signs, ranges and upper bounds, each refused with a `ConfigError` that names the setting.

The checks read the settings as a mapping of field name to value (prefixq.core.settings calls
`check` from `Settings.__post_init__`), so this module does not import `Settings`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from prefixq.core.embeddings import TASKS
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.sharing import check_priority, check_tenant, parse_caps, parse_weights
from prefixq.core.webhooks import WebhookConfig

__all__ = ["CODECS", "DEFAULT_KV_HISTORY", "ORDERS", "PLACEMENTS", "check"]

CODECS = ("zlib", "zstd", "none")
PLACEMENTS = ("affinity", "hash", "random", "round-robin")
#: the tokens the workers' KV budget keeps for the prefixes finished last by default: it met
#: issue 36's targets on a GPU and lost on no workload measured (docs/BENCHMARKS.md, 2026-12-06)
DEFAULT_KV_HISTORY = 32768
#: enqueue orders (prefixq.client.order)
ORDERS = ("input", "leaders-first", "grouped", "depth-first", "decode-first")
#: codec levels allowed besides -1 (the codec's default for prefixq); codec none has none
_CODEC_LEVELS = {"zlib": (0, 9), "zstd": (1, 22)}
#: a namespace: every key starts with ``<namespace>:``, and ':' never occurs inside one, so the
#: ACL pattern ``~<namespace>:*`` covers exactly one namespace (docs/delivery.md)
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: settings whose values are secrets: never shown in an error
_SECRETS = ("api_keys", "webhooks")


#: the most any whole-number setting may be (`_check_bounds`), and a number of seconds
_MAX_INT = 2**53
_MAX_SECONDS = 10 * 365 * 86_400
#: ... and these: what Redis takes (COUNT, EXPIRE, WAIT) and what a deployment can use
_MAX: dict[str, int] = {
    "shards": 4096,
    "read_count": 100_000,
    "write_batch": 100_000,
    "max_inflight": 1_000_000,
    "max_attempts": 1_000_000,
    "min_replicas_acked": 1_000,
    "min_replicas_acked_timeout_ms": 3_600_000,
    "map_max_entries": 1 << 32,
    "prefix_cache_entries": 1 << 32,
    "webhook_concurrency": 10_000,
    "metrics_port": 65_535,
}


def check(values: Mapping[str, Any], kinds: Mapping[str, Any]) -> dict[str, float]:
    """Refuse settings no deployment can run with (`ConfigError`, the first problem found).

    ``values`` maps each field of a `Settings` to its value, in field order; ``kinds`` each field
    to its declared type. Returns the float fields that were given an int, as floats: the caller
    sets them (`Settings` stays frozen to everyone else).
    """
    floats = _check_types(values, kinds)
    s = {**values, **floats}
    if s["codec"] not in CODECS:
        raise ConfigError(f"codec must be one of {', '.join(CODECS)}, not {s['codec']!r}")
    if s["placement"] not in PLACEMENTS:
        raise ConfigError(
            f"placement must be one of {', '.join(PLACEMENTS)}, not {s['placement']!r}"
        )
    if s["enqueue_order"] not in ORDERS:
        raise ConfigError(
            f"enqueue_order must be one of {', '.join(ORDERS)}, not {s['enqueue_order']!r}"
        )
    if s["task"] not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, not {s['task']!r}")
    if s["shards"] < 0:
        raise ConfigError(f"shards must be >= 0, not {s['shards']}")
    try:  # the same checks producers and workers make (prefixq.core.sharing)
        check_priority(s["priority"])
        check_tenant(s["tenant"])
        parse_weights(s["tenant_weights"])
        parse_caps(s["tenant_caps"])
    except ValidationError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= s["metrics_port"] <= 65535:
        raise ConfigError(f"metrics_port must be 0 (off) to 65535, not {s['metrics_port']}")
    if not _NAMESPACE.fullmatch(s["namespace"]):
        raise ConfigError(
            f"namespace {s['namespace']!r} is not allowed: use 1 to 64 letters, digits, '_', "
            "'.' or '-' (no ':', so that the ACL key pattern '<namespace>:*' of one "
            "namespace matches no key of another)"
        )
    for name in (
        "block_size",
        "block_chars",
        "checkpoint_every",
        "read_count",
        "max_attempts",
        "write_batch",
        "max_entry_bytes",
        "max_decoded_bytes",
        "max_prompt_chars",
        "max_file_bytes",
        "max_file_lines",
        "webhook_concurrency",
    ):
        if s[name] <= 0:
            raise ConfigError(f"{name} must be positive, not {s[name]}")
    _check_ranges(s)
    return floats


def _check_types(values: Mapping[str, Any], kinds: Mapping[str, Any]) -> dict[str, float]:
    """Each field of its declared type (keyword values from Python or an RQ job's JSON are
    not parsed like environment variables); an int is taken for a float (returned as one)."""
    floats: dict[str, float] = {}
    for name, value in values.items():
        kind = kinds[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            floats[name] = float(value)
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            shown = "***" if name in _SECRETS else repr(value)
            article = "an" if kind is int else "a"
            raise ConfigError(f"{name} must be {article} {kind.__name__}, not {shown}")
    return floats


def _check_ranges(s: Mapping[str, Any]) -> None:
    """Numbers a deployment can run with: what would fail later (mid-submit, in Redis) or
    stall a worker silently is refused here."""
    for name in (
        "max_messages",
        "prefix_ttl_s",
        "result_ttl_s",
        "map_max_entries",
        "min_replicas_acked_timeout_ms",
    ):
        if s[name] <= 0:
            raise ConfigError(f"{name} must be positive, not {s[name]}")
    for name in (
        "max_inflight",
        "min_replicas_acked",
        "prefix_store_min_chars",
        "prefix_cache_entries",
        "guard_margin_tokens",
        "steal_min_tokens",
    ):
        if s[name] < 0:
            raise ConfigError(f"{name} must be >= 0, not {s[name]}")
    for name in (
        "claim_idle_s",
        "heartbeat_s",
        "heartbeat_ttl_s",
        "join_hold_s",
        "guard_factor",
        "webhook_retry_base_s",
        "webhook_retry_max_s",
        "webhook_retry_window_s",
        "webhook_timeout_s",
    ):
        v = s[name]
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{name} must be a positive number, not {v}")
    for name in ("grace_s", "history_every_s", "orphan_after_s"):
        v = s[name]
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{name} must be a number >= 0, not {v}")
    _check_bounds(s)
    if not 0 < s["pass_window"] <= 1:
        raise ConfigError(f"pass_window must be a share in (0, 1], not {s['pass_window']}")
    if not 0 <= s["kv_inflight_share"] < 1:
        share = s["kv_inflight_share"]
        raise ConfigError(f"kv_inflight_share must be a share in [0, 1), not {share}")
    if s["kv_history_tokens"] < 0:
        raise ConfigError(f"kv_history_tokens must be >= 0, not {s['kv_history_tokens']}")
    if s["kv_inflight_share"] and s["kv_history_tokens"] not in (0, DEFAULT_KV_HISTORY):
        raise ConfigError(
            "set kv_inflight_share or kv_history_tokens, not both "
            "(a share set replaces the default history)"
        )
    if not 0 <= s["affinity_min_match"] <= 1:
        raise ConfigError(
            f"affinity_min_match must be a share in [0, 1], not {s['affinity_min_match']}"
        )
    if not s["webhooks"].lstrip().startswith("@"):  # a file is read where it is used
        WebhookConfig.parse(s["webhooks"])  # ConfigError saying what is wrong
    codec, level = s["codec"], s["codec_level"]
    levels = _CODEC_LEVELS.get(codec)  # codec none has no level
    if levels and level != -1 and not levels[0] <= level <= levels[1]:
        raise ConfigError(
            f"codec_level for {codec} must be -1 (its default) or "
            f"{levels[0]}..{levels[1]}, not {level}"
        )


def _check_bounds(s: Mapping[str, Any]) -> None:
    """Upper bounds: counts, TTLs and timeouts go to Redis (COUNT, EXPIRE, WAIT), which
    refuses what does not fit its integers, or a value past any use stalls a worker (a
    heartbeat that never expires, a read of 10^23 entries); and a heartbeat must come
    before its TTL ends, or a live worker reads as dead."""
    for name, v in s.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        top = _MAX.get(name, _MAX_SECONDS if name.endswith("_s") else _MAX_INT)
        if v > top:
            raise ConfigError(f"{name} must be at most {top:,}, not {v:,}")
    if s["heartbeat_s"] >= s["heartbeat_ttl_s"]:
        raise ConfigError(
            f"heartbeat_s ({s['heartbeat_s']}) must be below heartbeat_ttl_s "
            f"({s['heartbeat_ttl_s']}): a live worker's heartbeat would expire between beats"
        )
