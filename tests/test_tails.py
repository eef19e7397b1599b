"""Tail boundaries: prefixes that end inside a block (a prompt's exact end, a chunk that ended
mid-block), named by their tail hash, listed in their block boundary's tail index, published and
found like any boundary. Real vault, memory store; no engine."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_vault import BS, CountingStore, TearingStore, layout, payload

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import IntegrityError
from prefixvault.inventory import audit
from prefixvault.keys import ExtraKeys, PromptTokens, chain_hashes, prefix_hashes, tail_hash
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.records import BoundaryRecord
from prefixvault.stores.memory import MemoryStore
from prefixvault.tails import TAILS_PER_INDEX, TailIndex
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Miss, Vault

TOKENS = list(range(1000, 1064))


def publish(vault: Vault, tokens: list[int], boundary: int, parent: int = 0,
            extra: ExtraKeys | None = None) -> dict[int, object]:
    """Store and publish ``boundary`` of ``tokens`` (its state captured where a chunk ended),
    extending ``parent`` (already published, or 0)."""
    n = -(-boundary // BS)
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    d = plan_saves(vault.layout, boundary, tables, [StateCapture(2, boundary, 200 + boundary, 1)], step=1,
                   candidates=[boundary], since=parent)
    assert [p.tokens for p in d.publishable] == [boundary], d.refused
    hashes = vault.prefix_hashes(tokens[:boundary], extra)
    acks = vault.save(0, hashes, d.publishable, payload)
    return vault.publish(hashes, acks, parent, seed=vault.seed(extra))


def look(vault: Vault, prompt: list[int], local: int = 0, extra: ExtraKeys | None = None) -> int:
    named = PromptTokens(prompt, extra or ExtraKeys())
    return vault.lookup(vault.hashes(prompt, extra), len(prompt), local, named)


def test_a_prefix_is_named_by_one_hash_per_block_it_touches() -> None:
    chain = chain_hashes(TOKENS[:21], BS)
    named = prefix_hashes(TOKENS[:21], BS)
    assert len(chain) == 2 and named[:2] == chain and len(named) == 3
    assert named[2] == tail_hash(chain[1], TOKENS[16:21])
    assert prefix_hashes(TOKENS[:16], BS) == chain  # at a block boundary: no tail
    assert prefix_hashes(TOKENS[:20], BS)[2] != named[2]  # another length, another name
    assert prefix_hashes([*TOKENS[:20], 7], BS)[2] != named[2]  # other tokens, another name
    assert tail_hash(chain[1], []) != prefix_hashes(TOKENS[:24], BS)[2]  # never a chain hash
    first = prefix_hashes(TOKENS[:5], BS)
    assert first == [tail_hash(ExtraKeys().seed(), TOKENS[:5])]  # inside the first block: from the seed
    assert prefix_hashes(TOKENS[:5], BS, ExtraKeys(cache_salt="s")) != first


def test_a_longer_prompt_restores_a_tail_boundary_exactly() -> None:
    vault = Vault(MemoryStore(), layout())
    assert publish(vault, TOKENS, 16) == {16: None}
    assert publish(vault, TOKENS, 21, parent=16) == {21: None}  # the previous turn's exact end
    turn2 = [*TOKENS[:21], 7, 8, 9, 10]
    assert look(vault, turn2) == 21
    assert look(vault, turn2, local=16) == 21  # past what the engine holds
    hashes = vault.prefix_hashes(turn2[:21])
    loaded = vault.load(vault.needed(hashes, 21))
    assert loaded.ok
    partial = [r for r in loaded.payloads if r.group == 0 and r.block_index == 2]
    assert partial and partial[0].tokens == 21 and partial[0].key_hash == hashes[2]
    # without its tokens a lookup cannot name a tail: the block boundary only
    assert vault.lookup(vault.hashes(turn2), len(turn2)) == 16


def test_a_tail_hit_always_leaves_a_token_to_compute() -> None:
    """The same prompt again never restores its own end: the engine computes the last token,
    and a state restored there would have it applied twice."""
    vault = Vault(MemoryStore(), layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    assert look(vault, TOKENS[:21]) == 16
    assert look(vault, TOKENS[:22]) == 21


def test_a_prompt_that_parts_inside_the_tail_does_not_restore_it() -> None:
    vault = Vault(MemoryStore(), layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    other = [*TOKENS[:19], 5, 5, 5, 5, 5]
    assert look(vault, other) == 16


def test_other_prompts_tails_past_a_shared_block_never_crowd_out_its_own() -> None:
    """Many prompts share the first two blocks and branch inside the third: the index past the
    shared blocks lists every branch's tail, and a lookup keeps only its own prompt's."""
    vault = Vault(MemoryStore(), layout())
    publish(vault, TOKENS, 16)
    mine = [*TOKENS[:17], 1, 2, 3, 4, 5, 6, 7, 8, 9]
    publish(vault, mine, 18, parent=16)
    for branch in range(20):  # deeper tails of other prompts, published after it
        other = [*TOKENS[:17], 500 + branch, *([9] * 8)]
        publish(vault, other, 23, parent=16)
    assert look(vault, mine[:25]) == 18


def test_a_tail_inside_the_first_block_is_found_under_the_seed() -> None:
    vault = Vault(MemoryStore(), layout())
    salt = ExtraKeys(cache_salt="tenant")
    assert publish(vault, TOKENS, 5, extra=salt) == {5: None}
    assert look(vault, TOKENS[:9], extra=salt) == 5
    assert look(vault, TOKENS[:9]) == 0  # another salt: another seed, another name


def test_a_tail_in_the_first_block_without_a_seed_is_not_published() -> None:
    vault = Vault(MemoryStore(), layout())
    tables = {0: [1], 1: [100]}
    d = plan_saves(vault.layout, 5, tables, [StateCapture(2, 5, 205, 1)], step=1, candidates=[5])
    hashes = vault.prefix_hashes(TOKENS[:5])
    assert vault.publish(hashes, vault.save(0, hashes, d.publishable, payload)) == {5: "not_aligned"}


def test_a_tail_whose_objects_are_gone_is_not_a_hit() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    prompt = TOKENS[:30]
    partial = next(r for r in vault.needed(vault.prefix_hashes(prompt[:21]), 21) if r.block_index == 2
                   and r.group == 0)
    store.delete_many([partial.key])
    assert look(vault, prompt) == 16  # the block boundary still resumes
    publish(vault, TOKENS, 21, parent=16)
    assert look(vault, prompt) == 21
    store.delete_many([vault.keys.record(vault.prefix_hashes(prompt[:16])[1])])  # the full blocks' record
    assert look(vault, prompt) == 21  # a tail stands on its own record and objects


class ReadCountingStore(CountingStore):
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.calls.append("get")
        return super().get_many(keys)


def test_a_lookup_checks_tails_in_one_more_read_only_where_an_index_exists() -> None:
    store = ReadCountingStore()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    vault.refresh_deny()
    store.calls.clear()
    assert look(vault, TOKENS[:30]) == 16
    assert store.calls == ["touch", "touch"]  # no index past any block: no read
    publish(vault, TOKENS, 21, parent=16)
    store.calls.clear()
    prompt = TOKENS[:22]
    result = vault.lookup_explained(vault.hashes(prompt), len(prompt), 0, PromptTokens(prompt))
    assert result.hit == 21 and result.miss is None  # past the longest block-aligned prefix (16)
    assert result.boundary_hash == vault.prefix_hashes(prompt[:21])[2]
    assert store.calls == ["touch", "get", "touch"]  # records and indexes, the index, the objects


class PipelinedStore(ReadCountingStore):
    """A network store whose ``touch_and_get`` is one round trip, as Redis and Valkey's is."""

    remote = True

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        self.calls.append("touch+get")
        return MemoryStore.touch_many(self, keys, touch), MemoryStore.get_many(self, reads)


