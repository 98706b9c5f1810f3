"""Chat prompts: the engine's methods ``link_chat``, ``chat_context`` and ``chat_segments``, defined here (``PIC``
inherits them) so that the engine's file keeps to its commands.

The cut itself is ``pic.link.chat.split_chat``: the model's chat template rendered with a placeholder where the
documents go. Around it, the engine chooses two things. The template's BOS is dropped when pic writes its own
(``PICConfig.add_bos``), else the prompt would start with two. And a chat's documents are compiled *in context*,
after the template up to where they go rendered with the system messages alone: every chat with the same system
prompt then shares their chunks, whatever its user asks, and ``APE`` (which links only chunks compiled in
context) can link them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pic.config import PICConfig
from pic.engine.caller.linked import Linked
from pic.ids import cache_id_list
from pic.link import policies
from pic.link.chat import DOCUMENTS_MARKER, split_chat
from pic.link.order import Order
from pic.namespaces import Access, Namespace
from pic.text import refuse_text_for_list


class ChatMethods:
    """The chat methods of ``PIC``, over its ``tokenizer``, ``config``, ``bos_token_id``, ``compile`` and ``link``."""

    tokenizer: object
    config: PICConfig
    bos_token_id: int | None

    def link_chat(
        self,
        cache_ids: Sequence[str],
        messages: Sequence[dict],
        *,
        documents: Sequence[str] = (),
        policy: str | policies.Policy | None = None,
        relevance: Sequence[float] | None = None,
        order: str | Order | None = None,
        add_generation_prompt: bool = True,
        namespace: str | Namespace | Access | None = None,
    ) -> Linked:
        """``link`` with the chunks where a plain chat prompt puts the documents: the tokenizer's chat template
        rendered around them (at the start of the first user message, or where a message says ``{documents}``);
        the text before is the prefix, the text after the query. A BOS the template writes is dropped when pic
        adds its own (``PICConfig.add_bos``). See ``pic.link.chat``.

        Args:
            cache_ids: chunks compiled before, linked first.
            documents: texts compiled on the way *in context* (after ``chat_context(messages)``: the chat's
                system turn, so their KV is what it is there rather than at a sequence start) and linked
                after ``cache_ids``; compiled once, cached like any chunk.
            relevance: one score per chunk (``cache_ids`` then ``documents``), see ``link``.
            order: the chunks' order (``cache_ids`` then ``documents`` is the given one), see ``link``.
            namespace: whose chunks it links and where ``documents`` are compiled, see ``link`` and ``compile``.

        Raises:
            InvalidInputError: malformed messages, no place for the documents, several markers, a
                tokenizer without a chat template, a string for ``cache_ids`` or ``documents`` (pass a list:
                ``["text"]`` for one); and everything ``link`` and ``compile`` raise.
        """
        ids = cache_id_list(cache_ids)
        refuse_text_for_list(documents, "documents", "documents")  # iterated, a string is a document per character
        prefix, query = self.chat_segments(messages, add_generation_prompt=add_generation_prompt)
        if documents:  # interactive: this request waits for them, so their prefills go before bulk compiles
            context = self.chat_context(messages)
            ids += self.compile(
                list(documents), policy=policy, context=context, progress=False, interactive=True, namespace=namespace
            )
        return self.link(
            ids, query, prefix=prefix, policy=policy, relevance=relevance, order=order, namespace=namespace
        )

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
