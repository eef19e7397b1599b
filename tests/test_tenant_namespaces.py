"""Each tenant's keys under a namespace of its own (``tenant_namespaces``, issue 48): a store
bounds each tenant's share as it bounds a namespace's (the local store's ``namespace_share``),
so one tenant filling the store evicts its own objects first; everything else about tenants
(keys, sealing, quarantine, tails) works as without it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_tenancy import KEY, PROMPT, SECRET
from test_vault import BS, layout

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.explain import explain
from prefixvault.inventory import audit
from prefixvault.keys import ExtraKeys, KeySpace, PromptTokens
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.objects import ObjectRef
from prefixvault.stores import Store, open_store
from prefixvault.stores.base import namespace_of
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings

ALICE, BOB = "alice's salt", "bob's salt"
NS = "tenantA"  # (KEY's namespace)


def payloads(lay: CacheLayout, tokens: list[int]) -> Callable[[ObjectRef, int], bytes]:
    """Deterministic bytes of each object of ``tokens``' prefix, sized to its group."""
    def read(ref: ObjectRef, block_id: int) -> bytes:
        n = lay.groups[ref.group].nbytes(ref.rank)
        seed = np.asarray(tokens[: ref.tokens], dtype="<i8").tobytes() + bytes([ref.kind, ref.group])
        return (hashlib.blake2b(seed).digest() * (n // 64 + 1))[:n]
    return read


def save_as(vault: Vault, salt: str | None, tokens: list[int], boundaries: list[int]) -> list[int]:
    """A request with ``salt`` saves and publishes ``tokens`` at ``boundaries``."""
    lay = vault.layout
    extra = ExtraKeys(cache_salt=salt)
    hashes = vault.prefix_hashes(tokens, extra)  # (a tail's last hash is its tail hash)
    n = -(-len(tokens) // BS)
    state = next(i for i, g in enumerate(lay.groups) if g.is_state)
    tables = {gi: list(range(1 + 100 * gi, 1 + 100 * gi + n)) for gi, g in enumerate(lay.groups)}
    d = plan_saves(lay, len(tokens), tables, [StateCapture(state, b, 900 + b, 1) for b in boundaries], step=1)
    acks = vault.save(0, hashes, d.publishable, payloads(lay, tokens), salt=salt)
    published = vault.publish(hashes, acks, seed=vault.seed(extra), salt=salt)
    return sorted(b for b, why in published.items() if why is None)


def restores(vault: Vault, salt: str | None, tokens: list[int]) -> int:
    """What a request with ``salt`` asking ``tokens`` + one more restores (0: a miss)."""
    hashes = vault.hashes([*tokens, 7], ExtraKeys(cache_salt=salt))
    hit = vault.lookup(hashes, len(tokens) + 1, salt=salt)
    return hit if hit and vault.load(vault.needed(hashes, hit, salt=salt)).ok else 0


def keys_of(store: Store) -> list[str]:
    return [k for k, _ in store.scan()]


def test_each_tenant_s_keys_are_under_a_namespace_of_its_own() -> None:
    """Two salts and no salt on one engine: each salt's objects, records and tail indexes are
    under ``{ns}.{its tag}``, the unsalted request's and the layout under ``{ns}``; each
    restores its own prefix and no other's; the tag names the tenant's key, not the salt."""
    store = MemoryStore()
    vault = Vault(store, layout(), NS, KEY, tenant_namespaces=True)
    assert save_as(vault, ALICE, PROMPT, [16, 40]) == [16, 40]
    tags = {s: KEY.tenant(s).tag for s in (ALICE, BOB)}
    alice_keys = set(keys_of(store))
    assert {namespace_of(k) for k in alice_keys} == {NS, f"{NS}.{tags[ALICE]}"}
    assert {k.split("/")[2] for k in alice_keys if namespace_of(k) == NS} == {f"layout.{KEY.tag}"}
    assert save_as(vault, BOB, PROMPT, [24]) == [24]
    assert save_as(vault, None, PROMPT, [32]) == [32]
    by_ns: dict[str, set[str]] = {}
    for k in keys_of(store):
        by_ns.setdefault(namespace_of(k), set()).add(k.split("/")[2])
    assert by_ns == {NS: {"b", "s", "r", f"layout.{KEY.tag}"}, f"{NS}.{tags[ALICE]}": {"b", "s", "r"},
                     f"{NS}.{tags[BOB]}": {"b", "s", "r"}}
    assert ALICE not in str(by_ns) and tags[ALICE] != tags[BOB]
    assert [restores(vault, s, PROMPT) for s in (ALICE, BOB, None, "carol")] == [40, 24, 32, 0]
    # An engine without tenant_namespaces names the salted requests' keys in the namespace: it
    # finds none of them (the setting is the whole deployment's, as the namespace is).
    plain = Vault(store, layout(), NS, KEY)
    assert [restores(plain, s, PROMPT) for s in (ALICE, BOB, None)] == [0, 0, 32]


def test_a_tail_and_a_quarantine_stay_in_the_tenant_s_namespace() -> None:
    """A tail boundary (a prompt's exact end) of a tenant is indexed and found under its
    namespace; taking it out removes its record and state there and lists them in the
    namespace's deny-list, which refuses the same bytes written again."""
    store = MemoryStore()
    vault = Vault(store, layout(), NS, KEY, tenant_namespaces=True)
    tokens = PROMPT[:45]
    assert save_as(vault, ALICE, tokens, [40, 45]) == [40, 45]
    tenant = f"{NS}.{KEY.tenant(ALICE).tag}/"
    assert any(k.startswith(tenant) and k.split("/")[2] == "t" for k in keys_of(store))
    hashes = vault.hashes([*tokens, 7], ExtraKeys(cache_salt=ALICE))
    prompt = PromptTokens([*tokens, 7], ExtraKeys(cache_salt=ALICE))
    assert vault.lookup(hashes, 46, prompt=prompt) == 45
    record = vault.record_key(vault.prefix_hashes(tokens, ExtraKeys(cache_salt=ALICE))[-1], ALICE)
    assert record.startswith(tenant) and record in keys_of(store)
    removed = vault.quarantine(record, ALICE)
    assert record in removed and all(k.startswith(tenant) for k in removed)
    assert vault.deny.entries and all(name.startswith(tenant) for name in vault.deny.entries)
    assert vault.lookup(hashes, 46, prompt=prompt) == 40
    assert save_as(vault, ALICE, tokens, [45]) == []  # the same bytes written again: refused
    assert restores(vault, ALICE, tokens) == 40


def big_layout() -> CacheLayout:
    """125 KiB KV blocks (in 128 KiB slots) and 16 KiB states: a working set of a few prompts is megabytes."""
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, BS, 2000), "float32")], 1)
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((64, 64), "float32")], 1)
    return CacheLayout(model="big", block_size=BS, groups=(attn, state), tp_size=1)


