"""Consumer side of prefixq: the worker loop and the engines behind it."""

from prefixq.consumers.engine import Engine, EngineOutput, EngineRequest
from prefixq.consumers.worker import Worker

__all__ = ["Engine", "EngineOutput", "EngineRequest", "Worker"]
