"""The vLLM connector's tenants without vLLM: a request's ``cache_salt`` as its pic namespace (the salt of a
link split from the link's part), the ids a tenant's compile gets, and the reads that find a tenant's chunks only
(``pic.vllm.tenants`` over a real disk tier)."""

from __future__ import annotations

import re

import pytest
import torch

import pic
from pic.config import CompileOptions
from pic.errors import InvalidInputError
from pic.ids import chunk_id
from pic.kv import ChunkKV
from pic.namespaces import DEFAULT, NAME_PATTERN, Namespace
from pic.store import DiskTier, serde
from pic.vllm.client import link_prompt
from pic.vllm.params import LinkRequest, VllmSuffix, link_salt, parse_params
from pic.vllm.tenants import namespace_of, read_chunk, read_tokens

FINGERPRINT = "0123456789abcdef0123456789abcdef"
EXPECTED = serde.Expected(FINGERPRINT, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                          max_tokens=512, vocab_size=1000)  # fmt: skip
OPTIONS = CompileOptions(add_bos=False)  # the connector's options on SmolLM2 (no BOS)
TOKENS = [11, 12, 13, 14, 15]
IDS = ("a", "b")
LINK = link_salt(IDS, "naive")


def test_a_tenants_link_salt_is_its_salt_then_the_links():
    assert link_salt(IDS, "naive", tenant_salt="tenant-A") == "tenant-A:" + LINK
    assert link_salt(IDS, "naive", tenant_salt=None) == link_salt(IDS, "naive", tenant_salt="") == LINK  # as before
    salts = {link_salt(IDS, "naive", tenant_salt=s) for s in (None, "A", "B", "A:B")}
    assert len(salts) == 4  # two tenants linking the same ids never share vLLM's blocks (it hashes the whole salt)


@pytest.mark.parametrize("tenant", ["tenant-A", "a:b", "x" * 91, LINK, "ünï cødé"])
def test_the_connector_reads_the_tenant_back_from_a_links_salt(tenant):
    request = LinkRequest(ids=IDS, policy=VllmSuffix(0.0))
    assert request.tenant_of(link_salt(IDS, "naive", tenant_salt=tenant)) == tenant
    assert request.tenant_of(LINK) is None  # the default namespace


@pytest.mark.parametrize(
    "cache_salt",
    [None, "", "hunter2", ":" + LINK, LINK + "x", "hunter2:" + link_salt(IDS, "full"), "hunter2" + LINK,
     link_salt(IDS[::-1], "naive")],
)  # fmt: skip
def test_a_link_whose_salt_is_not_its_own_is_refused_without_echoing_it(cache_salt):
    request = LinkRequest(ids=IDS, policy=VllmSuffix(0.0))
    with pytest.raises(InvalidInputError, match="must carry cache_salt") as error:
        request.tenant_of(cache_salt)
    assert "hunter2" not in str(error.value)  # a tenant's salt is a secret: never in a reason or a log


def test_a_salt_is_a_namespace_labelled_by_its_hash():
    assert namespace_of(None) is DEFAULT and namespace_of("") is DEFAULT  # vLLM salts nothing with ""
    a = namespace_of("tenant-A")
    assert a.salt == b"tenant-A" and re.fullmatch(r"salt-[0-9a-f]{12}", a.name) and re.match(NAME_PATTERN, a.name)
    assert a == namespace_of("tenant-A") and a.name != namespace_of("tenant-B").name
    assert "tenant-A" not in repr(a)
    assert namespace_of("\ud800").salt == "\ud800".encode("utf-8", "surrogatepass")  # JSON can give any str


@pytest.mark.parametrize("salt", [b"bytes", 7, "x" * 1025])
def test_a_salt_no_namespace_can_hold_is_refused(salt):
    with pytest.raises(InvalidInputError):
        namespace_of(salt)


def test_a_tenants_ids_hash_its_salt_as_pic_serves_do():
    tenant = namespace_of("S")
    ours = chunk_id(FINGERPRINT, TOKENS, OPTIONS.model_copy(update={"namespace": tenant.name}), tenant.salt)
    served = Namespace("team-a", b"S")  # pic serve's tenant, named otherwise, with the salt S
    assert ours == chunk_id(FINGERPRINT, TOKENS, OPTIONS.model_copy(update={"namespace": served.name}), served.salt)
    assert ours != chunk_id(FINGERPRINT, TOKENS, OPTIONS)  # the default namespace's id
    assert ours != chunk_id(FINGERPRINT, TOKENS, OPTIONS, namespace_of("T").salt)  # another tenant's