def test_a_lookup_over_a_network_store_reads_the_tail_indexes_in_its_first_round_trip() -> None:
    store = PipelinedStore()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)  # a tail past block boundary 16
    vault.refresh_deny()
    other = [*TOKENS[:16], *range(1, 10)]  # shares the block, not the tail
    later: list[tuple[list[str], list[bool]]] = []
    store.calls.clear()
    [found] = vault.lookup_many([(vault.hashes(other), len(other), 0)], touch_later=later,
                                prompts=[PromptTokens(other)])
    assert found.hit == 16
    assert store.calls == ["touch+get"]  # records, objects and the index: one round trip
    prompt = TOKENS[:22]
    store.calls.clear()
    [found] = vault.lookup_many([(vault.hashes(prompt), len(prompt), 0)], touch_later=later,
                                prompts=[PromptTokens(prompt)])
    assert found.hit == 21 and found.miss is None
    assert store.calls == ["touch+get", "touch"]  # the tail's own objects: one more


def test_a_tail_index_keeps_the_most_recent_tails_and_refuses_junk() -> None:
    fingerprint, parent = b"f" * 16, b"p" * 16
    index = TailIndex(parent, ())
    for past in range(1, BS):
        index = index.with_tail(past, bytes([past]) * 16)
    index = index.with_tail(3, bytes([3]) * 16)
    assert index.tails[0] == (3, bytes([3]) * 16) and sorted(p for p, _ in index.tails) == list(range(1, BS))
    big = TailIndex(parent, ())
    for n in range(1, 100):
        big = big.with_tail(1 + n % (BS - 1), n.to_bytes(16, "big"))
    assert len(big.tails) == TAILS_PER_INDEX and big.tails[0][1] == (99).to_bytes(16, "big")
    blob = index.encode(fingerprint)
    assert TailIndex.decode(blob, fingerprint, parent, BS) == index
    with pytest.raises(IntegrityError):
        TailIndex.decode(blob, fingerprint, b"q" * 16, BS)  # another boundary's
    with pytest.raises(IntegrityError):
        TailIndex.decode(TailIndex(parent, ((BS, parent),)).encode(fingerprint), fingerprint, parent, BS)
    key = NamespaceKey.derive(b"secret" * 8, "ns")
    with pytest.raises(IntegrityError):
        TailIndex.decode(index.encode(fingerprint), fingerprint, parent, BS, key)  # plain, in a keyed one


