"""Tenants per request (issue 48, deliverable 1): in a namespace with a secret, a request's
``cache_salt`` selects a tenant key; one engine serving two salts keeps them apart as two
engines with two secrets would.

The attacker here holds what every request of the engine shares: the namespace's secret (an
unsalted request, another salt's request, an audit or watcher given the secret) and read and
write access to the store. It does not hold the salt it attacks. Before tenant keys, every
salted object was encrypted under the namespace's key: such an attacker read every tenant's KV
and states, matched a guessed prompt's payloads, and wrote objects another tenant's loads
accepted (the tests marked *attack* fail on that code).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from test_tenancy import GUESS, KEY, PROMPT, guessed_payloads, model
from test_vault import BS, layout

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import FLAG_TENANT, IntegrityError, ObjectKind, decode, encode
from prefixvault.inventory import audit
from prefixvault.keys import ExtraKeys, PromptTokens, chain_hashes
from prefixvault.samples import VerifySample, pending_samples, write_sample
from prefixvault.stores import Store
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey, TenantKeys
from prefixvault.vault import Vault

ALICE, BOB = "alice's salt", "bob's salt"
BOB_PROMPT = list(range(1000, 1064))  # shares no block with PROMPT


def extra(salt: str | None) -> ExtraKeys:
    return ExtraKeys(cache_salt=salt)


def save_as(vault: Vault, salt: str | None, tokens: list[int], boundaries: list[int]) -> list[int]:
    """A request with ``salt`` saves and publishes ``tokens`` at ``boundaries`` (payloads: the
    deterministic stand-in for the model, ``test_tenancy.model``)."""
    hashes = vault.hashes(tokens, extra(salt))
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    d = plan_saves(vault.layout, len(tokens), tables, [StateCapture(2, b, 200 + b, 1) for b in boundaries],
                   step=1)
    acks = vault.save(0, hashes, d.publishable, model(tokens), salt=salt)
    return sorted(b for b, why in vault.publish(hashes, acks, salt=salt).items() if why is None)


def restores(vault: Vault, salt: str | None, tokens: list[int]) -> int:
    """What a request with ``salt`` asking ``tokens`` + one more restores (0: a miss)."""
    hashes = vault.hashes([*tokens, 7], extra(salt))
    hit = vault.lookup(hashes, len(tokens) + 1, salt=salt)
    return hit if hit and vault.load(vault.needed(hashes, hit, salt=salt)).ok else 0


def alice_cached() -> tuple[MemoryStore, Vault]:
    store = MemoryStore()
    vault = Vault(store, layout(), "tenantA", KEY)
    assert save_as(vault, ALICE, PROMPT, [16, 40]) == [16, 40]
    return store, vault


def stored(store: Store) -> dict[str, bytes]:
    keys = [k for k, _ in store.scan()]
    return {k: b for k, b in zip(keys, store.get_many(keys), strict=True) if b is not None}


def tenant_objects(store: Store) -> dict[str, bytes]:
    """Every object, record and tail index of a request (all but the namespace's layout and
    deny-list)."""
    return {k: b for k, b in stored(store).items() if k.split("/")[2] in ("b", "s", "r", "t")}


# -- keys ------------------------------------------------------------------------------------


def test_tenant_keys_are_derived_apart_and_bounded() -> None:
    alice = KEY.tenant(ALICE)
    assert alice.is_tenant and alice.namespace == KEY.namespace
    keys = [KEY, alice, KEY.tenant(BOB), KEY.tenant(""),
            NamespaceKey.derive(b"tenant-a-secret-0123456789abcdef", "tenantB").tenant(ALICE)]
    assert len({k.hash_key for k in keys}) == len({k.mac_key for k in keys}) == len(keys)
    assert KEY.tenant(ALICE) == alice  # the same on every process and rank
    assert ALICE not in repr(alice) and alice.mac_key.hex() not in repr(alice)
    with pytest.raises(ValueError):
        alice.tenant(BOB)  # a tenant derives no tenants
    cache = TenantKeys(KEY, capacity=2)
    assert cache.get(None) is KEY and TenantKeys(None).get(ALICE) is None
    assert cache.get(ALICE) == alice and cache.get(ALICE) is cache.get(ALICE)
    cache.get(BOB), cache.get("third")
    assert len(cache._derived) == 2 and cache.get(ALICE) == alice  # evicted, derived again alike
    assert ALICE not in repr(cache)


# -- two salts on one vault ------------------------------------------------------------------------


def test_attack_another_salt_or_none_cannot_read_a_tenants_objects() -> None:
    """Every object, record and tail index alice's request stored: the namespace's key (an
    unsalted request's, an audit's) and bob's key read none of them; alice restores."""
    store, vault = alice_cached()
    objects = tenant_objects(store)
    assert {k.split("/")[2] for k in objects} >= {"b", "s", "r"}
    for name, blob in objects.items():
        with pytest.raises(IntegrityError) as e:
            decode(blob, key=KEY)
        assert e.value.reason == "tenant", name
        with pytest.raises(IntegrityError) as e:
            decode(blob, key=KEY.tenant(BOB))
        assert e.value.reason == "mac", name
        assert blob[9] & FLAG_TENANT  # (the flag says a salt was used, never which)
        decode(blob, key=KEY.tenant(ALICE))
    assert restores(vault, ALICE, PROMPT) == 40


