"""``pic serve --tenants FILE``: the file's rules (keys and salts from files, the environment or the file; reads,
quotas, rates), each mistake refused naming the tenant and the field and never echoing a secret."""

from __future__ import annotations

import hashlib

import pytest

import pic
from pic.serve.tenants import RateLimit, Tenants, load_tenants

KEY_A, KEY_B = "alice-key-0123456789", "bobby-key-0123456789"


def _write(tmp_path, text: str):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    path.chmod(0o600)  # (it may hold keys)
    return path


def test_keys_come_from_files_the_environment_or_the_file(tmp_path):
    (tmp_path / "a.key").write_text(KEY_A + "\n")
    (tmp_path / "a.key").chmod(0o600)
    path = _write(
        tmp_path,
        '[tenants.alice]\nkey_file = "a.key"\nreads = ["corpus"]\nkv_share = 0.25\nmax_num_seqs = 4\n'
        '[tenants.bob]\nkey_env = "BOB_KEY"\nrequests_per_s = 5\n'
        '[tenants.corpus]\nkey = "corpus-key-0123456789"\nsalt = "public-corpus-salt"\n',
    )
    tenants = load_tenants(path, environ={"BOB_KEY": KEY_B})
    alice, bob = tenants.find(KEY_A.encode()), tenants.find(KEY_B.encode())
    assert (alice.name, bob.name) == ("alice", "bob")
    assert tenants.find(b"wrong") is None and tenants.find(None) is None
    assert alice.access.own == pic.Namespace.derived("alice", KEY_A)  # salt derived from the key
    assert [n.name for n in alice.access.reads] == ["corpus"]
    assert alice.access.reads[0].salt == b"public-corpus-salt"
    assert tenants.quotas == {"alice": pic.Quota(kv_share=0.25, max_num_seqs=4)}
    assert bob.rate is not None and bob.rate.burst == 10 and alice.rate is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[tenants.alice]\nreads = []\n", "has no key"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nkey_env = "X"\n', "not several"),
        ('[tenants.alice]\nkey = "short"\n', "at least 16"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\n[tenants.bob]\nkey = "{KEY_A}"\n', "the same key"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nsalt = "s"\n[tenants.bob]\nkey = "{KEY_B}"\nsalt = "s"\n', "same salt"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nreads = ["nobody"]\n', "other tenants' names"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nreads = ["alice"]\n', "other tenants' names|names itself"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nkv_shares = 0.5\n', "unknown field"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nkv_share = 0.7\n[tenants.bob]\nkey = "{KEY_B}"\nkv_share = 0.7\n',
         "sum to 1.4"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nkv_share = 2\n', "kv_share"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nrequests_per_s = 0\n', "above 0"),
        (f'[tenants.alice]\nkey = "{KEY_A}"\nburst = 3\n', "burst needs"),
        (f'[tenants."bad name"]\nkey = "{KEY_A}"\n', "tenant name"),
        ('[tenants.alice]\nkey_env = "UNSET_VARIABLE_FOR_PIC"\n', "not set"),
        ('[tenants.alice]\nkey_file = "missing.key"\n', "cannot read"),
        ("[server]\nx = 1\n", "expected \\[tenants.NAME\\]"),
        ("not toml = = =", "not TOML"),
    ],
)  # fmt: skip
def test_a_wrong_file_is_refused_naming_the_tenant_and_never_the_secret(tmp_path, text, error):
    with pytest.raises(pic.InvalidInputError, match=error) as info:
        load_tenants(_write(tmp_path, text), environ={})
    assert KEY_A not in str(info.value) and KEY_B not in str(info.value)


def test_secrets_in_files_others_may_read_are_refused(tmp_path):
    (tmp_path / "a.key").write_text(KEY_A)
    (tmp_path / "a.key").chmod(0o644)
    with pytest.raises(pic.InvalidInputError, match="may be read or written by others"):
        load_tenants(_write(tmp_path, '[tenants.alice]\nkey_file = "a.key"\n'))
    path = _write(tmp_path, f'[tenants.alice]\nkey = "{KEY_A}"\n')
    path.chmod(0o644)
    with pytest.raises(pic.InvalidInputError, match="holds secrets .*chmod 600") as info:
        load_tenants(path)
    assert KEY_A not in str(info.value)
    path.write_text('[tenants.alice]\nkey_env = "K"\n')  # no secret in it: any mode
    assert load_tenants(path, environ={"K": KEY_A}).find(KEY_A.encode()).name == "alice"


def test_a_huge_file_is_refused_unread(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(pic.InvalidInputError, match="over 1,048,576 bytes"):
        load_tenants(path)


def test_one_api_key_is_one_tenant_in_the_default_namespace():
    keyed, open_ = Tenants.single(KEY_A), Tenants.single(None)
    assert keyed.find(KEY_A.encode()).access == pic.Access()
    assert keyed.find(b"other") is None and keyed.keyed
    assert open_.find(None).access == pic.Access() and not open_.keyed
    assert keyed.by_key_digest.keys() == {hashlib.sha256(KEY_A.encode()).digest()}


def test_a_rate_limit_refills_at_its_rate():
    rate = RateLimit(per_s=2.0, burst=2)
    start = 1000.0
    rate._at = start
    assert [rate.take(start) for _ in range(2)] == [0.0, 0.0]
    assert rate.take(start) == pytest.approx(0.5)  # the next token comes in half a second
    assert rate.take(start + 0.5) == 0.0
    assert rate.take(start + 0.5) > 0
