"""The vault protocol on a store: publish order, round trips, load verification and repair."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from unittest.mock import patch

import numpy as np
import pytest

from prefixvault import lookup as lookup_module
from prefixvault.boundary import Refusal, StateCapture, plan_saves
from prefixvault.codec import HEADER_SIZE
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.records import BoundaryRecord
from prefixvault.stores.base import Buffer, Store, StoreStats
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import LookupResult, Miss, ObjectRef, RankAck, Vault

BS = 8


def layout(world: int = 1) -> CacheLayout:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, BS, 4), "float32")], world)
    swa = CacheGroup.uniform(GroupKind.SLIDING_WINDOW, [TensorSpec((2, BS, 4), "float32")], world, window=BS)
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((4, 4), "float32")], world)
    return CacheLayout(model="t", block_size=BS, groups=(attn, swa, state), tp_size=world)


class CountingStore(MemoryStore):
    """Counts batch calls, to check round trips per lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append("exists")
        return super().exists_many(keys)

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        self.calls.append("touch")
        return super().touch_many(keys, touch)


def payload(ref: ObjectRef, block_id: int) -> bytes:
    n = 2 * BS * 4 * 4 if ref.kind.name == "BLOCK" else 64
    return np.full(n // 4, block_id + 0.5 + ref.rank, np.float32).tobytes()


def fill(vault: Vault, tokens: list[int], boundaries: list[int], world: int = 1) -> list[int]:
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    caps = [StateCapture(2, b, 200 + b, 1) for b in boundaries]
    d = plan_saves(vault.layout, len(tokens), tables, caps, step=1)
    acks: list[RankAck] = []
    for r in range(world):
        acks += vault.save(r, hashes, d.publishable, payload)
    return sorted(b for b, why in vault.publish(hashes, acks).items() if why is None)


def test_publish_lookup_load_round_trip() -> None:
    store = CountingStore()
    vault = Vault(store, layout())
    tokens = list(range(64))
    assert fill(vault, tokens, [16, 40]) == [16, 40]
    store.calls.clear()
    hashes = vault.hashes([*tokens[:50], 999])
    assert vault.lookup(hashes, 51) == 40
    # records and every candidate's objects, then a touch of what the hit uses
    assert store.calls == ["touch", "touch"]
    loaded = vault.load(vault.needed(hashes, 40))
    assert loaded.ok
    # full attention needs all 5 blocks, an 8-token window only the last, the state one object
    assert sorted((r.group, r.block_index) for r in loaded.payloads) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 4),
        (2, 4),
    ]


class LendingStore(MemoryStore):
    """Lends memory as a store with registered buffers does, and records where puts came from."""

    def __init__(self) -> None:
        super().__init__()
        self.lent = bytearray()
        self.parts_in_lent: list[bool] = []

    def staging_buffer(self, nbytes: int) -> memoryview | None:
        if len(self.lent) < nbytes:
            self.lent = bytearray(nbytes)
        return memoryview(self.lent)[:nbytes]

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self.parts_in_lent += [all(isinstance(p, memoryview) and p.obj is self.lent for p in parts)
                               for _, parts in items]  # fmt: skip
        return super().put_many(items)


def test_objects_are_built_in_lent_memory_when_the_engine_can_gather_into_it() -> None:
    store = LendingStore()
    vault = Vault(store, layout())
    tokens = list(range(64))
    hashes = vault.hashes(tokens)
    tables = {0: list(range(1, 9)), 1: list(range(100, 108))}
    d = plan_saves(vault.layout, len(tokens), tables, [StateCapture(2, 40, 240, 1)], step=1)

    def gather_into(ref: ObjectRef, block_id: int, out: memoryview) -> None:
        out[:] = payload(ref, block_id)

    acks = vault.save(0, hashes, d.publishable, payload, gather_into)
    assert vault.publish(hashes, acks) == {40: None}
    assert store.parts_in_lent and all(store.parts_in_lent)
    assert vault.lookup(hashes, 64) == 40
    loaded = vault.load(vault.needed(hashes, 40))
    assert loaded.ok
    for ref, got in loaded.payloads.items():  # loaded into lent memory, and verified there
        assert got.obj is store.lent
        block_id = 240 if ref.kind.name == "STATE" else tables[ref.group][ref.block_index]
        assert bytes(got) == payload(ref, block_id)