def test_attack_a_guessed_prompt_under_another_salt_matches_no_payload() -> None:
    """The issue's membership inference, by a party holding the namespace's secret: decrypt
    every stored object it can (with the namespace's key and its own salt's) and compare with
    the KV of guessed prompts. Alice's prompt matches nothing, as the one never sent."""
    store, vault = alice_cached()
    assert save_as(vault, BOB, BOB_PROMPT, [16, 40]) == [16, 40]  # bob's own objects it may read
    readable: list[bytes] = []
    for blob in stored(store).values():
        for key in (KEY, KEY.tenant(BOB)):
            with contextlib.suppress(IntegrityError):
                readable.append(bytes(decode(blob, key=key)[1]))
    sent = guessed_payloads(vault, PROMPT, 40)
    assert [p for p in sent if p in readable] == []
    # the control: bob's own payloads are readable to bob, so the comparison can succeed
    assert all(p in readable for p in guessed_payloads(vault, BOB_PROMPT, 40))


def test_attack_an_object_forged_with_the_namespace_key_is_refused_counted_removed() -> None:
    """A writer with the namespace's secret replaces alice's state with its own bytes under
    the header alice's load expects, sealed with the namespace's key, or with its own salt's:
    its tag does not verify under alice's key: a miss, counted, removed, never served; alice's
    next save writes it again."""
    store, vault = alice_cached()
    hashes = vault.hashes([*PROMPT, 7], extra(ALICE))
    refs = vault.needed(hashes, 40, salt=ALICE)
    state = next(r for r in refs if r.kind is ObjectKind.STATE)
    evil = np.full(vault.expected_header(state).length, 0x55, np.uint8).tobytes()
    for i, forger in enumerate((KEY, KEY.tenant(BOB))):
        store.put_many([(state.key, [b"".join(bytes(p) for p in encode(vault.expected_header(state), evil,
                                                                          forger))])])
        loaded = vault.load(refs)
        assert not loaded.ok and loaded.failed == {state: "mac"}
        assert vault.counters.rejected["mac"] == i + 1
        assert store.get_many([state.key]) == [None]
        assert save_as(vault, ALICE, PROMPT, [16, 40]) == [16, 40]
        assert restores(vault, ALICE, PROMPT) == 40


def test_another_salt_or_none_finds_nothing_by_lookup() -> None:
    """Lookups of alice's prompt under bob's salt or none are misses (``no_record``), as under
    another secret; bob's own cached prompt is bob's hit, never alice's. (The salt already
    entered the hash chain before tenant keys: this guards it, it proves no new attack.)"""
    store, vault = alice_cached()
    assert save_as(vault, BOB, BOB_PROMPT, [16, 40]) == [16, 40]
    before = dict(vault.counters.misses)
    assert restores(vault, BOB, PROMPT) == 0 and restores(vault, None, PROMPT) == 0
    assert vault.counters.misses["no_record"] - before.get("no_record", 0) == 2
    assert restores(vault, ALICE, BOB_PROMPT) == 0
    assert restores(vault, ALICE, PROMPT) == 40 and restores(vault, BOB, BOB_PROMPT) == 40
    other_engine = Vault(store, layout(), "tenantA", KEY)  # another engine, same secret and salt
    assert restores(other_engine, ALICE, PROMPT) == 40
    # a salt given beside a prompt must be the prompt's
    with pytest.raises(ValueError, match="salt"):
        vault.lookup(vault.hashes(PROMPT, extra(ALICE)), 64, prompt=PromptTokens(PROMPT, extra(ALICE)),
                     salt=BOB)


