"""The engine: `Engine`, `EngineConfig` (imported lazily so `q3tts.core` stays torch-free)."""


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    if name == "run_requests":
        from .batch import run_requests

        return run_requests
    raise AttributeError(name)
