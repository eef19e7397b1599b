"""Records that extend their parent: linear bytes, publish without the parent, audits that walk
chains and never remove what they cannot prove broken, a layout that heals, hits that keep
what they use alive."""

from __future__ import annotations

import numpy as np
from test_vault import TearingStore

from prefixvault.boundary import Refusal, StateCapture, plan_saves
from prefixvault.inventory import audit
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.records import BoundaryRecord
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import ObjectRef, Vault

BS = 4


def layout() -> CacheLayout:
    full = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((16,), "uint8")])
    swa = CacheGroup.uniform(GroupKind.SLIDING_WINDOW, [TensorSpec((16,), "uint8")], window=2 * BS)
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((32,), "uint8")])
    return CacheLayout(model="chains", block_size=BS, groups=(full, swa, state))


def payload(ref: ObjectRef, block_id: int) -> bytes:
    return bytes([block_id % 251]) * (32 if ref.kind.name == "STATE" else 16)


def produce(vault: Vault, tokens: list[int], chunk: int, parent: int = 0) -> list[int]:
    """Publish every block boundary chunk by chunk, as the connector does; return published."""
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(1000, 1000 + n))}
    published: list[int] = []
    for step, start in enumerate(range(parent, n * BS, chunk), 1):
        end = min(start + chunk, n * BS)
        caps = [StateCapture(2, b, 5000 + b, step) for b in range(start + BS, end + 1, BS)]
        d = plan_saves(vault.layout, end, tables, caps, step, since=parent)
        result = vault.publish(hashes, vault.save(0, hashes, d.publishable, payload), parent)
        ok = sorted(b for b, why in result.items() if why is None)
        published += ok
        parent = max([parent, *ok])
    return published


def records(store: MemoryStore, vault: Vault) -> dict[int, BoundaryRecord]:
    keys = [k for k, _ in store.scan(vault.keys.prefix + "r/")]
    recs = [BoundaryRecord.decode(b or b"", vault.fingerprint) for b in store.get_many(keys)]
    return {r.tokens: r for r in recs}


def test_record_bytes_do_not_grow_with_the_prompt() -> None:
    sizes = {}
    for n_blocks in (16, 256):
        store = MemoryStore()
        vault = Vault(store, layout())
        tokens = np.random.default_rng(n_blocks).integers(0, 1000, n_blocks * BS).tolist()
        assert produce(vault, tokens, chunk=4 * BS) == list(range(BS, n_blocks * BS + 1, BS))
        recs = records(store, vault)
        assert all(len(r.hashes) == 1 for t, r in recs.items() if t > BS)  # one block past its parent
        sizes[n_blocks] = max(size for k, size in store.scan(vault.keys.prefix + "r/"))
        hashes = vault.hashes([*tokens, 1])
        assert vault.lookup(hashes, len(tokens) + 1) == len(tokens)
        assert vault.load(vault.needed(hashes, len(tokens))).ok
    assert sizes[256] <= sizes[16] + 8  # digits of larger token counts only


def test_a_gone_parent_record_publishes_from_the_first_block_if_its_blocks_are_there() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(12 * BS))
    assert produce(vault, tokens[: 4 * BS], chunk=4 * BS) == [BS, 2 * BS, 3 * BS, 4 * BS]
    hashes = vault.hashes(tokens)
    store.delete_many([vault.keys.record(hashes[3])])  # the parent record of the next step
    assert produce(vault, tokens[: 8 * BS], chunk=4 * BS, parent=4 * BS) == [5 * BS, 6 * BS, 7 * BS, 8 * BS]
    assert records(store, vault)[5 * BS].parent == 0  # lists its whole chain instead
    assert audit(store).findings == []
    # Now also a block the gone parent covered: nothing can be published on top of it.
    store.delete_many([vault.keys.record(hashes[7]), vault.block_ref(0, 0, hashes[1], 1).key])
    hashes_12 = vault.hashes(tokens)
    n = 12
    tables = {0: list(range(1, n + 1)), 1: list(range(1000, 1000 + n))}
    d = plan_saves(vault.layout, 12 * BS, tables, [StateCapture(2, 12 * BS, 77, 1)], 1, since=8 * BS)
    result = vault.publish(hashes_12, vault.save(0, hashes_12, d.publishable, payload), 8 * BS)
    assert result == {12 * BS: Refusal.MISSING_OBJECT}


def test_audit_walks_chains_and_keeps_what_it_cannot_prove_broken() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(10 * BS))
    produce(vault, tokens, chunk=2 * BS)
    hashes = vault.hashes(tokens)
    report = audit(store)
    assert report.records == 10 and report.findings == [] and report.unverifiable == []
    # A full-attention block in the middle: every record from its boundary on is broken.
    store.delete_many([vault.block_ref(0, 0, hashes[5], 5).key])
    report = audit(store)
    tokens_of = {vault.keys.record(r.boundary_hash): t for t, r in records(store, vault).items()}
    assert {tokens_of[k] for k in report.broken_records} == {b * BS for b in range(6, 11)}
    # A record in the middle goes (evicted): records past it cannot be walked to the start.
    store.put_many([(vault.block_ref(0, 0, hashes[5], 5).key, [b"\0"])])  # garbage: proven bad
    store.delete_many([vault.keys.record(hashes[2])])
    tokens_of = {vault.keys.record(r.boundary_hash): t for t, r in records(store, vault).items()}
    report = audit(store, repair=True)
    assert {tokens_of[k] for k in report.broken_records} == {24, 28, 32, 36, 40}
    assert {tokens_of[f.record_key] for f in report.unverifiable} == {16, 20}
    assert report.repaired == 5
    left = records(store, vault)
    assert sorted(left) == [4, 8, 16, 20]  # unverifiable records stay; lookups still check objects


