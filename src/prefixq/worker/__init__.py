"""Consumer side of prefixq: the worker loop and the engines behind it."""

from prefixq.engine.protocol import Engine, EngineOutput, EngineRequest
from prefixq.worker.worker import Worker

__all__ = ["Engine", "EngineOutput", "EngineRequest", "Worker"]