def test_lookup_leaves_a_token_and_respects_local_hits() -> None:
    vault = Vault(MemoryStore(), layout())
    tokens = list(range(64))
    fill(vault, tokens, [16, 40, 64])
    hashes = vault.hashes(tokens)
    assert vault.lookup(hashes, 64) == 40  # 64 would leave nothing to compute
    assert vault.lookup(hashes, 65) == 64
    assert vault.lookup(hashes, 65, min_tokens=64) == 0


def test_record_needs_every_rank() -> None:
    vault = Vault(MemoryStore(), layout(world=2))
    tokens = list(range(32))
    hashes = vault.hashes(tokens)
    d = plan_saves(vault.layout, 32, {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}, [StateCapture(2, 32, 9, 1)], step=1)
    acks = vault.save(0, hashes, d.publishable, payload)
    assert vault.publish(hashes, acks) == {32: Refusal.MISSING_RANK}
    assert vault.lookup(hashes, 40) == 0
    acks += vault.save(1, hashes, d.publishable, payload)
    assert vault.publish(hashes, acks) == {32: None}
    assert vault.lookup(hashes + vault.hashes(list(range(40)))[4:], 40) == 32


def stored_at_24(store: Store) -> tuple[Vault, list[bytes], list[ObjectRef], ObjectRef]:
    """A vault on ``store`` that published boundary 24 of 32 tokens: its hashes, the objects
    boundary 24 needs, and its state's."""
    vault = Vault(store, layout())
    tokens = list(range(32))
    fill(vault, tokens, [24])
    hashes = vault.hashes(tokens)
    refs = vault.needed(hashes, 24)
    return vault, hashes, refs, next(r for r in refs if r.kind.name == "STATE")


def test_corrupt_object_is_rejected_counted_and_removed() -> None:
    store = MemoryStore()
    vault, hashes, refs, state_ref = stored_at_24(store)
    blob = bytearray(store.get_many([state_ref.key])[0] or b"")
    blob[HEADER_SIZE + 3] ^= 0x40
    store.put_many([(state_ref.key, [bytes(blob)])])
    loaded = vault.load(refs)
    assert loaded.failed == {state_ref: "payload checksum"}
    assert vault.counters.rejected["payload checksum"] == 1
    assert store.exists_many([state_ref.key]) == [False]  # wrong again when read once more
    assert vault.counters.torn_reads == 0
    assert vault.lookup(hashes, 32) == 0  # the record no longer yields a hit


class TearingStore(MemoryStore):
    """Returns the next read of each key in ``tear`` (``get_into`` or ``get_many``) with one
    byte of another version, as a read that races a same-size overwrite on Mooncake does
    (``stores.mooncake``); a real Mooncake does so only by chance (``test_store_conformance``),
    so the tear is made here. Keys in ``vanish`` are removed (evicted) before a ``get_many``."""

    def __init__(self) -> None:
        super().__init__()
        self.tear: set[str] = set()
        self.vanish: set[str] = set()

    def _torn(self, key: str) -> bool:
        if key in self.tear:
            self.tear.discard(key)
            return True
        return False

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.delete_many([k for k in keys if k in self.vanish])
        out = super().get_many(keys)
        for i, (key, blob) in enumerate(zip(keys, out, strict=True)):
            if blob and self._torn(key):
                out[i] = blob[:-1] + bytes([blob[-1] ^ 0x40])
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes = super().get_into(keys, buffers)
        for key, buf, size in zip(keys, buffers, sizes, strict=True):
            if size and self._torn(key):
                buf.cast("B")[size - 1] ^= 0x40
        return sizes


def test_a_torn_read_costs_that_load_and_keeps_the_object() -> None:
    store = TearingStore()
    vault, hashes, refs, state_ref = stored_at_24(store)
    store.tear.add(state_ref.key)
    loaded = vault.load(refs)
    assert loaded.failed == {state_ref: "payload checksum"}
    assert vault.counters.rejected["payload checksum"] == 1
    assert vault.counters.torn_reads == 1
    assert store.exists_many([state_ref.key]) == [True], "a whole object was removed"
    assert vault.load(refs).ok  # the next load restores it
    assert vault.lookup(hashes, 32) == 24


def test_a_torn_read_of_an_object_gone_before_it_is_read_again_removes_nothing_more() -> None:
    store = TearingStore()
    vault, _, refs, state_ref = stored_at_24(store)
    store.tear.add(state_ref.key)
    store.vanish.add(state_ref.key)
    assert vault.load(refs).failed == {state_ref: "payload checksum"}
    assert vault.counters.torn_reads == 0 and store.exists_many([state_ref.key]) == [False]


