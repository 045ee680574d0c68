"""prefixq: durable, prefix-affine, queue-based batch inference for vLLM over Redis streams."""

from prefixq.errors import (
    BurstFailed,
    BurstNotFound,
    BurstTimeout,
    ConfigError,
    EngineDead,
    EngineError,
    LimitExceeded,
    PrefixqError,
    RedisUnavailable,
    SetupError,
    ValidationError,
    WireError,
)
from prefixq.producer.producer import Producer
from prefixq.records import Request, Result, Timings
from prefixq.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "BurstFailed",
    "BurstNotFound",
    "BurstTimeout",
    "ConfigError",
    "EngineDead",
    "EngineError",
    "LimitExceeded",
    "PrefixqError",
    "Producer",
    "RedisUnavailable",
    "Request",
    "Result",
    "Settings",
    "SetupError",
    "Timings",
    "ValidationError",
    "WireError",
    "__version__",
]
