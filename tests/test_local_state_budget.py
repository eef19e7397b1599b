"""The local store's budget for recurrent states (``?states=``): states never take more than
it, make room among themselves from the least recently used, and never evict a KV block."""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.keys import KeySpace
from prefixvault.stores import StoreError, _arena, open_store
from prefixvault.stores._directory import StateBudget
from prefixvault.stores._index import INDEX_NAME, STATES
from prefixvault.stores.base import STATE_CLASS, key_class
from prefixvault.stores.local import LocalStore

MiB = 1 << 20
SPACE = KeySpace("ns", bytes(8))
SPAWN = mp.get_context("spawn")


def state(i: int) -> str:
    return SPACE.state(1, 0, i.to_bytes(16, "big"))


def block(i: int) -> str:
    return SPACE.block(0, 0, i.to_bytes(16, "big"))


def held_by_states(path: Path) -> int:
    """Counted afresh from the index, key by key (not from the store's own count): an inline
    state takes its bytes, one in a slab its share of the slab."""
    conn = sqlite3.connect(path / INDEX_NAME)
    try:
        slabs = {sid: nbytes // nslots for sid, nbytes, nslots in conn.execute(
            "SELECT id, nbytes, nslots FROM slabs")}
        return sum(int(slabs[slab] if slab is not None else size)
                   for key, size, slab in conn.execute("SELECT key, size, slab FROM keys")
                   if key_class(key) == STATE_CLASS)
    finally:
        conn.close()


def test_the_vault_keys_classes() -> None:
    assert key_class(state(1)) == STATE_CLASS
    assert key_class(block(1)) == "b"
    assert key_class(SPACE.record(bytes(16))) == "r"
    assert key_class(SPACE.layout()) == ""
    assert key_class("a/b") == ""