def test_a_save_that_finds_its_state_present_and_reads_it_torn_leaves_it() -> None:
    """A save that finds a state present reads it before skipping the put; a torn read of it
    neither removes the state nor writes it again (it was removed on that one read, and a
    lookup racing the save missed it); one wrong on both reads is written again."""
    store = TearingStore()
    vault, hashes, refs, state_ref = stored_at_24(store)
    removed: list[str] = []
    real = store.delete_many
    store.delete_many = lambda keys: removed.extend(keys) or real(keys)  # type: ignore[method-assign]
    store.tear.add(state_ref.key)
    fill(vault, list(range(32)), [24])
    assert removed == [] and vault.counters.rejected == {}
    assert vault.load(refs).ok
    blob = bytearray(store.get_many([state_ref.key])[0] or b"")
    blob[HEADER_SIZE + 3] ^= 0x40
    store.put_many([(state_ref.key, [bytes(blob)])])
    fill(vault, list(range(32)), [24])
    assert removed == [state_ref.key] and vault.counters.rejected["payload checksum"] == 1
    assert vault.load(refs).ok and vault.lookup(hashes, 32) == 24  # written again


def test_object_of_another_boundary_is_rejected() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(32))
    fill(vault, tokens, [16, 24])
    hashes = vault.hashes(tokens)
    s16 = next(r for r in vault.needed(hashes, 16) if r.kind.name == "STATE")
    s24 = next(r for r in vault.needed(hashes, 24) if r.kind.name == "STATE")
    # A state written for boundary 16 placed under boundary 24's key: bytes are valid, identity is not.
    store.put_many([(s24.key, [store.get_many([s16.key])[0] or b""])])
    assert vault.load([s24]).failed == {s24: "identity"}


def test_missing_objects_are_reported_not_loaded() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(32))
    fill(vault, tokens, [24])
    refs = vault.needed(vault.hashes(tokens), 24)
    store.delete_many([refs[0].key])
    loaded = vault.load(refs)
    assert loaded.failed == {refs[0]: "missing"}
    assert len(loaded.payloads) == len(refs) - 1


def test_a_lookup_names_every_boundary_it_could_resume_at() -> None:
    """``LookupResult.resumable``: the block boundaries past the engine's hit whose every object
    is there, the longest first (a caller may resume at a shallower one: a junction)."""
    store = MemoryStore()
    vault = Vault(store, layout())
    tokens = list(range(40))
    assert fill(vault, tokens, [8, 16, 24, 32]) == [8, 16, 24, 32]
    hashes = vault.hashes(tokens)
    found = vault.lookup_explained(hashes, len(tokens))
    assert (found.hit, found.resumable) == (32, (32, 24, 16, 8))
    state_at_16 = [r for r in vault.needed(hashes, 16) if r.kind.name == "STATE"]
    store.delete_many([r.key for r in state_at_16])
    found = vault.lookup_explained(hashes, len(tokens), min_tokens=8)
    assert (found.hit, found.resumable) == (32, (32, 24))


class FullStore(MemoryStore):
    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return [False] * len(items)


def test_failed_writes_publish_nothing() -> None:
    vault = Vault(FullStore(), layout())
    assert fill(vault, list(range(32)), [16, 24]) == []
    assert vault.counters.put_failed > 0
    assert vault.counters.records_published == 0


def test_existing_blocks_are_not_written_twice() -> None:
    vault = Vault(MemoryStore(), layout())
    fill(vault, list(range(32)), [16])
    written = vault.counters.put_keys
    fill(vault, list(range(32)), [16, 24])
    assert vault.counters.put_skipped >= 3
    assert vault.counters.put_keys - written == 3  # a new attention block, a window block, a state


class DownStore(Store):
    """A store whose every call fails, as a dead server would."""

    uri = "down://"

    def _boom(self, *a: object) -> list[bool]:
        raise ConnectionError("store down")

    put_many = put_if_absent = get_into = get_many = exists_many = delete_many = _boom  # type: ignore[assignment]

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        raise ConnectionError("store down")

    def stats(self) -> StoreStats:
        raise ConnectionError("store down")


def test_store_errors_propagate_to_the_adapter() -> None:
    # The vault does not swallow store failures; adapters turn them into misses (fail closed).
    vault = Vault(DownStore(), layout())
    with pytest.raises(ConnectionError):
        vault.lookup(vault.hashes(list(range(32))), 32)


