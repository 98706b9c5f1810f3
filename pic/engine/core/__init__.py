"""The engine's core side: what runs on the one thread that owns the engine's state (``EngineCore`` and its
thread, the scheduler and its admission, the sequence state machine and its queues, the batch, the KV manager,
chunk sources, compile calls, the loader, the decoder). Its callers reach it through the command channel
(``pic.engine.commands``) only."""

from pic.engine.core.core import EngineCore

__all__ = ["EngineCore"]