def test_states_make_room_among_themselves(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with open_store(f"local://{path}?capacity=64MiB&states=4MiB") as store:
        assert store.put_many([(block(i), [bytes(MiB)]) for i in range(20)]) == [True] * 20
        for i in range(12):  # 12 states of 1 MiB into a budget of 4
            assert store.put_many([(state(i), [bytes([i]) * MiB])]) == [True]
            assert held_by_states(path) <= 4 * MiB
        alive = store.exists_many([state(i) for i in range(12)])
        assert alive == [False] * 8 + [True] * 4  # the least recently used went
        assert all(store.exists_many([block(i) for i in range(20)]))  # no KV block went
        stats = store.stats()
        assert (stats.state_bytes, stats.state_budget) == (held_by_states(path), 4 * MiB)
        assert store.get_many([state(11)]) == [bytes([11]) * MiB]


def test_a_hit_keeps_its_state(tmp_path: Path) -> None:
    with open_store(f"local://{tmp_path}/s?capacity=64MiB&states=3MiB") as store:
        for i in range(3):
            assert store.put_many([(state(i), [bytes(MiB)])]) == [True]
        store.touch_many([state(0)])  # 0 is used again: 1 is now the oldest
        assert isinstance(store, LocalStore)
        store.close()
    with open_store(f"local://{tmp_path}/s") as store:  # the budget is kept by the store
        assert store.put_many([(state(3), [bytes(MiB)])]) == [True]
        assert store.exists_many([state(i) for i in range(4)]) == [True, False, True, True]


def test_budget_as_a_share_of_the_capacity_and_made_smaller(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=32MiB&states=25%") as store:
        assert store.stats().state_budget == 8 * MiB
        assert all(store.put_many([(state(i), [bytes(MiB)]) for i in range(8)]))
    with open_store(f"local://{path}?states=2MiB") as store:  # shrinking evicts at open
        assert store.stats().state_bytes == held_by_states(path) <= 2 * MiB
        # put together, the first given ranks most recent
        assert store.exists_many([state(i) for i in range(8)]) == [True, True] + [False] * 6
    with open_store(f"local://{path}?states=0") as store:  # no budget: states share it all
        assert store.stats().state_budget is None
        assert all(store.put_many([(state(i), [bytes(MiB)]) for i in range(10, 20)]))
        assert store.stats().state_bytes == held_by_states(path) >= 10 * MiB  # still counted


def test_a_state_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    with open_store(f"local://{tmp_path}/s?capacity=32MiB&states=1MiB") as store:
        assert store.put_many([(state(0), [bytes(2 * MiB)]), (block(0), [bytes(2 * MiB)])]) == [False, True]
        assert store.put_if_absent(state(1), bytes(2 * MiB)) is False


def test_small_states_inline_count_too(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=32MiB&states=100KiB") as store:
        for i in range(10):  # 30 KiB each: inline in the index
            assert store.put_many([(state(i), [bytes(30 << 10)])]) == [True]
        assert held_by_states(path) <= 100 << 10
        assert store.exists_many([state(i) for i in range(10)]) == [False] * 7 + [True] * 3


@pytest.mark.parametrize(
    ("query", "message"),
    [("states=lots", "states='lots'"), ("states=150%", "between 0% and 100%"),
     ("capacity=8MiB&states=9MiB", "more than its capacity")],
)
def test_bad_budgets(tmp_path: Path, query: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(f"local://{tmp_path}/s?{query}")


def test_a_store_made_before_budgets_is_counted_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=32MiB") as store:
        assert all(store.put_many([(state(i), [bytes(MiB)]) for i in range(6)]
                                  + [(block(i), [bytes(MiB)]) for i in range(6)]))
    conn = sqlite3.connect(path / INDEX_NAME)  # what an index of an earlier version looks like
    conn.execute("DROP INDEX keys_pool")
    conn.execute("ALTER TABLE keys DROP COLUMN pool")
    conn.execute("DELETE FROM meta WHERE name IN ('state_bytes', 'state_budget', 'state_share_ppm')")
    conn.commit()
    conn.close()
    with open_store(f"local://{path}", readonly=True) as store:  # counted key by key, changed not
        assert store.stats().state_bytes == held_by_states(path) == 6 * MiB
    with open_store(f"local://{path}?states=3MiB") as store:
        assert store.stats().state_bytes == held_by_states(path) <= 3 * MiB
        assert all(store.exists_many([block(i) for i in range(6)]))
    conn = sqlite3.connect(path / INDEX_NAME)
    assert conn.execute("SELECT COUNT(*) FROM keys WHERE pool = ?", (STATES,)).fetchone()[0] == 3
    # A writer of an earlier version adds a state without marking it: the next open marks it,
    # counts it, and (the oldest state, over the budget) evicts it.
    conn.execute("INSERT INTO keys (key, size, cls, slab, slot, gen, last_used, data)"
                 " VALUES (?, 100, 0, NULL, NULL, 999999, 0, ?)", (state(99), bytes(100)))
    conn.execute("UPDATE meta SET value = value + 100 WHERE name = 'inline_bytes'")
    conn.commit()
    conn.close()
    assert held_by_states(path) == 3 * MiB + 100
    with open_store(f"local://{path}") as store:
        assert store.stats().state_bytes == held_by_states(path) == 3 * MiB
        assert store.exists_many([state(99)]) == [False]


def test_every_way_a_state_leaves_is_counted(tmp_path: Path) -> None:
    """Whole slabs dropped for other sizes, slots taken by the capacity, deletes: the count
    always equals a recount."""
    path = tmp_path / "a"
    with open_store(f"local://{path}?capacity=64MiB&states=8MiB") as store:
        for i in range(16):
            assert store.put_many([(state(i), [bytes(200 << 10)])]) == [True]
        for i in range(400):  # KV of another size pushes the states' slabs out
            store.put_many([(block(i), [bytes(150 << 10)])])
        assert store.stats().state_bytes == held_by_states(path)
        share = 256 << 10  # a 200 KiB state's slot: its share of its slab
        assert store.stats().state_bytes < 16 * share
    path = tmp_path / "b"
    with open_store(f"local://{path}?capacity=16MiB&states=100%") as store:
        for i in range(40):  # the capacity evicts states slot by slot (one size class)
            assert store.put_many([(state(i), [bytes(MiB)])]) == [True]
            assert store.stats().state_bytes == held_by_states(path)
        assert store.delete_many([state(39), state(38)]) == 2
        assert store.stats().state_bytes == held_by_states(path)


def test_a_batch_of_states_keeps_its_first(tmp_path: Path) -> None:
    """Put together, the first state given ranks most recent: when only one fits, the later
    ones are refused, never the first evicted for them."""
    with open_store(f"local://{tmp_path}/s?capacity=64MiB&states=1MiB") as store:
        assert store.put_many([(state(0), [bytes(MiB)]), (state(1), [bytes(MiB)])]) == [True, False]
        assert store.exists_many([state(0), state(1)]) == [True, False]
        assert store.put_many([(state(2), [bytes(MiB)])]) == [True]  # a later put: 0 is older
        assert store.exists_many([state(0), state(2)]) == [False, True]


def test_an_inline_state_over_its_budget_evicts_a_state_not_kv(tmp_path: Path) -> None:
    with open_store(f"local://{tmp_path}/s?capacity=4MiB&states=100KiB") as store:
        i = 0
        while store.stats().evictions == 0:  # fill the store with KV
            assert store.put_many([(block(i), [bytes(100 << 10)])]) == [True]
            i += 1
        for j in range(3):
            assert store.put_many([(state(j), [bytes(30 << 10)])]) == [True]
        kv = sum(store.exists_many([block(k) for k in range(i)]))
        for j in range(3, 11):  # over the budget: each evicts the oldest state
            assert store.put_many([(state(j), [bytes(30 << 10)])]) == [True]
        assert sum(store.exists_many([block(k) for k in range(i)])) == kv


def test_a_share_follows_the_capacity_and_a_rebuild_keeps_the_budget(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=64MiB&states=50%") as store:
        assert store.stats().state_budget == 32 * MiB
    with open_store(f"local://{path}?capacity=8MiB") as store:
        assert store.stats().state_budget == 4 * MiB
    LocalStore.rebuild(path)
    with open_store(f"local://{path}") as store:
        assert (store.stats().capacity, store.stats().state_budget) == (8 * MiB, 4 * MiB)
    with open_store(f"local://{path}?capacity=64MiB&states=16MiB") as store:
        assert store.stats().state_budget == 16 * MiB
    with open_store(f"local://{path}?capacity=8MiB") as store:  # a size is held to the capacity
        assert store.stats().state_budget == 8 * MiB
    with open_store(f"local://{path}?capacity=64MiB") as store:  # ... while it is smaller
        assert store.stats().state_budget == 16 * MiB


def _put_states_and_blocks(path: str, seed: int) -> None:
    store = LocalStore(path)
    for i in range(40):
        k = seed * 1000 + i
        store.put_many([(state(k), [bytes(200 << 10)]), (block(k), [bytes(150 << 10)])])
        if i % 7 == 6:
            store.delete_many([state(k - 3)])
    store.close()


def test_writers_in_several_processes_keep_the_count(tmp_path: Path) -> None:
    path = tmp_path / "s"
    LocalStore(path, capacity=32 * MiB, states=StateBudget(nbytes=2 * MiB)).close()
    procs = [SPAWN.Process(target=_put_states_and_blocks, args=(str(path), n)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with open_store(f"local://{path}") as store:
        assert store.stats().state_bytes == held_by_states(path) <= 2 * MiB


@pytest.mark.parametrize("capacity", [256, 10])
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "delete", "touch"]), st.booleans(),
                          st.integers(0, 11), st.integers(1, 5)), max_size=40))
def test_states_never_pass_their_budget(tmp_path_factory: pytest.TempPathFactory, capacity: int,
                                        ops: list[tuple[str, bool, int, int]]) -> None:
    """Whatever is put, replaced, deleted or touched: the states' count is right and within
    the budget. With ample capacity only states were evicted for it; with little, the store
    also evicts by recency (slots, whole slabs of another size) and the count stays right."""
    path = tmp_path_factory.mktemp("budget") / "s"
    blocks: set[int] = set()
    with open_store(f"local://{path}?capacity={capacity}MiB&states=5MiB") as store:
        for op, is_state, i, size in ops:
            key = state(i) if is_state else block(i)
            if op == "put":
                assert store.put_many([(key, [bytes(size * 300 << 10)])]) == [True]
                if not is_state:
                    blocks.add(i)
            elif op == "delete":
                store.delete_many([key])
                if not is_state:
                    blocks.discard(i)
            else:
                store.touch_many([key])
            assert store.stats().state_bytes == held_by_states(path) <= 5 * MiB
        if capacity == 256:
            assert all(store.exists_many([block(i) for i in sorted(blocks)]))


def test_a_state_that_cannot_fit_evicts_nothing(tmp_path: Path) -> None:
    """Its slot's share of a slab (here 1 MiB for 700 KiB) is larger than the budget: it is
    refused before any state is evicted for it or any slab is made."""
    with open_store(f"local://{tmp_path}/s?capacity=64MiB&states=900KiB") as store:
        assert isinstance(store, LocalStore)
        assert all(store.put_many([(state(i), [bytes(200 << 10)]) for i in range(3)]))
        slabs = store.usage().slabs
        assert store.put_many([(state(9), [bytes(700 << 10)])]) == [False]
        assert store.exists_many([state(i) for i in range(3)]) == [True] * 3
        assert store.usage().slabs == slabs


def test_a_slab_the_store_loses_takes_its_states_count(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=64MiB&states=8MiB") as store:
        assert all(store.put_many([(state(i), [bytes(200 << 10)]) for i in range(4)]))
        assert all(store.put_many([(block(i), [bytes(MiB)]) for i in range(2)]))
        conn = sqlite3.connect(path / INDEX_NAME)
        (slab,) = conn.execute("SELECT slab FROM keys WHERE key = ?", (state(0),)).fetchone()
        conn.close()
        os.truncate(_arena.slab_path(path, slab), 0)  # cut short by something else
        assert store.get_many([state(0)]) == [None]  # noticed: the slab is forgotten
        assert store.stats().state_bytes == held_by_states(path) == 0
        assert all(store.exists_many([block(i) for i in range(2)]))


def test_a_damaged_index_without_a_slab_row_still_deletes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=64MiB&states=8MiB") as store:
        assert all(store.put_many([(state(0), [bytes(200 << 10)])]))
    conn = sqlite3.connect(path / INDEX_NAME)
    conn.execute("DELETE FROM slabs")  # a slab row gone under a key (damage, or a hand edit)
    conn.commit()
    conn.close()
    with open_store(f"local://{path}") as store:
        assert store.delete_many([state(0)]) == 1
        assert store.stats().state_bytes == held_by_states(path) == 0


def test_a_clock_stepped_back_still_evicts_the_older_states(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """States stamped before the wall clock stepped back look newer than a new batch: they
    are still the ones to go, never the batch's own."""
    with open_store(f"local://{tmp_path}/s?capacity=64MiB&states=2MiB") as store:
        for i in range(2):
            assert store.put_many([(state(i), [bytes(MiB)])]) == [True]
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 60)
        assert store.put_many([(state(2), [bytes(MiB)]), (block(0), [bytes(MiB)]),
                               (state(3), [bytes(MiB)])]) == [True, True, True]
        assert store.exists_many([state(i) for i in range(4)]) == [False, False, True, True]
