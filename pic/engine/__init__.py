"""The batched engine, in two sides joined by the command channel (``pic.engine.commands``).

The caller's side (``pic.engine.caller``): ``PIC`` (``Engine``), ``Linked``, compile and chat methods, the stepper; it
runs in its callers' threads. The core's side (``pic.engine.core``): ``EngineCore``, the scheduler, the sequence
state machine, the KV manager, chunk sources and compile calls, on one thread that owns all state. The messages
between them: ``pic.engine.request`` (with ``Request`` and its ``Preparer``), ``pic.engine.generation``,
``pic.sampling``.
"""

from pic.engine.caller.compiling import CompileReport
from pic.engine.caller.engine import PIC, Engine
from pic.engine.caller.linked import Linked, generate_together
from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.request import Request, RequestOutput
from pic.sampling import SamplingParams

__all__ = [
    "PIC",
    "CompileReport",
    "Engine",
    "FinishReason",
    "Generation",
    "GenerationStats",
    "Linked",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "generate_together",
]
