"""The batched engine: one thread owns its state; requests from any thread run many per forward."""

from pic.engine.engine import PIC, Engine
from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.linked import Linked, generate_together
from pic.engine.request import CompileReport, Request, RequestOutput
from pic.engine.sampling import SamplingParams

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
