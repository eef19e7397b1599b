"""Keyed namespaces: without the secret, nobody can probe, forge, swap or read as valid.

Each test plays the attacker the issue describes: a user of the same store who knows the
namespace's name and the layout, can list, read and write every key, and does not have the
secret (or has another one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_vault import BS, fill, layout

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import (
    ENCRYPTED_VERSION,
    HEADER_SIZE,
    IntegrityError,
    ObjectHeader,
    ObjectKind,
    checksum,
    decode,
    encode,
    encode_into,
    is_sealed,
    proved_wrong,
)
from prefixvault.inventory import audit, summarize
from prefixvault.objects import ObjectRef
from prefixvault.samples import VerifySample, pending_samples, write_sample
from prefixvault.stores import Store
from prefixvault.stores.local import LocalStore
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey, SecretError, namespace_key, read_secret
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings

SECRET = b"tenant-a-secret-0123456789abcdef"
KEY = NamespaceKey.derive(SECRET, "tenantA")
OTHER = NamespaceKey.derive(b"tenant-b-secret-0123456789abcdef", "tenantA")
PROMPT = list(range(64))
GUESS = [*range(32), *range(500, 532)]  # a prompt tenant A never sent


def tenant_a() -> tuple[MemoryStore, Vault]:
    store = MemoryStore()
    vault = Vault(store, layout(), "tenantA", KEY)
    assert fill(vault, PROMPT, [16, 40]) == [16, 40]
    return store, vault


# -- secrets --------------------------------------------------------------------------------


def test_secret_from_file_or_env_and_never_in_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    assert read_secret(file=str(f)) == SECRET  # an editor's newline is not part of it
    monkeypatch.setenv("PV_TEST_SECRET", SECRET.decode())
    assert read_secret(env="PV_TEST_SECRET") == SECRET
    assert read_secret() is None
    assert namespace_key("tenantA", file=str(f)) == KEY
    assert SECRET.decode() not in repr(KEY) and KEY.mac_key.hex() not in repr(KEY)
    short = tmp_path / "short"
    short.write_bytes(b"hunter2")
    for kwargs, words in (
        ({"file": str(short)}, "shorter than 16 bytes"),
        ({"file": str(tmp_path / "nope")}, "No such file"),
        ({"env": "PV_TEST_UNSET_VAR"}, "not set"),
        ({"file": str(f), "env": "PV_TEST_SECRET"}, "not both"),
    ):
        with pytest.raises(SecretError, match=words) as e:
            read_secret(**kwargs)
        assert "hunter2" not in str(e.value) and SECRET.decode() not in str(e.value)


def test_keys_depend_on_secret_and_namespace() -> None:
    assert KEY != OTHER
    assert NamespaceKey.derive(SECRET, "tenantB") != KEY  # one secret, two namespaces: still apart
    with pytest.raises(ValueError, match="tenantA"):
        Vault(MemoryStore(), layout(), "tenantB", KEY)


def test_connector_config_names_the_secret_and_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "s"
    f.write_bytes(SECRET)
    s = ConnectorSettings.from_extra({"namespace": "tenantA", "namespace_secret_file": str(f)})
    assert s.namespace_key() == KEY
    assert SECRET.decode() not in repr(s)
    with pytest.raises(ValueError, match=r"^prefixvault: cannot read namespace secret file .*nope"):
        ConnectorSettings.from_extra({"namespace": "tenantA",
                                      "namespace_secret_file": str(tmp_path / "nope")})
    monkeypatch.setenv("PV_TEST_SECRET", "short")
    with pytest.raises(ValueError, match=r"PV_TEST_SECRET.*shorter") as e:
        ConnectorSettings.from_extra({"namespace": "tenantA", "namespace_secret_env": "PV_TEST_SECRET"})
    assert "short'" not in str(e.value)
    assert ConnectorSettings.from_extra({"namespace": "x"}).namespace_key() is None


# -- the codec --------------------------------------------------------------------------------


HEADER = ObjectHeader(ObjectKind.STATE, b"f" * 16, b"h" * 16, 2, 0, 64, "float32", (4, 4), 64)
PAYLOAD = np.arange(16, dtype=np.float32).tobytes()


def sealed(key: NamespaceKey = KEY) -> bytes:
    return b"".join(bytes(p) for p in encode(HEADER, PAYLOAD, key))


def test_sealed_objects_verify_only_with_their_key() -> None:
    blob = sealed()
    header, payload = decode(blob, HEADER, KEY)
    assert header == HEADER and bytes(payload) == PAYLOAD
    assert sealed() != blob  # a fresh nonce per object
    for key, reason in ((OTHER, "mac"), (None, "sealed")):
        with pytest.raises(IntegrityError) as e:
            decode(blob, HEADER, key)
        assert e.value.reason == reason
    plain = b"".join(bytes(p) for p in encode(HEADER, PAYLOAD))
    with pytest.raises(IntegrityError) as e:
        decode(plain, HEADER, KEY)
    assert e.value.reason == "unsealed"


@settings(max_examples=300, deadline=None)
@given(st.integers(0, HEADER_SIZE + len(PAYLOAD) - 1), st.integers(1, 255))
def test_any_changed_byte_of_a_sealed_object_is_rejected(pos: int, flip: int) -> None:
    blob = bytearray(sealed())
    blob[pos] ^= flip
    with pytest.raises(IntegrityError):
        decode(bytes(blob), HEADER, KEY)


# -- the attacks of the issue -------------------------------------------------------------------


def test_without_the_secret_existence_cannot_be_probed() -> None:
    store, vault_a = tenant_a()
    for key in (None, OTHER):
        b = Vault(store, layout(), "tenantA", key)
        for prompt in (PROMPT, GUESS):  # cached or not, B sees the same answer
            hashes = b.hashes([*prompt, 7])
            assert b.lookup(hashes, len(prompt) + 1) == 0
            refs = b.needed(hashes, 40)
            assert store.exists_many([r.key for r in refs]) == [False] * len(refs)
            assert not store.exists_many([b.keys.record(hashes[4])])[0]
    # A itself hits, and its keys differ from the unkeyed ones by more than a prefix
    a_hashes = vault_a.hashes([*PROMPT, 7])
    assert vault_a.lookup(a_hashes, 65) == 40
    plain = Vault(store, layout(), "tenantA").hashes(PROMPT)
    assert not set(a_hashes) & set(plain)


def forge_plain(vault_b: Vault, blob: bytes) -> bytes:
    """What the issue's attacker wrote: a plain object with a valid header and checksum,
    for the exact key and identity the consumer expects, with other bytes."""
    header, payload = decode(blob, key=KEY)
    evil = np.frombuffer(bytes(payload), dtype=np.uint8) ^ 0x55
    return b"".join(bytes(p) for p in encode(header, evil.tobytes()))


def test_forged_objects_are_rejected_counted_removed_and_recomputed() -> None:
    store, vault_a = tenant_a()
    hashes = vault_a.hashes([*PROMPT, 7])
    refs = vault_a.needed(hashes, 40)
    state = next(r for r in refs if r.kind is ObjectKind.STATE)
    block = next(r for r in refs if r.kind is ObjectKind.BLOCK and r.block_index == 0)
    other_block = next(r for r in refs if r.kind is ObjectKind.BLOCK and r.block_index == 1)
    good = store.get_many([state.key, block.key])
    assert good[0] is not None and good[1] is not None
    # 1. a plain object with a valid checksum, 2. a sealed object moved to another key,
    # 3. the right object with one payload byte changed
    tampered = bytearray(good[0])
    tampered[HEADER_SIZE] ^= 1
    for key, blob, reason in (
        (state.key, forge_plain(vault_a, good[0]), "unsealed"),
        (other_block.key, good[1], "identity"),
        (state.key, bytes(tampered), "mac"),
    ):
        store.put_many([(key, [blob])])
        loaded = vault_a.load(refs)
        assert not loaded.ok and set(loaded.failed.values()) == {reason}
        assert vault_a.counters.rejected[reason] == 1
        assert store.get_many([key]) == [None]  # removed: the next producer writes it again
        fill(vault_a, PROMPT, [16, 40])
        assert vault_a.load(refs).ok


def test_a_forged_plain_header_with_the_sealed_flag_cleared_still_fails() -> None:
    """The flag byte is covered: clearing it turns the object into a plain one that fails its
    header checksum, and a keyed reader refuses plain objects anyway."""
    blob = bytearray(sealed())
    blob[9] = 0
    for key in (KEY, None):
        with pytest.raises(IntegrityError):
            decode(bytes(blob), HEADER, key)


def test_audit_checks_keyed_namespaces_only_with_their_secret() -> None:
    store, vault_a = tenant_a()
    plain_vault = Vault(store, layout(), "public")
    fill(plain_vault, PROMPT, [16])
    hashes = vault_a.hashes(PROMPT)
    state = next(r for r in vault_a.needed(hashes, 40) if r.kind is ObjectKind.STATE)
    blob = store.get_many([state.key])[0]
    assert blob is not None
    store.put_many([(state.key, [forge_plain(vault_a, blob)])])

    blind = audit(store, repair=True)  # no secret: tenant A's records are kept, unverified
    assert blind.findings == []
    assert {f.problem for f in blind.unverifiable} == {
        "namespace has a secret: give it to check these records"}
    assert len(blind.unverifiable) == 2 and store.get_many([state.key])[0] is not None

    keyed = audit(store, keys={"tenantA": KEY})
    assert [(f.problem, f.object_key) for f in keyed.findings] == [("unsealed", state.key)]
    assert keyed.unverifiable == []
    wrong = audit(store, keys={"tenantA": OTHER})  # another secret proves nothing either
    assert wrong.findings == [] and len(wrong.unverifiable) == 2


# -- encrypted payloads (issue 48, deliverable 2) --------------------------------------------------


def model(tokens: list[int]) -> Callable[[ObjectRef, int], bytes]:
    """A deterministic stand-in for an engine: the bytes of an object depend on the prefix it
    covers (and its group and kind), never on the engine's block ids; so anyone can compute a
    guessed prompt's KV and states, as anyone holding the model's weights can."""
    def read(ref: ObjectRef, block_id: int) -> bytes:
        n = 2 * BS * 4 * 4 if ref.kind is ObjectKind.BLOCK else 64
        seed = np.asarray(tokens[: ref.tokens], dtype="<i8").tobytes() + bytes([ref.kind, ref.group])
        return (hashlib.blake2b(seed).digest() * (n // 64 + 1))[:n]
    return read


def save_with(vault: Vault, tokens: list[int], boundaries: list[int]) -> list[int]:
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    d = plan_saves(vault.layout, len(tokens), tables, [StateCapture(2, b, 200 + b, 1) for b in boundaries],
                   step=1)
    acks = vault.save(0, hashes, d.publishable, model(tokens))
    return sorted(b for b, why in vault.publish(hashes, acks).items() if why is None)


def guessed_payloads(vault: Vault, tokens: list[int], tokens_at: int) -> list[bytes]:
    """What an attacker computes for a guessed prompt: the KV and state bytes of its prefix."""
    read = model(tokens)
    return [read(ref, 0) for ref in vault.needed(vault.hashes(tokens), tokens_at)]


def every_stored_byte(store: Store, path: Path | None = None) -> bytes:
    """What a party with read access holds: every object, or every file of a local store."""
    if path is not None:
        return b"".join(f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file())
    keys = [k for k, _ in store.scan()]
    return b"".join(b or b"" for b in store.get_many(keys))


@pytest.mark.parametrize("where", ["memory", "local"])
def test_stored_payloads_are_ciphertext_and_a_guess_cannot_be_matched(where: str, tmp_path: Path) -> None:
    """The issue's membership inference: with read access to the store (every Mooncake client,
    a Redis reader, a copy of the local directory), compare the stored bytes with the KV of a
    guessed prompt. Sealed payloads were readable: the prompt tenant A sent matched, the one it
    never sent did not. Encrypted, neither matches, and A still restores what it cached."""
    store: Store = MemoryStore() if where == "memory" else LocalStore(tmp_path / "store", 64 << 20)
    vault = Vault(store, layout(), "tenantA", KEY)
    assert save_with(vault, PROMPT, [16, 40]) == [16, 40]
    raw = every_stored_byte(store, tmp_path / "store" if where == "local" else None)
    sent, never = guessed_payloads(vault, PROMPT, 40), guessed_payloads(vault, GUESS, 40)
    assert len(sent) == len(never) > 0
    assert [p for p in sent + never if p in raw] == []
    hashes = vault.hashes([*PROMPT, 7])
    assert vault.lookup(hashes, 65) == 40
    loaded = vault.load(vault.needed(hashes, 40))
    assert loaded.ok and sorted(bytes(p) for p in loaded.payloads.values()) == sorted(sent)
    plain = Vault(store, layout(), "public")  # the control: without a secret, bytes are readable
    assert save_with(plain, PROMPT, [16, 40]) == [16, 40]
    raw = every_stored_byte(store, tmp_path / "store" if where == "local" else None)
    assert all(p in raw for p in guessed_payloads(plain, PROMPT, 40))


def test_a_wrong_key_a_moved_object_and_a_changed_byte_are_counted_misses(tmp_path: Path) -> None:
    """Through the local store, whose loads decrypt straight out of its memory: each is a
    miss, counted by reason, removed, never served; the next save writes the object again."""
    store = LocalStore(tmp_path / "store", 64 << 20)
    vault = Vault(store, layout(), "tenantA", KEY)
    assert save_with(vault, PROMPT, [16, 40]) == [16, 40]
    hashes = vault.hashes([*PROMPT, 7])
    refs = vault.needed(hashes, 40)
    state = next(r for r in refs if r.kind is ObjectKind.STATE)
    early = next(r for r in vault.needed(hashes, 16) if r.kind is ObjectKind.STATE)
    good = store.get_many([state.key, early.key])
    assert good[0] is not None and good[1] is not None
    header, payload = decode(good[0], key=KEY)
    other_key = b"".join(bytes(p) for p in encode(header, payload, OTHER))  # same identity, other key
    changed = bytearray(good[0])
    changed[HEADER_SIZE + 5] ^= 0x10
    for blob, reason in ((other_key, "mac"), (good[1], "identity"), (bytes(changed), "mac")):
        store.put_many([(state.key, [blob])])
        before = vault.counters.rejected[reason]
        loaded = vault.load(refs)
        assert loaded.failed == {state: reason} and state not in loaded.payloads
        assert vault.counters.rejected[reason] == before + 1
        assert store.exists_many([state.key]) == [False]
        assert vault.lookup(hashes, 65) == 16  # the boundary its state served is a miss now
        assert save_with(vault, PROMPT, [16, 40]) == [16, 40]
        assert vault.load(refs).ok


def test_encrypted_objects_decrypt_in_place_and_tell_their_form() -> None:
    blob = bytearray(sealed())
    assert blob[4] == ENCRYPTED_VERSION and is_sealed(bytes(blob)) and PAYLOAD not in blob
    assert encode(HEADER, PAYLOAD, KEY)[1] != PAYLOAD
    view = memoryview(blob)
    header, payload = decode(view, HEADER, KEY, out=view[HEADER_SIZE:])
    assert header == HEADER and bytes(payload) == bytes(blob[HEADER_SIZE:]) == PAYLOAD  # in place
    whole = memoryview(bytearray(HEADER_SIZE + len(PAYLOAD)))
    encode_into(HEADER, PAYLOAD, whole, KEY)  # one pass into the store's memory
    assert decode(bytes(whole), HEADER, KEY)[1] == PAYLOAD and bytes(whole[HEADER_SIZE:]) != PAYLOAD


def test_a_sealed_object_of_an_earlier_release_is_not_accepted() -> None:
    """A keyed namespace reads encrypted objects only: a GMAC-sealed object (readable payload)
    is refused; under the reader's own keys it is proved wrong (the fingerprint names the
    encrypted form, so no release writes a sealed one there), under another's it is left."""
    head = bytearray(HEADER_SIZE)
    head[:100] = sealed()[:100]
    head[4:6], head[9] = (1).to_bytes(2, "little"), 1  # version 1, the sealed flag
    for key, reason in ((KEY, "unencrypted"), (None, "sealed")):
        with pytest.raises(IntegrityError) as e:
            decode(bytes(head) + PAYLOAD, HEADER, key)
        assert e.value.reason == reason
        assert proved_wrong(reason, own_fingerprint=True) and not proved_wrong(reason, own_fingerprint=False)
    assert Vault(MemoryStore(), layout(), "tenantA", KEY).fingerprint != Vault(
        MemoryStore(), layout(), "tenantA").fingerprint


