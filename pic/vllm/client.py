"""Building requests for vLLM + ``PicConnector``: prompts by cache id, for ``LLM.generate`` or the OpenAI API.

A linked prompt is built from token ids, never by re-tokenizing the documents' text inside a longer string
(BPE merges across a boundary would change a chunk's tokens, LMCache #38/#194): ``prefix + chunk_1 + ... +
chunk_n + query``, with the ``cache_salt`` and ``kv_transfer_params`` the connector requires::

    prompt = link_prompt(chunks, query_ids, prefix_ids=prefix_ids)           # chunks: [(cache id, token ids)]
    llm.generate(prompt.tokens_prompt(), SamplingParams(max_tokens=64, extra_args=prompt.extra_args()))
    client.completions.create(model=..., prompt=prompt.prompt_token_ids, extra_body=prompt.openai_extra_body())

Under a ``suffix`` policy (the default) the documents go in relevance order unless ``order="given"``: the one
the query shares most rare tokens with (BM25 over token ids, or the caller's ``relevance`` scores) last, as
pic's own engine orders them under ``auto``; vLLM recomputes a suffix of the prompt, so the recomputed tokens
are those of the most relevant documents.

A tenant (``pic.vllm.tenants``) passes its salt, the ``cache_salt`` of its other requests, as ``tenant_salt``: the
link's ``cache_salt`` then carries it before the link's part, and the connector links that tenant's chunks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pic.errors import InvalidInputError, PicError
from pic.link.chat import split_chat
from pic.link.order import ChunkOrder, Order, chunk_order, parse_order, relevance_scores
from pic.text import refuse_text_for_list
from pic.vllm.params import DEFAULT_POLICY, PARAMS_KEY, link_salt, parse_policy


@dataclass(frozen=True)
class LinkPrompt:
    """A linked prompt and what vLLM must be told with it.

    Attributes:
        prompt_token_ids: ``prefix + chunks + query``.
        ids: the chunks' cache ids in prompt order (after ``order``).
        policy: the connector policy's name.
        order: the order the chunks were put in (``ChunkOrder``: the caller's chunk indices in prompt order).
        tenant_salt: the tenant's ``cache_salt`` (``None``: the default namespace); a secret, never in ``repr``.
    """

    prompt_token_ids: list[int]
    ids: tuple[str, ...]
    policy: str
    order: ChunkOrder
    tenant_salt: str | None = field(default=None, repr=False)

    @property
    def cache_salt(self) -> str:
        return link_salt(self.ids, self.policy, tenant_salt=self.tenant_salt)

    @property
    def kv_transfer_params(self) -> dict:
        return {PARAMS_KEY: {"ids": list(self.ids), "policy": self.policy, "order": self.order.order.value}}

    def tokens_prompt(self) -> dict:
        """For ``LLM.generate``: a ``TokensPrompt`` dict."""
        return {"prompt_token_ids": self.prompt_token_ids, "cache_salt": self.cache_salt}

    def extra_args(self) -> dict:
        """For ``SamplingParams(extra_args=...)``."""
        return {"kv_transfer_params": self.kv_transfer_params}

    def openai_extra_body(self) -> dict:
        """For the OpenAI client's ``completions.create(..., extra_body=...)`` against ``vllm serve``."""
        return {"cache_salt": self.cache_salt, "kv_transfer_params": self.kv_transfer_params}


def link_prompt(
    chunks: Sequence[tuple[str, Sequence[int]]],
    query_ids: Sequence[int],
    *,
    prefix_ids: Sequence[int] = (),
    policy: str = DEFAULT_POLICY,
    order: str | Order = Order.POLICY,
    relevance: Sequence[float] | None = None,
    tenant_salt: str | None = None,
) -> LinkPrompt:
    """The linked prompt of ``chunks`` (``(cache id, token ids)``, e.g. from ``compile_result``) and a query.

    ``order``: ``"relevance"`` (the least relevant chunk first, the most relevant last: by ``relevance``, one
    score per chunk, else BM25 over token ids; ``pic.link.order``, as pic's own engine orders), ``"given"`` (as
    passed), or ``"policy"`` (the default): relevance under a ``suffix`` policy (vLLM recomputes the last
    chunks: the most relevant), the given order under ``naive`` and ``full``, and under ``auto`` where its rule
    runs a plain prefill (a prompt too short to win: ``Auto.plan``), as pic's engine keeps it for them.

    ``tenant_salt``: the ``cache_salt`` of the tenant whose chunks ``chunks`` are (its compiles'); ``None`` or ``""``:
    the default namespace's.

    Raises:
        InvalidInputError: no chunks, an empty query, an unknown policy or order, bad relevance scores, a
            ``tenant_salt`` that is not a string.
    """
    if tenant_salt is not None and not isinstance(tenant_salt, str):
        raise InvalidInputError(f"tenant_salt is a {type(tenant_salt).__name__}; expected the tenant's cache_salt")
    suffix = parse_policy(policy)
    refuse_text_for_list(chunks, "chunks", "(cache id, token ids) pairs")
    if not chunks:
        raise InvalidInputError("link_prompt needs at least one chunk")
    if not query_ids:
        raise InvalidInputError("the query has no tokens; vLLM computes at least the prompt's last token")
    chunks = list(chunks)
    chosen = parse_order(order)
    if chosen is Order.POLICY:
        lengths = [len(tokens) for _, tokens in chunks]
        given = suffix.keeps_given_order(lengths, len(prefix_ids) + len(query_ids))
        chosen = Order.GIVEN if given else Order.RELEVANCE
    scores = relevance_scores(relevance, len(chunks))
    ran = chunk_order(chosen, list(query_ids), [list(tokens) for _, tokens in chunks], scores)
    chunks = ran.apply(chunks)
    tokens = list(prefix_ids) + [t for _, chunk in chunks for t in chunk] + list(query_ids)
    return LinkPrompt(prompt_token_ids=tokens, ids=tuple(cid for cid, _ in chunks), policy=suffix.name, order=ran,
                      tenant_salt=tenant_salt or None)  # fmt: skip


def chat_link_prompt(
    tokenizer: object,
    chunks: Sequence[tuple[str, Sequence[int]]],
    messages: list[dict],
    *,
    policy: str = DEFAULT_POLICY,
    order: str | Order = Order.POLICY,
    relevance: Sequence[float] | None = None,
    tenant_salt: str | None = None,
) -> LinkPrompt:
    """``link_prompt`` with the prefix and query cut from the model's chat template around the documents
    (where a message says ``{documents}``, else at the start of the first user message: ``PIC.link_chat``)."""
    prefix, query = split_chat(tokenizer, messages, strip_bos=False)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])  # noqa: E731
    ids = encode(query)
    return link_prompt(chunks, ids, prefix_ids=encode(prefix), policy=policy, order=order, relevance=relevance,
                       tenant_salt=tenant_salt)  # fmt: skip