def test_an_audit_removes_nothing_a_torn_read_made_look_wrong() -> None:
    """A read racing a same-size overwrite may be torn on Mooncake: the audit reads an object that
    fails once more, and a repair removes only what is wrong twice."""
    store = TearingStore()
    vault = Vault(store, layout())
    tokens = list(range(6 * BS))
    produce(vault, tokens, chunk=2 * BS)
    hashes = vault.hashes(tokens)
    reached = vault.block_ref(0, 0, hashes[2], 2).key
    more = vault.hashes(list(range(7 * BS)))  # saved, never published: no record reaches it
    vault.save(0, more, plan_saves(vault.layout, 7 * BS, {0: list(range(1, 8)), 1: list(range(1000, 1007))},
                                   [StateCapture(2, 7 * BS, 5056, 1)], 1, since=6 * BS).publishable, payload)
    unreached = vault.block_ref(0, 0, more[6], 6).key
    assert store.exists_many([unreached]) == [True]
    store.tear.update([reached, unreached])
    report = audit(store, repair=True)
    assert not store.tear  # both were read, torn, and read again
    assert report.findings == [] and report.unreached_bad == [] and report.repaired == 0
    assert store.exists_many([reached, unreached]) == [True, True]
    store.put_many([(reached, [b"\0"])])  # wrong however often it is read
    assert len(audit(store, repair=True).findings) == 4


def test_a_lost_layout_never_costs_valid_records_and_heals() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(6 * BS))
    produce(vault, tokens, chunk=2 * BS)
    store.delete_many([vault.keys.layout()])  # evicted as the oldest small object
    report = audit(store, repair=True)
    assert report.repaired == 0 and len(report.unverifiable) == 6
    assert {f.problem for f in report.unverifiable} == {"layout unknown"}
    consumer = Vault(store, layout())  # another process, never published anything
    assert consumer.lookup(consumer.hashes([*tokens, 1]), len(tokens) + 1) == len(tokens)
    assert store.exists_many([vault.keys.layout()]) == [True]
    report = audit(store)
    assert report.records == 6 and report.findings == [] and report.unverifiable == []


def test_a_corrupt_layout_is_replaced_by_the_next_publisher() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    produce(vault, list(range(4 * BS)), chunk=2 * BS)
    good = store.get_many([vault.keys.layout()])[0]
    store.put_many([(vault.keys.layout(), [b"not a layout"])])
    producer = Vault(store, layout())  # a fresh process reads the layout back once
    produce(producer, list(range(100, 100 + 4 * BS)), chunk=2 * BS)
    assert store.get_many([vault.keys.layout()])[0] == good
    assert producer.counters.layout_writes == 1


def test_hits_keep_their_records_objects_and_layout_alive_under_lru() -> None:
    hot = list(range(8 * BS))
    vault = Vault(MemoryStore(), layout())
    produce(vault, hot, chunk=4 * BS)
    used = vault.store.stats().bytes
    store = MemoryStore(capacity=used * 3)
    vault = Vault(store, layout())
    produce(vault, hot, chunk=4 * BS)
    hashes = vault.hashes([*hot, 1])
    for i in range(20):  # other prompts fill the store many times over; the hot one is hit
        produce(vault, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BS)), chunk=4 * BS)
        assert vault.lookup(hashes, len(hot) + 1) == len(hot), f"hot prefix lost after {i + 1} fills"
    assert store.stats().evictions > 0
    assert store.exists_many([vault.keys.layout()]) == [True]
    # The hot prefix's records all verify. A prompt never hit ages whole, its tail first
    # within each save; a later save's record can outlive the earlier one it names as
    # parent (a record is put after the objects it needs): unverifiable, harmless to
    # lookups (they check objects by hash), and the next to go.
    hot_records = {vault.keys.record(h) for h in hashes}
    findings = audit(store).unverifiable
    assert not [f for f in findings if f.record_key in hot_records]
    assert {f.problem for f in findings} <= {"a parent record is gone: earlier blocks unknown"}


def test_a_chain_ages_from_its_tail_and_a_state_the_hit_passes_over_ages() -> None:
    """A hit touches its prefix's blocks from the first on and only the state it restores:
    under pressure the state of an earlier boundary the hits pass over goes first, the hit's
    own objects stay, and a prompt never hit loses its tail before its head."""
    hot = list(range(8 * BS))
    vault = Vault(MemoryStore(), layout())
    produce(vault, hot, chunk=4 * BS)
    store = MemoryStore(capacity=vault.store.stats().bytes * 3)
    vault = Vault(store, layout())
    assert {4 * BS, 8 * BS} <= set(produce(vault, hot, chunk=4 * BS))
    hashes = vault.hashes([*hot, 1])
    early_state = vault.state_ref(2, 0, hashes[3], 3).key
    late_state = vault.state_ref(2, 0, hashes[7], 7).key
    blocks = [vault.block_ref(0, 0, hashes[i], i).key for i in range(8)]
    cold = list(range(50_000, 50_000 + 8 * BS))
    produce(vault, cold, chunk=8 * BS)
    cold_hashes = vault.hashes(cold)
    cold_blocks = [vault.block_ref(0, 0, cold_hashes[i], i).key for i in range(8)]
    for i in range(40):
        produce(vault, list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * BS)), chunk=4 * BS)
        assert vault.lookup(hashes, len(hot) + 1) == len(hot)
        left = store.exists_many(cold_blocks)
        # The cold prompt (one save, never hit) goes from its last block back.
        assert left == sorted(left, reverse=True), left
        if not store.exists_many([early_state])[0]:
            break
    else:
        raise AssertionError("the passed-over state outlived 40 fills")
    assert store.exists_many([late_state, *blocks]) == [True] * 9