def test_unsalted_requests_use_the_namespace_key_as_before() -> None:
    """No salt: the hashes and the form are the namespace's exactly as before tenants (stores
    written by an earlier release stay readable), and a tenant's key reads none of it."""
    store = MemoryStore()
    vault = Vault(store, layout(), "tenantA", KEY)
    assert vault.hashes(PROMPT) == chain_hashes(PROMPT, BS, None, (), KEY.hash_key)
    assert save_as(vault, None, PROMPT, [16, 40]) == [16, 40]
    for blob in tenant_objects(store).values():
        assert not blob[9] & FLAG_TENANT
        decode(blob, key=KEY)
        with pytest.raises(IntegrityError, match="mac"):
            decode(blob, key=KEY.tenant(ALICE))
    assert restores(vault, None, PROMPT) == 40 and restores(vault, ALICE, PROMPT) == 0


def test_without_a_secret_a_salt_only_keys_the_chain() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    assert vault.key_for(ALICE) is None
    assert save_as(vault, ALICE, PROMPT, [16, 40]) == [16, 40]
    for blob in tenant_objects(store).values():
        decode(blob)  # plain, as before
    assert restores(vault, ALICE, PROMPT) == 40
    assert restores(vault, BOB, PROMPT) == 0 and restores(vault, None, PROMPT) == 0


def test_tail_boundaries_of_a_tenant_are_found_by_its_salt_only() -> None:
    """A tail boundary (a prompt's end inside a block; in the first block, its tail index is
    named by the chain's seed) is listed in a tail index sealed under the tenant's key; its
    lookups read it, another salt's find nothing."""
    for boundary in (21, 5):
        store = MemoryStore()
        vault = Vault(store, layout(), "tenantA", KEY)
        n = -(-boundary // BS)
        tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
        d = plan_saves(vault.layout, boundary, tables, [StateCapture(2, boundary, 200 + boundary, 1)],
                       step=1, candidates=[boundary])
        hashes = vault.prefix_hashes(PROMPT[:boundary], extra(ALICE))
        acks = vault.save(0, hashes, d.publishable, model(PROMPT), salt=ALICE)
        assert vault.publish(hashes, acks, seed=vault.seed(extra(ALICE)), salt=ALICE) == {boundary: None}
        tails = [b for k, b in stored(store).items() if k.split("/")[2] == "t"]
        assert len(tails) == 1 and decode(tails[0], key=KEY.tenant(ALICE))
        ask = [*PROMPT[:boundary], 7]
        for salt, want in ((ALICE, boundary), (BOB, 0), (None, 0)):
            prompt = PromptTokens(ask, extra(salt))
            assert vault.lookup(vault.hashes(ask, extra(salt)), len(ask), prompt=prompt) == want, salt
        assert vault.counters.rejected == {}  # nobody met alice's index as a bad one


def test_an_audit_with_the_namespace_key_keeps_every_tenants_bytes() -> None:
    """An audit given the namespace's secret (not the salts) cannot check a tenant's records:
    unverifiable, never removed, even with ``repair``; the namespace's own records it checks."""
    store, vault = alice_cached()
    assert save_as(vault, None, GUESS, [16, 40]) == [16, 40]
    before = set(stored(store))
    report = audit(store, repair=True, keys={"tenantA": KEY})
    assert report.findings == [] and report.unreached_bad == []
    assert len(report.unverifiable) == 2  # alice's two records
    assert set(stored(store)) == before
    assert restores(vault, ALICE, PROMPT) == 40 and restores(vault, None, GUESS) == 40


def test_a_tenants_samples_are_sealed_under_its_key() -> None:
    """A sample holds its request's prompt: under alice's key, read by a watcher given alice's
    salt only; the namespace's watcher and bob's leave it alone (never remove it)."""
    store, vault = alice_cached()
    record = vault.keys.record(vault.hashes(PROMPT, extra(ALICE))[4])
    sample = VerifySample(PROMPT, 40, record, [1, 2], 0.0, "h:1")
    assert write_sample(store, sample, vault.key_for(ALICE))
    raw = [b for k, b in stored(store).items() if "/v/" in k]
    assert len(raw) == 1 and b"[0,1,2" not in raw[0]
    assert list(pending_samples(store, "tenantA", KEY)) == []
    assert list(pending_samples(store, "tenantA", KEY.tenant(BOB))) == []
    assert list(pending_samples(store, "tenantA", None)) == []
    assert [s for _, s in pending_samples(store, "tenantA", KEY.tenant(ALICE))] == [sample]
    # the quarantine of alice's record reads it with alice's key
    removed = vault.quarantine(record, ALICE)
    assert record in removed and restores(vault, ALICE, PROMPT) == 16
