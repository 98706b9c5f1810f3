"""Compiling chunks: tokens, content addresses, and the prefill that produces their KV."""

from pic.compile.compiler import compile_chunks
from pic.compile.ids import cache_id_list, chunk_id, model_fingerprint
from pic.compile.prefill import prefill_chunk
from pic.compile.tokens import TextOrTokens, encode, encode_documents, tokenizer_adds_bos

__all__ = [
    "TextOrTokens",
    "cache_id_list",
    "chunk_id",
    "compile_chunks",
    "encode",
    "encode_documents",
    "model_fingerprint",
    "prefill_chunk",
    "tokenizer_adds_bos",
]
