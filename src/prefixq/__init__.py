"""prefixq: durable, prefix-affine, queue-based batch inference for vLLM over Redis streams.

Each name below is imported on first use: ``import prefixq`` costs nothing, so that
``python -m prefixq worker`` handles SIGTERM before anything slow is imported (prefixq.cli).
"""

#: what `typing.TYPE_CHECKING` says, without importing typing (mypy reads any such name as True)
TYPE_CHECKING = False
if TYPE_CHECKING:
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

#: each public name and the module it is imported from, on first use
_WHERE = {
    "Burst": "prefixq.client.burst",
    "BurstFailed": "prefixq.core.errors",
    "BurstNotFound": "prefixq.core.errors",
    "BurstRecordLost": "prefixq.core.errors",
    "BurstTimeout": "prefixq.core.errors",
    "Choice": "prefixq.core.records",
    "ConfigError": "prefixq.core.errors",
    "EngineAborted": "prefixq.core.errors",
    "EngineDead": "prefixq.core.errors",
    "EngineError": "prefixq.core.errors",
    "EngineRefused": "prefixq.core.errors",
    "LimitExceeded": "prefixq.core.errors",
    "PrefixqError": "prefixq.core.errors",
    "Producer": "prefixq.client.producer",
    "RedisOutOfMemory": "prefixq.core.errors",
    "RedisUnavailable": "prefixq.core.errors",
    "Request": "prefixq.core.records",
    "Result": "prefixq.core.records",
    "Settings": "prefixq.core.settings",
    "SetupError": "prefixq.core.errors",
    "Timings": "prefixq.core.records",
    "TokenLogprob": "prefixq.core.records",
    "ValidationError": "prefixq.core.errors",
    "WireError": "prefixq.core.errors",
}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'prefixq' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE} - {"TYPE_CHECKING"})