def prompt(i: int) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * BS))


@pytest.mark.parametrize("bounded", [True, False])
def test_a_tenant_filling_the_store_leaves_the_other_s_working_set(tmp_path: Path, bounded: bool) -> None:
    """Two tenants of one engine on a local store with ``namespace_share=50%``: bob caches a
    working set within his share, then alice saves twenty times the store's capacity. With
    ``tenant_namespaces`` every one of bob's prompts still restores whole and alice's newest
    do too (she evicts her own oldest); without it (the control) the store's one recency
    takes bob's."""
    uri = f"local://{tmp_path}/s?capacity=16MiB&namespace_share=50%"
    with open_store(uri) as store:
        vault = Vault(store, big_layout(), NS, KEY, tenant_namespaces=bounded)
        mine = [prompt(i) for i in range(8)]  # 8 x (4 x 128 KiB + 16 KiB): about 4 MiB
        for p in mine:
            assert save_as(vault, BOB, p, [4 * BS]) == [4 * BS]
        assert [restores(vault, BOB, p) for p in mine] == [4 * BS] * 8
        theirs = [prompt(100 + i) for i in range(600)]  # 600 x 528 KiB: about 20 x 16 MiB
        for p in theirs:
            save_as(vault, ALICE, p, [4 * BS])
        kept = [restores(vault, BOB, p) for p in mine]
        if bounded:
            assert kept == [4 * BS] * 8, "bob lost his working set to alice's saves"
            assert [restores(vault, ALICE, p) for p in theirs[-3:]] == [4 * BS] * 3
            budget = store.stats().namespace_budget
            used: dict[str, int] = {}
            for k, size in store.scan():
                used[namespace_of(k)] = used.get(namespace_of(k), 0) + size
            assert budget and max(used.values()) <= budget and len(used) == 3, used
        else:
            assert kept.count(0) == 8, kept


