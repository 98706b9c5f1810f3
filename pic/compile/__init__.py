"""Compiling chunks: tokens and the prefill that produces their KV (content addresses: ``pic.ids``)."""

from pic.compile.prefill import ChunkPrefill, lead_tokens, prefill_blocks
from pic.compile.tokens import (
    SharedTokenizer,
    TextOrTokens,
    encode,
    encode_documents,
    max_token_chars,
    tokenizer_adds_bos,
)

__all__ = [
    "ChunkPrefill",
    "SharedTokenizer",
    "TextOrTokens",
    "encode",
    "encode_documents",
    "lead_tokens",
    "max_token_chars",
    "prefill_blocks",
    "tokenizer_adds_bos",
]