def test_lookups_together_cost_the_round_trips_of_one() -> None:
    store = CountingStore()
    vault = Vault(store, layout())
    tokens = list(range(64))
    fill(vault, tokens, [16, 40])
    asks = [
        (vault.hashes([*tokens[:50], 999]), 51, 0),  # hits 40
        (vault.hashes([*tokens[:20], 7, 7, 7, 7]), 24, 0),  # hits 16
        (vault.hashes(list(range(500, 540))), 40, 0),  # nothing published
        (vault.hashes(tokens[:5]), 5, 0),  # shorter than a block: no round trip needed
        (vault.hashes([*tokens[:50], 999]), 51, 40),  # the engine has 40 already
    ]
    alone = [vault.lookup_explained(*a) for a in asks]
    store.calls.clear()
    together = vault.lookup_many(asks)
    assert together == alone
    assert [r.hit for r in together] == [40, 16, 0, 0, 0]
    assert store.calls == ["touch", "touch"]


class BatchCountingStore(CountingStore):
    """Also counts single conditional puts and batches of them."""

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self.calls.append("put_if_absent")
        return super().put_if_absent(key, data)

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        self.calls.append("put_if_absent_many")
        return [MemoryStore.put_if_absent(self, k, d) for k, d in items]


def saves_of(vault: Vault, prompts: list[list[int]], parents: list[int],
             world: int = 2, ranks: Sequence[int] = (0, 1)) -> list[tuple[list[bytes], list[RankAck], int]]:
    """Each prompt saved by ``ranks`` from its parent on, with every block boundary captured."""
    out = []
    for tokens, parent in zip(prompts, parents, strict=True):
        hashes = vault.hashes(tokens)
        n = len(tokens) // BS
        tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
        caps = [StateCapture(2, b, 200 + b, 1) for b in range(parent + BS, n * BS + 1, BS)]
        d = plan_saves(vault.layout, len(tokens), tables, caps, step=1, since=parent)
        acks: list[RankAck] = []
        for r in ranks:
            acks += vault.save(r, hashes, d.publishable, payload)
        out.append((hashes, acks, parent))
    return out


def test_publish_many_is_publish_of_each_in_two_round_trips() -> None:
    """Several saves published together give each the outcomes and records ``publish``
    gives it alone, with one existence check and one conditional put for all of them: a
    record two of them share is put once, a parent record that is gone and a rank that did
    not store its objects are handled per save."""
    shared = list(range(2 * BS))
    prompts = [shared + list(range(100, 100 + 2 * BS)), shared + list(range(200, 200 + 3 * BS)),
               list(range(300, 300 + 4 * BS)), list(range(400, 400 + 2 * BS))]
    results = []
    for together in (False, True):
        store = BatchCountingStore()
        vault = Vault(store, layout(world=2))
        # A parent (boundary 8) published for the third prompt, then its record removed.
        third = saves_of(vault, [prompts[2][:BS]], [0])
        vault.publish_many(third)
        store.delete_many([vault.keys.record(vault.hashes(prompts[2])[0])])
        saves = saves_of(vault, prompts[:3], [0, 0, BS])
        saves += saves_of(vault, prompts[3:], [0], ranks=(0,))  # rank 1 never stores its part
        store.calls.clear()
        if together:
            outcomes = vault.publish_many(saves)
            # One existence check for all; one more only for the save whose parent record is
            # gone; one put of every record; the layout's touch.
            assert store.calls == ["exists", "exists", "put_if_absent_many", "touch"]
        else:
            outcomes = [vault.publish(h, a, p) for h, a, p in saves]
        records = {}
        for key, _ in store.scan(vault.keys.record_prefix()):
            rec = BoundaryRecord.decode(store.get_many([key])[0] or b"", vault.fingerprint)
            records[key] = (rec.tokens, rec.hashes, rec.parent, rec.parent_hash)  # not its time
        results.append((outcomes, records, vault.counters.records_published, vault.counters.records_existing))
    alone, batched = results
    assert batched == alone
    outcomes = alone[0]
    assert outcomes[0] == {8: None, 16: None, 24: None, 32: None}
    assert outcomes[1] == {8: None, 16: None, 24: None, 32: None, 40: None}  # 8 and 16 shared
    assert outcomes[2] == {16: None, 24: None, 32: None}  # its parent's record gone: from block 0
    assert set(outcomes[3].values()) == {Refusal.MISSING_RANK}


