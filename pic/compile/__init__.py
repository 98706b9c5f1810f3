"""Compiling chunks: tokens, content addresses, and the prefill that produces their KV."""

from pic.compile.ids import chunk_id, model_fingerprint
from pic.compile.prefill import prefill_chunk
from pic.compile.tokens import TextOrTokens, encode

__all__ = ["TextOrTokens", "chunk_id", "encode", "model_fingerprint", "prefill_chunk"]