def test_stats_and_summaries_without_the_key_count_encrypted_objects() -> None:
    store, _ = tenant_a()
    n = len(list(store.scan()))
    summary = summarize(store)  # no key: counted by their names and sizes, never read
    assert summary.objects == n > 0 and summary.records == 2 and summary.bytes == store.stats().bytes


def test_samples_of_a_keyed_namespace_are_sealed() -> None:
    store, vault_a = tenant_a()
    record = vault_a.keys.record(vault_a.hashes(PROMPT)[4])
    sample = VerifySample(PROMPT, 40, record, [1, 2, 3], 1.0, "h:1")
    assert write_sample(store, sample, KEY)
    (name, blob), = [(k, b) for k, b in zip(*_samples(store), strict=True)]
    assert b"[0,1,2" not in blob  # the prompt is not readable in the store
    assert list(pending_samples(store)) == []  # a watcher without the secret leaves it alone
    assert list(pending_samples(store, "tenantA", KEY)) == [(name, sample)]
    assert list(pending_samples(store, "tenantA", OTHER)) == [(name, None)]
    # a forged plain sample (which would make a watcher remove any record it names)
    store.put_many([(name, [sample.encode()])])
    assert list(pending_samples(store, "tenantA", KEY)) == [(name, None)]


def _samples(store: MemoryStore) -> tuple[list[str], list[bytes]]:
    keys = [k for k, _ in store.scan("tenantA/") if "/v/" in k]
    return keys, [b or b"" for b in store.get_many(keys)]


def test_plain_namespaces_keep_todays_format() -> None:
    """Objects of a namespace without a secret are byte-compatible with earlier versions:
    the payload checksum at offset 94, the header checksum over bytes 0..119 at 120."""
    blob = b"".join(bytes(p) for p in encode(HEADER, PAYLOAD))
    assert blob[9] == 0
    assert int.from_bytes(blob[94:102], "little") == checksum(PAYLOAD)
    assert int.from_bytes(blob[120:128], "little") == checksum(blob[:120])


def test_serve_names_the_secret_and_never_prints_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import shlex

    from typer.testing import CliRunner

    from prefixvault.cli import app

    monkeypatch.setenv("PV_TEST_SECRET", SECRET.decode())
    res = CliRunner().invoke(app, ["serve", "/models/m", "--namespace", "tenantA", "--secret-env",
                                   "PV_TEST_SECRET", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert SECRET.decode() not in res.output
    cmd = shlex.split(res.output)
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    extra = ktc["kv_connector_extra_config"]
    assert extra["namespace_secret_env"] == "PV_TEST_SECRET"
    assert ConnectorSettings.from_extra(extra).namespace_key() == KEY
