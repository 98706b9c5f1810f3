"""Compiling chunks: tokens and the prefill that produces their KV (content addresses: ``pic.ids``)."""

from pic.compile.compiler import WriteThrough, compile_chunks
from pic.compile.prefill import prefill_chunk
from pic.compile.tokens import TextOrTokens, encode, encode_documents, max_token_chars, tokenizer_adds_bos

__all__ = [
    "TextOrTokens",
    "WriteThrough",
    "compile_chunks",
    "encode",
    "encode_documents",
    "max_token_chars",
    "prefill_chunk",
    "tokenizer_adds_bos",
]
