"""The batched engine: one thread at a time owns its state; requests run many per forward."""

from pic.engine.engine import Engine
from pic.engine.linker import Linker
from pic.engine.request import Request, RequestOutput
from pic.engine.scheduler import ScheduledBatch, Scheduler

__all__ = ["Engine", "Linker", "Request", "RequestOutput", "ScheduledBatch", "Scheduler"]