def _id(namespace: Namespace, tokens: list[int] = TOKENS, options: CompileOptions = OPTIONS) -> str:
    return chunk_id(FINGERPRINT, tokens, options.model_copy(update={"namespace": namespace.name}), namespace.salt)


def _chunk(cache_id: str, namespace: Namespace) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    shape = (EXPECTED.num_layers, len(TOKENS), EXPECTED.num_kv_heads, EXPECTED.head_dim)
    options = OPTIONS.model_copy(update={"namespace": namespace.name})
    return ChunkKV(cache_id, torch.tensor(TOKENS), torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                   options)  # fmt: skip


@pytest.fixture
def disk(tmp_path) -> DiskTier:
    """A disk tier holding the default namespace's chunk of ``TOKENS`` and tenant A's, as the connector stores them."""
    tier = DiskTier(tmp_path, expected=EXPECTED, capacity_bytes=1 << 30, part_bytes=1000)
    a = namespace_of("A")
    assert tier.put(_chunk(_id(DEFAULT), DEFAULT)) and tier.put(_chunk(_id(a), a))
    return tier


def test_a_tenant_reads_none_of_another_namespaces_chunks(disk):
    a, b = namespace_of("A"), namespace_of("B")
    assert read_tokens(disk, _id(DEFAULT), DEFAULT) == tuple(TOKENS)  # the default namespace: as before
    for namespace in (a, b):  # the default namespace's chunk is no tenant's
        assert read_tokens(disk, _id(DEFAULT), namespace) is None
        assert read_chunk(disk, _id(DEFAULT), namespace) is None
    assert read_tokens(disk, _id(a), b) is None and read_tokens(disk, _id(a), DEFAULT) is None
    assert read_chunk(disk, _id(a), b) is None
    assert read_tokens(disk, "f" * 32, a) is None  # an id nobody compiled: the same answer


def test_a_tenant_reads_its_own_chunks(disk):
    a = namespace_of("A")
    assert read_tokens(disk, _id(a), a) == tuple(TOKENS)
    assert read_chunk(disk, _id(a), a).token_ids.tolist() == TOKENS


LINKED = [("b", [5, 20, 21]), ("a", [5, 10, 11])]


def test_link_prompt_carries_the_tenants_salt_the_connector_splits_off():
    prompt = link_prompt(LINKED, [21], policy="naive", order="given", tenant_salt="hunter2")
    assert prompt.cache_salt == "hunter2:" + link_salt(["b", "a"], "naive")
    assert prompt.tokens_prompt()["cache_salt"] == prompt.openai_extra_body()["cache_salt"] == prompt.cache_salt
    assert parse_params(prompt.kv_transfer_params).tenant_of(prompt.cache_salt) == "hunter2"  # the scheduler's read
    assert "hunter2" not in repr(prompt)
    plain = link_prompt(LINKED, [21], policy="naive", order="given")
    assert plain.cache_salt == link_prompt(LINKED, [21], policy="naive", order="given", tenant_salt="").cache_salt
    assert parse_params(plain.kv_transfer_params).tenant_of(plain.cache_salt) is None
    with pytest.raises(InvalidInputError, match="tenant_salt"):
        link_prompt(LINKED, [21], tenant_salt=b"hunter2")


def test_the_connector_takes_the_fleets_store_key_from_a_file_or_the_environment(tmp_path):
    """As ``pic serve`` takes it (hex; a file of mode 600, or ``PIC_STORE_KEY``), never from the JSON config vLLM
    prints."""
    from pic.vllm.setup import fleet_store_key

    key = "ab" * 32
    path = tmp_path / "store.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    assert fleet_store_key(str(path), environ={}) == bytes.fromhex(key)
    assert fleet_store_key(None, environ={"PIC_STORE_KEY": key}) == bytes.fromhex(key)
    assert fleet_store_key(None, environ={}) is None
    with pytest.raises(pic.InvalidInputError, match="given twice"):
        fleet_store_key(str(path), environ={"PIC_STORE_KEY": key})
    path.chmod(0o644)
    with pytest.raises(pic.InvalidInputError, match="chmod 600"):
        fleet_store_key(str(path), environ={})
    with pytest.raises(pic.InvalidInputError, match="not hex") as info:
        fleet_store_key(None, environ={"PIC_STORE_KEY": "not-a-hex-key-" * 4})
    assert "not-a-hex-key" not in str(info.value)
