"""The model runner over a Hugging Face model's own modules."""

from pic.model.inputs import LayerHook, SeqInput
from pic.model.runner import ModelRunner
from pic.model.spec import SUPPORTED_MODEL_TYPES, ModelSpec, inspect_model

__all__ = ["SUPPORTED_MODEL_TYPES", "LayerHook", "ModelRunner", "ModelSpec", "SeqInput", "inspect_model"]
