"""The `Engine` protocol, the vLLM adapter, the engine-process reaper and the embedded model."""