def compile_prompt(document_ids: Sequence[int], *, bos_token_id: int | None = None) -> tuple[list[int], dict]:
    """The prompt and ``kv_transfer_params`` of a request that stores ``document_ids`` as a chunk through vLLM
    (``bos_token_id``: the model's, when its chunks are compiled after a BOS). Run it with ``max_tokens=1``; its
    output's ``kv_transfer_params["pic"]["cache_id"]`` is the chunk's id. A tenant's compile carries the tenant's
    salt as its ``cache_salt`` (``{"prompt_token_ids": prompt, "cache_salt": salt}``): the chunk's id hashes it."""
    lead = [] if bos_token_id is None else [bos_token_id]
    return lead + list(document_ids), {PARAMS_KEY: {"compile": True}}


def link_report(kv_transfer_params: dict | None, *, strict: bool = True) -> dict:
    """The connector's report of a finished request (``RequestOutput.kv_transfer_params``).

    Raises:
        PicError: ``strict`` and the request was not linked (its reason in the message).
    """
    report = (kv_transfer_params or {}).get(PARAMS_KEY)
    if report is None:
        raise PicError("vLLM returned no pic report: is PicConnector configured (--kv-transfer-config)?")
    if strict and not report.get("linked", "cache_id" in report):
        raise PicError(f"vLLM served the request as a plain prefill: {report.get('reason')}")
    return report