def test_an_audit_keeps_every_tenant_s_bytes() -> None:
    """``audit --repair`` with the namespace's secret: a tenant's namespace has no layout of
    its own and its bytes are sealed with keys the audit does not hold: reported, never
    removed."""
    store = MemoryStore()
    vault = Vault(store, layout(), NS, KEY, tenant_namespaces=True)
    save_as(vault, ALICE, PROMPT, [16, 40])
    before = sorted(keys_of(store))
    report = audit(store, repair=True, keys={NS: KEY})
    assert sorted(keys_of(store)) == before
    assert not report.broken_records and not report.unreached_bad
    assert restores(vault, ALICE, PROMPT) == 40


def test_explain_finds_a_tenant_s_hit_in_its_namespace() -> None:
    store = MemoryStore()
    vault = Vault(store, layout(), NS, KEY, tenant_namespaces=True)
    save_as(vault, ALICE, PROMPT, [16, 40])
    asked = [*PROMPT, 7]
    assert explain(store, asked, NS, KEY, ALICE, tenant_namespaces=True).layouts[0].restorable == 40
    assert explain(store, asked, NS, KEY, ALICE).layouts[0].restorable == 0


def test_a_tenant_s_namespace_is_a_key_s_not_a_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting needs a secret (a tenant is a key) and room for the tag in the name."""
    monkeypatch.setenv("PV_TEST_SECRET", SECRET.decode())
    with pytest.raises(ValueError, match="secret"):
        KeySpace(NS, bytes(8), tenant_namespaces=True)
    with pytest.raises(ValueError, match="namespace_secret"):
        ConnectorSettings.from_extra({"tenant_namespaces": True})
    env = {"namespace_secret_env": "PV_TEST_SECRET", "tenant_namespaces": True}
    with pytest.raises(ValueError, match="at most 47"):
        ConnectorSettings.from_extra({**env, "namespace": "n" * 48})
    with pytest.raises(ValueError, match="verify_sample"):
        ConnectorSettings.from_extra({**env, "verify_sample": 0.5})
    with pytest.raises(ValueError, match="tenant_namespaces"):
        ConnectorSettings.from_extra({**env, "tenant_namespaces": "yes please"})
    assert ConnectorSettings.from_extra({**env, "namespace": "n" * 47}).tenant_namespaces
    assert KeySpace(NS, bytes(8), KEY.tag, tenant_namespaces=True).of(KEY).prefix.startswith(f"{NS}/")
    tenant = KeySpace(NS, bytes(8), KEY.tag, tenant_namespaces=True).of(KEY.tenant(ALICE))
    assert tenant.prefix.startswith(f"{NS}.{KEY.tenant(ALICE).tag}/")
    assert tenant.layout() == KeySpace(NS, bytes(8), KEY.tag).layout()
    assert NamespaceKey.derive(SECRET, NS).tenant(ALICE).tag == KEY.tenant(ALICE).tag


def test_serve_passes_tenant_namespaces_to_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from prefixvault.cli import app

    res = CliRunner().invoke(app, ["serve", "m", "--tenant-namespaces", "--dry-run"])
    assert res.exit_code == 2 and "namespace_secret" in res.output, res.output
    monkeypatch.setenv("PV_TEST_SECRET", SECRET.decode())
    res = CliRunner().invoke(app, ["serve", "m", "--secret-env", "PV_TEST_SECRET", "--tenant-namespaces",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output
    assert '"tenant_namespaces": true' in res.output and SECRET.decode() not in res.output
