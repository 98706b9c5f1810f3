"""``link_chat``: the chunks go where a plain chat prompt puts the documents (issue 12).

The stories260K tokenizer has no chat template, so the tests give copies of it one: a ChatML-like
template (markers as plain text) and a Llama-3-like one that writes the BOS text itself. The oracle is
the template rendered with the documents' text inline, tokenized segment by segment as ``link`` does,
and transformers' own forward over those tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pic
from pic.link.chat import split_chat
from tests.models import model, tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
DOCS = ("Tom had a big red ball.\n\n", "Lily loved to sing a happy song.\n\n")
MESSAGES = [
    {"role": "system", "content": "Answer from the stories."},
    {"role": "user", "content": "Who had a ball?"},
]
BOS = 1
TOL = 1e-4  # float32 on the CPU


def chat_tokenizer(template: str | None):
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = template
    return tok


def engine(template: str | None = CHATML, family: str = "llama", **config) -> pic.PIC:
    return pic.PIC(model(family), chat_tokenizer(template), config=pic.PICConfig(**config))


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def inline(messages: list[dict], docs: str) -> list[dict]:
    """The messages a plain chat prompt would have: the documents' text where link_chat puts them."""
    out = [dict(m) for m in messages]
    marked = [m for m in out if "{documents}" in m["content"]]
    if marked:
        marked[0]["content"] = marked[0]["content"].replace("{documents}", docs)
    else:
        user = next(m for m in out if m["role"] == "user")
        user["content"] = docs + user["content"]
    return out


def plain_prompt(tok, messages: list[dict], *, strip_bos: bool) -> tuple[list[int], str, str]:
    """The plain prompt's tokens, segment by segment, and its prefix and query texts, checked against
    the template rendered with the documents inline."""
    prefix, query = split_chat(tok, messages, strip_bos=strip_bos)
    full = tok.apply_chat_template(inline(messages, "".join(DOCS)), tokenize=False, add_generation_prompt=True)
    if strip_bos:
        full = full.removeprefix(tok.bos_token)
    assert prefix + "".join(DOCS) + query == full
    ids = encode(tok, prefix) + [t for d in DOCS for t in encode(tok, d)] + encode(tok, query)
    return ids, prefix, query


@pytest.mark.parametrize("family", ["llama", "stories260K"])
@pytest.mark.parametrize("template", [CHATML, LLAMA3])
def test_full_recompute_equals_the_plain_chat_prompt(family, template):
    e = engine(template, family, add_bos=False)
    ids, prefix, _ = plain_prompt(e.tokenizer, MESSAGES, strip_bos=False)
    assert prefix.startswith("<s>") == (template is LLAMA3)  # the template's BOS kept: pic adds none
    linked = e.link_chat(e.compile(list(DOCS)), MESSAGES, policy="full")
    assert linked.input_ids.tolist() == ids
    with torch.no_grad():
        ref = model(family)(torch.tensor([ids])).logits[0, -linked.logits.shape[0] :]
    assert (linked.logits - ref).abs().max().item() <= TOL
    assert len(linked.generate(max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("template", [CHATML, LLAMA3])
def test_one_bos_when_pic_adds_it(template):
    """With ``add_bos`` pic writes the BOS: a template's own BOS text is dropped, not doubled."""
    e = engine(template)
    ids, prefix, _ = plain_prompt(e.tokenizer, MESSAGES, strip_bos=True)
    assert not prefix.startswith("<s>")
    linked = e.link_chat(e.compile(list(DOCS)), MESSAGES, order="given")  # the plain prompt's order
    p = len(encode(e.tokenizer, prefix))
    doc_ids = [[BOS, *encode(e.tokenizer, d)] for d in DOCS]
    expected = [BOS, *ids[:p], *doc_ids[0], *doc_ids[1], *ids[p + sum(len(d) - 1 for d in doc_ids) :]]
    assert linked.input_ids.tolist() == expected
    assert linked.input_ids[1].item() != BOS


def test_marker_moves_the_documents():
    e = engine(add_bos=False)
    messages = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Read this: {documents}Who had a ball?"},
    ]
    ids, prefix, query = plain_prompt(e.tokenizer, messages, strip_bos=False)
    assert prefix.endswith("<|im_start|>user\nRead this: ") and "Hello." in prefix
    assert query.startswith("Who had a ball?<|im_end|>")
    cids = e.compile(list(DOCS))
    moved = e.link_chat(cids, messages, order="given")  # the plain prompt's order
    assert moved.input_ids.tolist() == ids
    unmarked = [*messages[:3], {"role": "user", "content": "Read this: Who had a ball?"}]
    default = e.link_chat(cids, unmarked)  # at the start of the first user message, before "Hello."
    assert split_chat(e.tokenizer, unmarked)[1].startswith("Hello.<|im_end|>")
    assert default.input_ids.tolist() != moved.input_ids.tolist()
    in_system = split_chat(e.tokenizer, [{"role": "system", "content": "Docs: {documents}"}])
    assert in_system == ("<|im_start|>system\nDocs: ", "<|im_end|>\n<|im_start|>assistant\n")


def test_module_level_link_chat(monkeypatch):
    e = engine()
    monkeypatch.setattr(pic, "_default_engine", e)
    cids = pic.compile(list(DOCS))
    assert torch.equal(pic.link_chat(cids, MESSAGES).input_ids, e.link_chat(cids, MESSAGES).input_ids)
    assert list(pic.link_chat(cids, MESSAGES, add_generation_prompt=False).stream(max_new_tokens=2))


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages is 'hello'"),
        ({"role": "user", "content": "x"}, "messages is"),
        ([], "messages is empty"),
        ([("user", "x")], r"message 0 is \('user', 'x'\)"),
        ([{"role": "user"}], "message 0 has content None"),
        ([{"role": "user", "content": [{"type": "text"}]}], "message 0 has content"),
        ([{"role": "user", "content": "x"}, {"content": "y"}], "message 1 has role None"),
        ([{"role": "system", "content": "x"}], r"no user message \(roles \['system'\]\)"),
        ([{"role": "user", "content": "{documents} and {documents}"}], r"2 \{documents\} markers"),
        (
            [{"role": "system", "content": "{documents}"}, {"role": "user", "content": "{documents}"}],
            r"markers \(in messages \[0, 1\]\)",
        ),
    ],
)
def test_bad_messages(messages, match):
    e = engine()
    with pytest.raises(pic.InvalidInputError, match=match):
        e.link_chat(e.compile(DOCS[0]), messages)


def test_bad_templates():
    cid = engine().compile(DOCS[0])
    with pytest.raises(pic.InvalidInputError, match="stories260K' has no chat template"):
        engine(None).link_chat(cid, MESSAGES)
    dropped = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # never writes the content
    with pytest.raises(pic.InvalidInputError, match="placeholder 0 times"):
        engine(dropped).link_chat(cid, MESSAGES)
    failing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(pic.InvalidInputError, match="failed on the messages: roles must alternate"):
        engine(failing).link_chat(cid, MESSAGES)
