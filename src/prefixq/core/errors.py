"""The one exception tree of prefixq.

::

    PrefixqError
    ├── ConfigError            bad or inconsistent settings
    ├── ValidationError        a request refused before it is enqueued
    │   └── BurstIdTaken       a burst of that id exists already
    ├── WireError              an entry that cannot be decoded safely
    │   └── LimitExceeded      a size or depth limit was hit while decoding
    ├── RedisUnavailable       Redis did not answer within the retry budget (or erred)
    │   ├── RedisOutOfMemory   Redis refused a write: used memory is at maxmemory
    │   ├── ReplicasBehind     fewer replicas than min_replicas_acked confirmed writes (WAIT)
    │   └── WritesLost         a fence found the writes it guards gone (a failover came between)
    ├── BurstNotFound          no burst with that id
    │   └── BurstRecordLost    the burst's record is incomplete (expired or evicted)
    ├── BurstTimeout           waiting for a burst ran past its timeout
    ├── BurstFailed            a burst finished with too many failed requests
    ├── EngineError            the engine refused or failed one request
    │   ├── EngineRefused      the engine refused the request as invalid (too long, bad token id)
    │   ├── EngineAborted      the request was aborted inside the engine (`Engine.abort`)
    │   └── EngineDead         the engine process is gone; in-flight work goes back to pending
    └── SetupError             a prerequisite is missing (redis-server, the model package, ...)
"""

from __future__ import annotations


class PrefixqError(Exception):
    """Root of every error prefixq raises on purpose."""


class ConfigError(PrefixqError):
    """Raised when settings are missing, malformed or contradict what Redis holds."""


class ValidationError(PrefixqError):
    """Raised when a request is refused before it is enqueued (the message says which and why)."""


class BurstIdTaken(ValidationError):
    """Raised when a burst is submitted under an id that a burst already has."""


class WireError(PrefixqError):
    """Raised when an entry cannot be decoded: bad codec tag, corrupt data, wrong shape."""


class LimitExceeded(WireError):
    """Raised when decoding would exceed a documented size, length or depth limit."""


class RedisUnavailable(PrefixqError):
    """Raised when Redis cannot be reached within the retry budget, or answers with an error."""


class RedisOutOfMemory(RedisUnavailable):
    """Raised when Redis refuses a write because its used memory reached ``maxmemory`` (OOM)."""


class ReplicasBehind(RedisUnavailable):
    """Raised when fewer replicas than ``min_replicas_acked`` confirmed writes within
    ``min_replicas_acked_timeout_ms`` (WAIT): a failover now could lose them."""


class WritesLost(RedisUnavailable):
    """Raised when a fence finds writes it was to confirm missing on the master that serves their
    slot now (a failover between the write and the fence lost them): write them again."""


class BurstNotFound(PrefixqError):
    """Raised when a burst id is unknown (never submitted, or its record expired or was evicted)."""


class BurstRecordLost(BurstNotFound):
    """Raised when a burst's record is present but incomplete (no total): it expired or was
    evicted and was partly written again, so the burst can never read as finished."""


class BurstTimeout(PrefixqError):
    """Raised when waiting for a burst runs past its timeout."""


class BurstFailed(PrefixqError):
    """Raised when a burst finishes with more failed requests than allowed."""


class EngineError(PrefixqError):
    """Raised when the engine refuses or fails a single request."""


class EngineRefused(EngineError):
    """Raised when the engine refuses a request as invalid (prompt over max_model_len, token id
    outside the vocabulary, sampling values it does not accept)."""


class EngineAborted(EngineError):
    """Raised by `Engine.generate` when the request was aborted (`Engine.abort`) before it
    finished."""


class EngineDead(EngineError):
    """Raised when the engine process has died; in-flight requests must be retried elsewhere."""


class SetupError(PrefixqError):
    """Raised when a prerequisite is missing; the message says how to fix it."""
