"""A rolling upgrade keeps the shared cache (issue 32, deliverable 4).

Engines of two releases share one store while an upgrade rolls. Before, a load deleted every
object it could not decode, a version it did not know included, and neither the codec nor the
record version named the keys: the first codec change would have made old and new engines
delete each other's objects. And a keyed namespace's layout object sat at the same key as an
unkeyed engine's of the same namespace name, so each overwrote the other's.
"""

from __future__ import annotations

import pytest
from test_quarantine import PROMPT, save
from test_vault import layout

from prefixvault import codec
from prefixvault.codec import IntegrityError, ObjectKind, decode
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault

ASK = [*PROMPT, 999]


def _next_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a later release with a new object format looks like to this one."""
    monkeypatch.setattr(codec, "VERSION", max(codec.VERSION, codec.ENCRYPTED_VERSION) + 1)


def _hit(vault: Vault) -> tuple[int, bool]:
    hashes = vault.hashes(ASK)
    hit = vault.lookup(hashes, len(ASK))
    return hit, vault.load(vault.needed(hashes, hit)).ok if hit else False


def test_two_codec_versions_on_one_store_use_their_own_keys_and_lose_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    old = Vault(store, layout())
    save(old, PROMPT, [16, 32, 48, 64])
    before = {k for k, _ in store.scan()}
    with monkeypatch.context() as m:
        _next_release(m)
        new = Vault(store, layout())
        assert new.fingerprint != old.fingerprint  # the format names every key
        assert _hit(new) == (0, False)  # the old release's objects are not the new one's
        save(new, PROMPT, [16, 32, 48, 64])
        assert _hit(new) == (64, True)
    assert _hit(old) == (64, True)
    after = {k for k, _ in store.scan()}
    assert before < after  # both caches kept, side by side


def test_an_object_of_another_version_under_its_own_key_is_proved_wrong_and_healed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases never meet under one key (the fingerprint names the format), so an object of
    another version under this release's key is a flipped bit or a forged write: kept, it failed
    every hit through it forever. A load removes it, the next save writes it again, and audit's
    repair removes it too; under another release's key the same bytes are that release's, and
    stay (``codec.proved_wrong``)."""
    from prefixvault.inventory import audit

    store = MemoryStore()
    vault = Vault(store, layout())
    save(vault, PROMPT, [16, 32, 48, 64])
    hashes = vault.hashes(ASK)
    refs = vault.needed(hashes, 48)
    state = next(r for r in refs if r.kind is ObjectKind.STATE)
    good = bytes(store.get_many([state.key])[0] or b"")
    blob = bytearray(good)
    blob[4] += 8  # the version field: one flipped bit (to a version this release does not read)
    store.put_many([(state.key, [bytes(blob)])])
    with pytest.raises(IntegrityError) as info:
        decode(bytes(blob))
    assert info.value.reason == "version" and "version" not in codec.PROVED_WRONG
    assert codec.proved_wrong("version", own_fingerprint=True)
    assert not codec.proved_wrong("version", own_fingerprint=False)
    assert vault.load(refs).failed == {state: "version"}
    assert store.exists_many([state.key]) == [False]  # removed by the load that found it
    save(vault, PROMPT, [16, 32, 48, 64])  # the next producer writes it fresh
    assert vault.load(refs).ok and bytes(store.get_many([state.key])[0] or b"") == good
    store.put_many([(state.key, [bytes(blob)])])  # and again, for audit to find
    report = audit(store, repair=True)
    assert any(f.object_key == state.key and f.problem == "version" for f in report.findings), report
    assert store.exists_many([state.key]) == [False]
    store.put_many([(state.key, [bytes(len(blob))])])  # no object at all: proved wrong, removed
    assert vault.load(refs).failed == {state: "format"}
    assert store.exists_many([state.key]) == [False]


def test_a_keyed_namespace_keeps_its_own_layout_and_deny_list() -> None:
    store = MemoryStore()
    key = NamespaceKey.derive(b"tenant-a-secret-0123456789abcdef", "tenantA")
    keyed = Vault(store, layout(), "tenantA", key)
    plain = Vault(store, layout(), "tenantA")  # an engine without the secret, same name
    assert keyed.keys.layout() != plain.keys.layout() and keyed.deny_key() != plain.deny_key()
    assert key.tag in keyed.keys.layout() and len(key.tag) == 16
    keyed.keep_layout()
    plain.keep_layout()
    keyed._stored_layout.verified = None  # due for a read again
    keyed.keep_layout()
    assert keyed.counters.layout_writes == 1  # its own copy was never overwritten
    assert {k for k, _ in store.scan()} == {keyed.keys.layout(), plain.keys.layout()}
    from prefixvault.inventory import load_layouts

    found = load_layouts(store, {"tenantA": key})
    assert found[("tenantA", keyed.fingerprint.hex())] is not None