def test_a_full_tail_index_fits_a_lookups_guessed_read() -> None:
    """A lookup reads tail indexes on Mooncake into ``GUESSED_READ`` bytes each, with no size
    asked first: a full index (lengths of a million tokens, sealed) fits it with room."""
    from prefixvault.stores.mooncake import GUESSED_READ

    index = TailIndex(b"p" * 16, ())
    for n in range(TAILS_PER_INDEX):
        index = index.with_tail(10**6 + n, n.to_bytes(16, "big"))
    key = NamespaceKey.derive(b"secret" * 8, "ns")
    assert len(index.tails) == TAILS_PER_INDEX
    assert 2 * len(index.encode(b"f" * 16, key)) <= GUESSED_READ


def test_a_damaged_tail_index_costs_its_tails_never_a_wrong_hit() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    key = vault.keys.tail_index(vault.hashes(TOKENS[:16])[1])
    store.put_many([(key, [b"junk" * 40])])
    assert look(vault, TOKENS[:30]) == 16
    assert sum(v for k, v in vault.counters.rejected.items() if k.startswith("tail index")) == 1
    publish(vault, TOKENS, 21, parent=16)  # a publish replaces it
    assert look(vault, TOKENS[:30]) == 21


def test_a_torn_read_of_a_tail_index_never_drops_its_tails() -> None:
    store = TearingStore()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    store.tear.add(vault.keys.tail_index(vault.hashes(TOKENS[:16])[1]))
    publish(vault, TOKENS, 19, parent=16)  # its read of the index is torn; the next read is whole
    assert not store.tear
    assert not any(k.startswith("tail index") for k in vault.counters.rejected)
    assert look(vault, TOKENS[:30]) == 21  # the index still lists 21 ...
    assert look(vault, TOKENS[:20]) == 19  # ... and now 19


def test_a_tail_record_names_its_block_size_and_its_partly_filled_block() -> None:
    vault = Vault(MemoryStore(), layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)
    hashes = vault.prefix_hashes(TOKENS[:21])
    blob = vault.store.get_many([vault.keys.record(hashes[2])])[0]
    assert blob is not None
    record = BoundaryRecord.decode(blob, vault.fingerprint)
    assert record.tail and record.tokens == 21 and record.block_size == BS and record.parent == 16
    assert record.hashes == (hashes[2],) and record.first_block == 2
    report = audit(vault.store)
    assert not report.findings and not report.unverifiable, (report.findings, report.unverifiable)


def test_attention_alone_has_no_tails() -> None:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, BS, 4), "float32")])
    vault = Vault(MemoryStore(), CacheLayout(model="a", block_size=BS, groups=(attn,)))
    with pytest.raises(ValueError):
        vault.needed(vault.prefix_hashes(TOKENS[:21]), 21)
    assert look(vault, TOKENS[:30]) == 0
    assert vault.lookup_explained(vault.hashes(TOKENS[:30]), 30).miss is Miss.NO_RECORD