def test_a_request_s_steps_published_together_chain_as_published_one_by_one() -> None:
    """Two steps of one request queued behind a slow store are published in one batch: the
    second continues the first's top boundary, whose record this batch writes, so it names it
    as its parent (as one by one) instead of listing its chain from block 0. A third save with
    a failed ack is refused alone."""
    tokens = list(range(4 * BS))
    other = list(range(500, 500 + 3 * BS))
    results = []
    for together in (False, True):
        store = BatchCountingStore()
        vault = Vault(store, layout(world=2))
        vault.keep_layout()
        first = saves_of(vault, [tokens[: 2 * BS]], [0])
        second = saves_of(vault, [tokens], [2 * BS])
        (h, acks, p), = saves_of(vault, [other], [0])
        bad = [(h, [RankAck(a.rank, a.tokens, a.boundary_hash, a.tokens != 2 * BS) for a in acks], p)]
        batch = first + second + bad
        store.calls.clear()
        outcomes = vault.publish_many(batch) if together else [vault.publish(*b) for b in batch]
        if together:
            assert store.calls == ["exists", "put_if_absent_many", "touch"]
        records = {}
        for key, _ in store.scan(vault.keys.record_prefix()):
            rec = BoundaryRecord.decode(store.get_many([key])[0] or b"", vault.fingerprint)
            records[rec.tokens, len(rec.hashes)] = rec.parent
        results.append((outcomes, records))
    assert results[1] == results[0]
    outcomes, records = results[0]
    assert outcomes[:2] == [{8: None, 16: None}, {24: None, 32: None}]
    assert outcomes[2][16] is Refusal.STORE_ERROR and outcomes[2][8] is None
    assert records[(24, 1)] == 16  # the second step's first record names the first step's top


NOT_LONGEST = LookupResult(40, 48, Miss.NO_RECORD)


def test_a_hit_is_answered_after_one_round_trip_and_touched_after() -> None:
    """On a network store, where every candidate's objects are few, they are checked beside
    the records: the answer needs one round trip, and what the hit uses is touched in a call
    the caller makes once it has the answer. Above the bound, the lookup takes its two round
    trips, as it does on a local store (a round trip there costs less than the keys)."""
    store = CountingStore()
    store.remote = True
    vault = Vault(store, layout())
    tokens = list(range(64))
    fill(vault, tokens, [16, 40])
    hashes = vault.hashes([*tokens[:50], 999])
    store.calls.clear()
    later: list[tuple[list[str], list[bool]]] = []
    assert vault.lookup_many([(hashes, 51, 0)], touch_later=later) == [NOT_LONGEST]
    assert store.calls == ["touch"]
    # In chain order, block by block: the full-attention blocks, the window's blocks from what
    # the shortest published boundary needs on, and the state at 40 only (the state at 16,
    # passed over, is left to age).
    assert [k.split("/")[2] + k.split("/")[3] for k in later[0][0]] == [
        "b0", "b0", "b1", "b0", "b1", "b0", "b1", "b0", "b1", "s2"]
    vault.touch(later)
    assert store.calls == ["touch", "touch"]
    store.calls.clear()
    with patch.object(lookup_module, "SPECULATIVE_KEYS", 4):
        later = []
        assert vault.lookup_many([(hashes, 51, 0)], touch_later=later) == [NOT_LONGEST]
    assert store.calls == ["touch", "touch"] and later == []
    store.calls.clear()
    store.remote = False
    assert vault.lookup_many([(hashes, 51, 0)], touch_later=later) == [NOT_LONGEST]
    assert store.calls == ["touch", "touch"] and later == []


def test_counts_from_many_threads_are_never_lost() -> None:
    """Issue 32: the lookup, load and save threads count into one vault; ``x += 1`` from two
    threads loses counts. Switching threads as often as the interpreter can makes it show."""
    import sys
    import threading

    store = MemoryStore()
    vault = Vault(store, layout())
    store.put_many([("k", [b"x"])])
    threads, rounds = 8, 3000
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work() -> None:
            for _ in range(rounds):
                vault.counters.add(get_keys=1, get_bytes=2)
                vault.counters.tally("misses", "store_error")

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(old)
    c = vault.counters
    assert (c.get_keys, c.get_bytes, c.misses["store_error"]) == (threads * rounds, 2 * threads * rounds,
                                                                  threads * rounds)
