"""Where compiled chunks live."""

from pic.store.memory import MemoryStore

__all__ = ["MemoryStore"]
