"""The hot set of recent loads: bounded by bytes, least recently used first out; a vault with
one serves repeated loads without the store, and still refuses bytes a quarantine proved
wrong. Real vault and memory store."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from test_vault import fill, layout

from prefixvault.hotset import HotSet
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault

TOKENS = list(range(64))


def test_least_recently_used_go_first_and_nothing_larger_than_the_budget_is_kept() -> None:
    hot = HotSet(10)
    hot.put("a", b"1234")
    hot.put("b", b"1234")
    assert hot.get("a") == b"1234"  # "a" is now the most recent
    hot.put("c", b"1234")  # 12 bytes > 10: "b" goes
    assert hot.get("b") is None and hot.get("a") is not None and hot.nbytes == 8
    hot.put("d", b"x" * 11)
    assert hot.get("d") is None and hot.nbytes == 8
    hot.discard("a")
    assert hot.nbytes == 4 and len(hot) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 12)), max_size=40), st.integers(0, 30))
def test_the_budget_always_holds(puts: list[tuple[str, int]], capacity: int) -> None:
    hot = HotSet(capacity)
    for key, n in puts:
        hot.put(key, b"x" * n)
        assert hot.nbytes <= capacity
        assert hot.nbytes == sum(len(hot._items[k]) for k in hot._items)


class CountingGets(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.read: list[str] = []

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        self.read.extend(keys)
        return super().get_into(keys, buffers)


def test_a_vault_with_a_hot_set_reads_a_shared_prefix_from_the_store_once() -> None:
    store = CountingGets()
    fill(Vault(store, layout()), TOKENS, [16, 40])
    vault = Vault(store, layout(), hot_bytes=1 << 20)
    hashes = vault.hashes(TOKENS)
    first = vault.load(vault.needed(hashes, 40))
    assert first.ok and len(store.read) == len(first.payloads)
    store.read.clear()
    again = vault.load(vault.needed(hashes, 40))
    assert again.ok and store.read == []  # nothing read again
    assert {r.key: bytes(p) for r, p in again.payloads.items()} == \
        {r.key: bytes(p) for r, p in first.payloads.items()}
    known = {r.key for r in first.payloads}
    shorter_refs = vault.needed(hashes, 16)
    shorter = vault.load(shorter_refs)  # only what the longer load did not read (its state, its window)
    assert shorter.ok and sorted(store.read) == sorted(r.key for r in shorter_refs if r.key not in known)
    assert vault.counters.hot_keys == len(again.payloads) + len(known & {r.key for r in shorter_refs})


def test_a_quarantine_reaches_objects_already_in_the_hot_set() -> None:
    store = MemoryStore()
    fill(Vault(store, layout()), TOKENS, [40])
    vault = Vault(store, layout(), hot_bytes=1 << 20)
    hashes = vault.hashes(TOKENS)
    refs = vault.needed(hashes, 40)
    assert vault.load(refs).ok
    state = next(r for r in refs if r.kind.name == "STATE")
    vault.quarantine(vault.keys.record(hashes[4]))  # the boundary's bytes proved wrong elsewhere
    again = vault.load(refs)
    assert not again.ok and state in again.failed  # not served from the set: refused


def test_bytes_read_again_are_counted_without_a_hot_set() -> None:
    """What an operator reads to size ``load_cache_mib``: bytes read again for objects the
    worker read before."""
    store = MemoryStore()
    fill(Vault(store, layout()), TOKENS, [40])
    vault = Vault(store, layout())
    refs = vault.needed(vault.hashes(TOKENS), 40)
    assert vault.load(refs).ok and vault.counters.reread_bytes == 0
    first = vault.counters.get_bytes
    assert vault.load(refs).ok and vault.counters.reread_bytes == first


def test_kv_blocks_a_quarantine_removed_are_not_served_from_a_hot_set_that_held_them() -> None:
    """A quarantine elsewhere (``watch``) removes the segment's KV blocks from the store without
    listing them; a worker whose hot set held them stops serving them once it sees the
    deny-list grow (its next periodic read)."""
    store = MemoryStore()
    fill(Vault(store, layout()), TOKENS, [40])
    worker = Vault(store, layout(), hot_bytes=1 << 20)
    hashes = worker.hashes(TOKENS)
    refs = worker.needed(hashes, 40)
    assert worker.load(refs).ok
    Vault(store, layout()).quarantine(worker.keys.record(hashes[4]))
    gone = [r for r in refs if r.kind.name != "STATE" and store.get_many([r.key])[0] is None]
    assert gone, "the quarantine removed none of the segment's KV blocks"
    worker._deny.refresh(force=True)  # (what its next read of the deny-list does)
    again = worker.load(gone)
    assert all(again.failed.get(r) == "missing" for r in gone), again.failed
