"""prefixq: durable, prefix-affine, queue-based batch inference for vLLM over Redis streams."""

from prefixq.client.burst import Burst
from prefixq.client.producer import Producer
from prefixq.core.errors import (
    BurstFailed,
    BurstNotFound,
    BurstRecordLost,
    BurstTimeout,
    ConfigError,
    EngineAborted,
    EngineDead,
    EngineError,
    EngineRefused,
    LimitExceeded,
    PrefixqError,
    RedisOutOfMemory,
    RedisUnavailable,
    SetupError,
    ValidationError,
    WireError,
)
from prefixq.core.records import Choice, Request, Result, Timings, TokenLogprob
from prefixq.core.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "Burst",
    "BurstFailed",
    "BurstNotFound",
    "BurstRecordLost",
    "BurstTimeout",
    "Choice",
    "ConfigError",
    "EngineAborted",
    "EngineDead",
    "EngineError",
    "EngineRefused",
    "LimitExceeded",
    "PrefixqError",
    "Producer",
    "RedisOutOfMemory",
    "RedisUnavailable",
    "Request",
    "Result",
    "Settings",
    "SetupError",
    "Timings",
    "TokenLogprob",
    "ValidationError",
    "WireError",
    "__version__",
]
