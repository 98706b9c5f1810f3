"""Namespaces in the Python API: ids that hash a namespace's salt, links and reads that ask whose a chunk is, and
the one rule for chunks compiled in context (``pic.namespaces``, ``ChunkSources``)."""

from __future__ import annotations

import pytest

import pic
from pic.ids import chunk_id

DOC = "Tom had a big red ball. He liked to play with it in the park."
OTHER = "Lily loved to sing songs to her cat every morning."
A = pic.Namespace("a", salt=b"a" * 32)
B = pic.Namespace("b", salt=b"b" * 32)


def test_the_same_document_gets_another_id_in_every_namespace(stories):
    default, named, a, b = (stories.compile([DOC], namespace=ns)[0] for ns in (None, "plain", A, B))
    assert len({default, named, a, b}) == 4
    assert stories.compile([DOC])[0] == default  # the default namespace: the plain content address, unchanged
    tokens = stories.tokenizer(DOC, add_special_tokens=False)["input_ids"]
    options = stories.compile_options().model_copy(update={"namespace": "a"})
    assert chunk_id(stories.fingerprint, tokens, options, A.salt) == a  # computable only with the salt
    named_options = options.model_copy(update={"namespace": "plain"})
    assert chunk_id(stories.fingerprint, tokens, named_options) == named  # a name alone: anyone can compute it


def test_a_salted_id_does_not_depend_on_the_label(stories):
    """Two programs that name a namespace differently but share its salt agree on every id (pic serve's tenant and
    vLLM's cache_salt)."""
    first = stories.compile([DOC], namespace=pic.Namespace("first", salt=b"s" * 32))[0]
    second = stories.compile([DOC], namespace=pic.Namespace("second", salt=b"s" * 32))[0]
    assert first == second


def _unknown(call) -> str:
    with pytest.raises(pic.UnknownCacheIdError) as info:
        call()
    return str(info.value)


def test_a_chunk_of_another_namespace_is_answered_as_one_nobody_compiled(stories):
    (mine,) = stories.compile([DOC], namespace=A)
    never = chunk_id(stories.fingerprint, [5, 6, 7], stories.compile_options(), B.salt)
    assert stories.link([mine], "One day", namespace=A).generate(max_new_tokens=2).text is not None
    for ns in (B, None):  # another namespace, the default one
        foreign = _unknown(lambda ns=ns: stories.link([mine], "One day", namespace=ns))
        assert foreign == _unknown(lambda ns=ns: stories.link([never], "One day", namespace=ns)).replace(never, mine)
        assert _unknown(lambda ns=ns: stories.store.describe(mine, namespace=ns))
        assert stories.store.get(mine, namespace=ns) is None
        assert stories.store.expire(mine, namespace=ns) is False
    assert stories.store.describe(mine, namespace=A).num_tokens > 0  # still there, untouched


def test_a_shared_namespace_is_read_not_deleted_by_its_readers(stories):
    corpus = pic.Namespace("corpus", salt=b"c" * 32)
    (shared,) = stories.compile([OTHER], namespace=corpus)
    reader = pic.Access(own=A, reads=(corpus,))
    assert stories.link([shared], "One day", namespace=reader).generate(max_new_tokens=2).token_ids is not None
    assert stories.store.describe(shared, namespace=reader).cache_id == shared
    assert stories.store.expire(shared, namespace=reader) is False  # a reader of the corpus cannot delete it
    assert stories.store.expire(shared, namespace=corpus) is True
    _unknown(lambda: stories.link([shared], "One day", namespace=reader))


def test_an_evicted_chunk_is_compiled_again_only_for_its_own_namespace(stories):
    """The engine keeps the tokens of every chunk it compiled (to compile it again when evicted): another namespace's
    link of the id must not use them."""
    (mine,) = stories.compile([OTHER + " Again."], namespace=A)
    with stories.paused() as core:
        core.store.device.delete(mine)  # evicted from the pool (no lower tier): only the engine's recipe is left
    _unknown(lambda: stories.link([mine], "One day", namespace=B))
    assert stories.link([mine], "One day", namespace=A).generate(max_new_tokens=1).token_ids  # compiled again


def test_a_chunk_compiled_in_context_links_only_after_that_context(stories):
    context = "Once upon a time, in a small town,"
    (alone,) = stories.compile([DOC])
    (in_context,) = stories.compile([DOC], context=context)
    linked = stories.link([in_context], "Then", prefix=context + " there was a story.")
    assert linked.generate(max_new_tokens=1).token_ids  # the prompt starts with the context: linked
    with pytest.raises(pic.CompileOptionsMismatchError, match="compiled after a context of"):
        stories.link([in_context], "Then", prefix="A different start.")
    with pytest.raises(pic.CompileOptionsMismatchError, match="compiled after a context of"):
        stories.link([in_context], "Then")
    assert stories.link([alone], "Then", prefix="A different start.").generate(max_new_tokens=1).token_ids


def test_a_name_stands_for_one_namespace(stories):
    """The engine checks resident chunks by their namespace's name: a caller naming ``a`` without ``a``'s salt (or
    with another) is refused, never let read ``a``'s chunks."""
    (mine,) = stories.compile([DOC], namespace=A)
    for impostor in ("a", pic.Namespace("a", salt=b"x" * 32), pic.Access(own=B, reads=(pic.Namespace("a"),))):
        with pytest.raises(pic.InvalidInputError, match="namespace 'a' was used in this engine with another salt"):
            stories.link([mine], "One day", namespace=impostor)
        with pytest.raises(pic.InvalidInputError, match="another salt"):
            stories.store.describe(mine, namespace=impostor)
        with pytest.raises(pic.InvalidInputError, match="another salt"):
            stories.compile([OTHER], namespace=impostor)


def test_namespace_arguments_are_checked(stories):
    with pytest.raises(pic.InvalidInputError, match="namespace name"):
        stories.compile([DOC], namespace="no spaces allowed")
    with pytest.raises(pic.InvalidInputError, match="expected a name"):
        stories.link(["0" * 32], "q", namespace=42)
    with pytest.raises(pic.InvalidInputError, match="default namespace"):
        pic.Namespace("", salt=b"x")
    assert "salt" not in repr(A) and repr(b"a" * 32) not in repr(A)
    assert pic.Namespace.derived("t", "secret") == pic.Namespace.derived("t", b"secret") != pic.Namespace.derived(
        "t", "other"
    )
