"""One frozen `Settings` object, read once at the edge (env vars, then CLI flags) and passed down.

Every field has a ``PREFIXQ_<FIELD>`` environment variable (``REDIS_URL`` for ``redis_url``) and a
CLI flag of the same name. Nothing else in the package reads the environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from prefixq.core.embeddings import TASKS
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.sharing import check_priority, check_tenant, parse_caps, parse_weights
from prefixq.core.webhooks import WebhookConfig

log = logging.getLogger(__name__)

CODECS = ("zlib", "zstd", "none")
PLACEMENTS = ("affinity", "hash", "random", "round-robin")
#: enqueue orders (prefixq.client.order)
ORDERS = ("input", "leaders-first", "grouped", "depth-first", "decode-first")
#: the enqueue order of a burst that names none (client/order.py says why)
DEFAULT_ORDER = "decode-first"
#: PREFIXQ_* variables that are not settings (the dev script's)
_NOT_SETTINGS = frozenset({"PREFIXQ_VENV", "PREFIXQ_LOG_LEVEL", "PREFIXQ_LOG_FORMAT"})
_WARNED: set[str] = set()
#: codec levels allowed besides -1 (the codec's default for prefixq); codec none has none
_CODEC_LEVELS = {"zlib": (0, 9), "zstd": (1, 22)}
#: a namespace: every key starts with ``<namespace>:``, and ':' never occurs inside one, so the
#: ACL pattern ``~<namespace>:*`` covers exactly one namespace (docs/delivery.md)
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


#: the most any whole-number setting may be (`Settings._check_bounds`), and a number of seconds
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


@dataclass(frozen=True, slots=True)
class Settings:
    """Configuration shared by producers, workers and tools; every field documented in README."""

    # where and under which names
    #: Redis URL; rediss:// for TLS, unix:///path for a socket, user:password@ for an ACL user,
    #: ?ssl_ca_certs=... options
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: prefix of every key (1-64 of A-Z a-z 0-9 _ . -); each deployment sharing a Redis has its own
    namespace: str = "prefixq"
    #: accept a Redis whose maxmemory-policy evicts keys (it may drop queued work; warns at checks)
    allow_eviction: bool = False
    #: where the embedded model is prepared; empty = $XDG_CACHE_HOME/prefixq or ~/.cache/prefixq
    cache_dir: str = ""
    #: number of shards (one per GPU); 0 = read it from Redis, where the first deployment wrote it
    shards: int = 0
    #: the plain Redis (not a cluster: RQ cannot use one) that holds RQ's own queues for
    #: prefixq's RQ jobs and completion callbacks; empty = redis_url (docs/rq.md)
    rq_redis_url: str = ""
    #: with replicas (Redis Cluster, or one Redis with replicas): the producer confirms a burst's
    #: entries and record, the worker a group's results before acking, with WAIT on this many
    #: replicas, so a failover loses nothing acknowledged (docs/delivery.md); 0 = off
    min_replicas_acked: int = 0
    #: how long one such WAIT may take, ms; fewer replicas by then: submit fails, a worker retries
    min_replicas_acked_timeout_ms: int = 2000

    # wire format and limits (docs/architecture.md, decision 3)
    #: compression of entries and stored prefixes: zlib (level 1), zstd (level 3), none
    codec: str = "zlib"
    #: codec level; -1 = the codec's default for prefixq (zlib 1, zstd 3)
    codec_level: int = -1
    #: largest encoded entry accepted from the stream, bytes
    max_entry_bytes: int = 4 << 20
    #: largest decoded (decompressed msgpack) entry, bytes
    max_decoded_bytes: int = 32 << 20
    #: largest prompt (plus prefix and messages), characters
    max_prompt_chars: int = 4_000_000
    #: most messages in one chat request
    max_messages: int = 1024
    #: prefixes at least this long are stored once, content-addressed, and referenced by hash
    prefix_store_min_chars: int = 512
    #: seconds a stored prefix lives (refreshed on every submit that uses it)
    prefix_ttl_s: int = 86_400
    #: prefixes a worker keeps decoded in memory
    prefix_cache_entries: int = 4096

    # affinity and placement (docs/architecture.md, decision 4)
    #: default placement: affinity, hash (first block), random, round-robin
    placement: str = "affinity"
    #: tokens per KV block; must equal the engine's block size
    block_size: int = 16
    #: characters per block when the producer has no tokenizer
    block_chars: int = 64
    #: one map entry every this many blocks (plus the last full block of each prefix)
    checkpoint_every: int = 8
    #: bound on the shared prefix map (entries); the least recently used beyond it are evicted,
    #: approximately (at least the last half are kept: docs/architecture.md)
    map_max_entries: int = 100_000
    #: a map match shorter than this share of the prompt (a common instruction) starts a new group
    affinity_min_match: float = 0.5
    #: move a prefix group when its shard's backlog exceeds the least loaded by this many tokens
    guard_margin_tokens: int = 262_144
    #: and by this factor (both must hold)
    guard_factor: float = 2.0
    #: order a burst is enqueued in: decode-first (grouped, with the groups that ask for 4x the
    #: burst's 10th-percentile answer first), grouped (each shared prefix's requests together),
    #: input, leaders-first, depth-first (prefix tree walked depth first): client/order.py
    enqueue_order: str = DEFAULT_ORDER
    #: a burst over documents another burst's pass holds joins that pass where it is and wraps
    #: around (grouped and decode-first orders; client/shared_pass.py)
    shared_pass: bool = True
    #: workers: the share of the engine's KV cache, filled by the prefixes of the requests it
    #: finished last (the completion front), among which a joining burst starts
    pass_window: float = 0.1
    #: workers: the share of the engine's KV cache the distinct prefixes of the requests inside
    #: it may take (0: no limit); the rest keeps the prefixes finished last for joining bursts,
    #: and the pass's window grows to 0.8 of it (worker/kv_budget.py)
    kv_inflight_share: float = 0.0
    #: producer-side tokenizer (HF folder) for token block hashes; empty = character blocks
    tokenizer: str = ""

    # sharing the shards between bursts (prefixq.core.sharing, docs/architecture.md)
    #: priority of the bursts this process submits: high, normal, low (workers admit higher first)
    priority: str = "normal"
    #: tenant of the bursts this process submits (1-64 of A-Z a-z 0-9 _ . -)
    tenant: str = "default"
    #: workers: each tenant's share of a shard within a priority, TENANT=WEIGHT,... (weights
    #: from 1e-6 to 1e6; unlisted: 1)
    tenant_weights: str = ""
    #: workers: at most N requests of a tenant in one worker's engine, TENANT=N,... (unlisted: none)
    tenant_caps: str = ""

    # consumer (docs/architecture.md, decisions 5 and 6)
    #: workers: what the engine serves: generate (text) or embed (vLLM's pooling runner; the
    #: shard takes only embeddings bursts, and only it does: docs/openai.md, "/v1/embeddings")
    task: str = "generate"
    #: requests kept inside the engine; 0 = twice the engine's max_num_seqs
    max_inflight: int = 0
    #: entries read per XREADGROUP
    read_count: int = 128
    #: workers: a stored prefix's requests enter the engine together (worker/groups.py; measured)
    group_admission: bool = False
    #: workers: between bursts of an equal fair-share turn, the one whose prefix is resident first
    resident_first: bool = False
    #: workers: vLLM priorities follow the bursts' fair shares, so bursts interleave in the engine
    engine_fair_order: bool = True
    #: deliveries before an entry goes to the dead-letter stream
    max_attempts: int = 3
    #: an entry pending this long on another consumer is reclaimed
    claim_idle_s: float = 60.0
    #: seconds between worker heartbeats (health key, in-flight lease renewal)
    heartbeat_s: float = 2.0
    #: a worker whose heartbeat is older than this is dead to `check` and `inspect`
    heartbeat_ttl_s: float = 15.0
    #: SIGTERM: seconds to finish in-flight requests before exiting
    grace_s: float = 60.0
    #: a shard without a live worker this long is orphaned: live workers move its queue to live
    #: shards, whole prefix groups at a time (worker/handover.py); 0 = never (work waits for a
    #: worker of its own shard)
    orphan_after_s: float = 45.0
    #: a worker started with --join (or --shard K) holds its shard this long while its engine
    #: starts, renewing the hold every quarter of it until its first heartbeat: one killed
    #: meanwhile (an OOM kill while the model loads) leaves the shard to the next joiner after
    #: at most this long (store/deployment.py)
    join_hold_s: float = 60.0
    #: an idle worker takes whole prefix groups from the tail of the most backlogged live shard
    #: when that one's outstanding prompt tokens exceed its own by this many (worker/fleet.py);
    #: 0 = never
    steal_min_tokens: int = 4096
    #: seconds results and burst records live after the burst's last write
    result_ttl_s: int = 7 * 86_400
    #: results are written and acked in groups of up to this many
    write_batch: int = 64
    #: freeze the heap after warm-up, and what admitted requests hold (docs/engine.md)
    gc_freeze: bool = True
    #: workers serve Prometheus metrics on this port (docs/operations.md); 0 = off
    metrics_port: int = 0
    #: seconds between a worker's samples of the shard's rolling history, drawn by the dashboard
    #: (docs/dashboard.md); 0 = off
    history_every_s: float = 5.0

    # OpenAI Batch API server (prefixq serve; docs/openai.md)
    #: bearer API keys, comma-separated, each KEY or KEY=NAMESPACE; @PATH reads them from a file
    #: (one a line); empty = no keys, and the server listens on loopback only
    api_keys: str = field(default="", repr=False)  # secrets stay out of logs and tracebacks
    #: where uploaded and output files are kept; empty = <cache_dir>/files
    files_dir: str = ""
    #: largest uploaded file, bytes
    max_file_bytes: int = 200 << 20
    #: most lines in an uploaded file (blank lines count: the limit is checked as it streams in)
    max_file_lines: int = 50_000
    #: the dashboard (prefixq serve, prefixq dashboard) only shows: cancel and requeue are hidden
    #: on the page and refused by its /api/ (docs/dashboard.md)
    dashboard_read_only: bool = False
    #: tests only: a file holding seconds that prefixq serve adds to its clock when it decides
    #: whether a file has expired (read at each decision); empty = the real clock
    clock_shift_file: str = ""

    # webhooks (prefixq serve and workers; docs/operations.md, "Receiving webhooks")
    #: endpoints per namespace: JSON, or @PATH of a JSON file (format in docs/operations.md);
    #: empty = no batch webhooks (bursts' on_complete_url deliveries wait for a secret)
    webhooks: str = field(default="", repr=False)  # holds signing secrets
    #: seconds before the first retry of a failed delivery; doubles each attempt (with jitter)
    webhook_retry_base_s: float = 5.0
    #: longest wait between two attempts, seconds
    webhook_retry_max_s: float = 3600.0
    #: a delivery is retried until this long after its event, seconds (72 h, as OpenAI)
    webhook_retry_window_s: float = 259_200.0
    #: seconds one attempt may take (connect, send, answer)
    webhook_timeout_s: float = 10.0
    #: attempts in flight at once, per serving process
    webhook_concurrency: int = 8

    def __post_init__(self) -> None:
        self._check_types()
        if self.codec not in CODECS:
            raise ConfigError(f"codec must be one of {', '.join(CODECS)}, not {self.codec!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"placement must be one of {', '.join(PLACEMENTS)}, not {self.placement!r}"
            )
        if self.enqueue_order not in ORDERS:
            raise ConfigError(
                f"enqueue_order must be one of {', '.join(ORDERS)}, not {self.enqueue_order!r}"
            )
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.shards < 0:
            raise ConfigError(f"shards must be >= 0, not {self.shards}")
        try:  # the same checks producers and workers make (prefixq.core.sharing)
            check_priority(self.priority)
            check_tenant(self.tenant)
            parse_weights(self.tenant_weights)
            parse_caps(self.tenant_caps)
        except ValidationError as e:
            raise ConfigError(str(e)) from None
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0 (off) to 65535, not {self.metrics_port}")
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(
                f"namespace {self.namespace!r} is not allowed: use 1 to 64 letters, digits, '_', "
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
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        self._check_ranges()

    def _check_types(self) -> None:
        """Each field of its declared type (keyword values from Python or an RQ job's JSON are
        not parsed like environment variables); an int is taken for a float."""
        hints = get_type_hints(type(self))
        for f in fields(self):
            kind, value = hints[f.name], getattr(self, f.name)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                continue
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                shown = "***" if f.name in ("api_keys", "webhooks") else repr(value)
                article = "an" if kind is int else "a"
                raise ConfigError(f"{f.name} must be {article} {kind.__name__}, not {shown}")

    def _check_ranges(self) -> None:
        """Numbers a deployment can run with: what would fail later (mid-submit, in Redis) or
        stall a worker silently is refused here."""
        for name in (
            "max_messages",
            "prefix_ttl_s",
            "result_ttl_s",
            "map_max_entries",
            "min_replicas_acked_timeout_ms",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        for name in (
            "max_inflight",
            "min_replicas_acked",
            "prefix_store_min_chars",
            "prefix_cache_entries",
            "guard_margin_tokens",
            "steal_min_tokens",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}")
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
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, not {v}")
        for name in ("grace_s", "history_every_s", "orphan_after_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a number >= 0, not {v}")
        self._check_bounds()
        if not 0 < self.pass_window <= 1:
            raise ConfigError(f"pass_window must be a share in (0, 1], not {self.pass_window}")
        if not 0 <= self.kv_inflight_share < 1:
            share = self.kv_inflight_share
            raise ConfigError(f"kv_inflight_share must be a share in [0, 1), not {share}")
        if not 0 <= self.affinity_min_match <= 1:
            raise ConfigError(
                f"affinity_min_match must be a share in [0, 1], not {self.affinity_min_match}"
            )
        if not self.webhooks.lstrip().startswith("@"):  # a file is read where it is used
            WebhookConfig.parse(self.webhooks)  # ConfigError saying what is wrong
        levels = _CODEC_LEVELS.get(self.codec)  # codec none has no level
        if levels and self.codec_level != -1 and not levels[0] <= self.codec_level <= levels[1]:
            raise ConfigError(
                f"codec_level for {self.codec} must be -1 (its default) or "
                f"{levels[0]}..{levels[1]}, not {self.codec_level}"
            )

    def _check_bounds(self) -> None:
        """Upper bounds: counts, TTLs and timeouts go to Redis (COUNT, EXPIRE, WAIT), which
        refuses what does not fit its integers, or a value past any use stalls a worker (a
        heartbeat that never expires, a read of 10^23 entries); and a heartbeat must come
        before its TTL ends, or a live worker reads as dead."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            top = _MAX.get(f.name, _MAX_SECONDS if f.name.endswith("_s") else _MAX_INT)
            if v > top:
                raise ConfigError(f"{f.name} must be at most {top:,}, not {v:,}")
        if self.heartbeat_s >= self.heartbeat_ttl_s:
            raise ConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be below heartbeat_ttl_s "
                f"({self.heartbeat_ttl_s}): a live worker's heartbeat would expire between beats"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``REDIS_URL`` and ``PREFIXQ_*``; keyword overrides (CLI flags) win."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        known: list[str] = []
        for f in fields(cls):
            var = "REDIS_URL" if f.name == "redis_url" else f"PREFIXQ_{f.name.upper()}"
            known.append(var)
            if var in env:
                values[f.name] = _parse(var, env[var], hints[f.name])
        for var in sorted(v for v in env if v.startswith("PREFIXQ_")):
            if var not in known and var not in _NOT_SETTINGS and var not in _WARNED:
                _WARNED.add(var)  # once per process: a typo would be ignored silently
                names = {k.removeprefix("PREFIXQ_"): k for k in known}
                near = [names[n] for n in difflib.get_close_matches(var[8:], names, n=1)]
                log.warning(
                    "%s is not a prefixq setting and is ignored%s",
                    var,
                    f" (did you mean {near[0]}?)" if near else "",
                )
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
        return cls(**values)

    @property
    def rq_url(self) -> str:
        """The Redis that holds RQ's queues: `rq_redis_url`, else `redis_url`."""
        return self.rq_redis_url or self.redis_url

    @property
    def keys(self) -> Keys:
        """The Redis key names of this namespace."""
        return Keys(self.namespace)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def env_name(self, field: str) -> str:
        """The environment variable that sets ``field``."""
        return "REDIS_URL" if field == "redis_url" else f"PREFIXQ_{field.upper()}"


def _parse(var: str, raw: str, kind: Any) -> Any:
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
