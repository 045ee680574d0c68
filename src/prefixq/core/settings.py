"""One frozen `Settings` object, read once at the edge (env vars, then CLI flags) and passed down.

Every field has a ``PREFIXQ_<FIELD>`` environment variable (``REDIS_URL`` for ``redis_url``) and a
CLI flag of the same name. Nothing else in the package reads the environment.
What each field may hold is checked when one is built: prefixq.core.settings_checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from prefixq.core.errors import ConfigError
from prefixq.core.keys import Keys
from prefixq.core.settings_checks import CODECS, DEFAULT_KV_HISTORY, ORDERS, PLACEMENTS, check

__all__ = ["CODECS", "DEFAULT_KV_HISTORY", "DEFAULT_ORDER", "ORDERS", "PLACEMENTS", "Settings"]

log = logging.getLogger(__name__)

#: the enqueue order of a burst that names none (client/order.py says why)
DEFAULT_ORDER = "decode-first"
#: PREFIXQ_* variables that are not settings (the dev script's)
_NOT_SETTINGS = frozenset({"PREFIXQ_VENV", "PREFIXQ_LOG_LEVEL", "PREFIXQ_LOG_FORMAT"})
_WARNED: set[str] = set()


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
    #: workers: the pass's window follows what the engine runs too: the prefixes of the requests
    #: it most likely runs now, after those it finished last cut to what they leave of its
    #: cache (worker/shared_pass.py; on since an H100 measured it: docs/BENCHMARKS.md)
    pass_running: bool = True
    #: workers: the share of the engine's KV cache the distinct prefixes of the requests inside
    #: it may take (0: sized by kv_history_tokens; set, it replaces the default history); the
    #: rest keeps the prefixes finished last for joining bursts, and the pass's window grows to
    #: 0.8 of it (worker/kv_budget.py)
    kv_inflight_share: float = 0.0
    #: workers: the KV budget as the tokens it keeps for the prefixes finished last (the same
    #: history on any cache size; those inside take the rest, at least 70%; a request whose
    #: prefix no other shares waits only while a shared one is inside; 0 with kv_inflight_share
    #: 0: no budget)
    kv_history_tokens: int = DEFAULT_KV_HISTORY
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
    #: requests kept inside the engine; 0 = twice the engine's max_num_seqs (those waiting for
    #: the KV budget's room are outside it: up to four windows more, worker/kv_budget.py)
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
        """Refuse values no deployment can run with (prefixq.core.settings_checks: choices, types,
        ranges, bounds); a float field given an int holds it as a float."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in check(values, get_type_hints(type(self))).items():
            object.__setattr__(self, name, value)

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
