"""The engine's core side: what runs on the one thread that owns the engine's state. Its callers reach it through
the command channel (``pic.engine.commands``) only."""

from pic.engine.core.core import EngineCore

__all__ = ["EngineCore"]
