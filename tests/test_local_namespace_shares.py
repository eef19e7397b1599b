"""The local store's bound per namespace (``?namespace_share=``): a namespace filling the store
evicts only its own objects, so every other namespace keeps what it holds within its bound."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.keys import KeySpace
from prefixvault.stores import StoreError, open_store
from prefixvault.stores._index import INDEX_NAME, ns_of
from prefixvault.stores.base import Store, namespace_of
from prefixvault.stores.local import LocalStore

KiB, MiB = 1 << 10, 1 << 20
NAMES = ("tenant-a", "tenant-b", "tenant-c")
SPAWN = mp.get_context("spawn")


def block(ns: str, i: int) -> str:
    return KeySpace(ns, bytes(8)).block(0, 0, i.to_bytes(16, "big"))


def state(ns: str, i: int) -> str:
    return KeySpace(ns, bytes(8)).state(1, 0, i.to_bytes(16, "big"))


def held(path: Path) -> dict[str, int]:
    """Each namespace's space counted afresh from the index, key by key (not from the store's
    own count): an inline object takes its bytes, one in a slab its share of the slab."""
    conn = sqlite3.connect(path / INDEX_NAME)
    try:
        slabs = {sid: nbytes // nslots for sid, nbytes, nslots in conn.execute(
            "SELECT id, nbytes, nslots FROM slabs")}
        out: dict[str, int] = {}
        for key, size, slab in conn.execute("SELECT key, size, slab FROM keys"):
            ns = namespace_of(key)
            out[ns] = out.get(ns, 0) + int(slabs[slab] if slab is not None else size)
        return out
    finally:
        conn.close()


def counted(path: Path) -> dict[str, int]:
    """What the store keeps in ``ns_held`` (namespaces holding nothing left out)."""
    conn = sqlite3.connect(path / INDEX_NAME)
    try:
        return {ns: int(n) for ns, n in conn.execute("SELECT ns, bytes FROM ns_held") if n}
    finally:
        conn.close()


def present(store: Store, keys: list[str]) -> set[str]:
    return {k for k, ok in zip(keys, store.exists_many(keys), strict=True) if ok}


def test_a_key_s_namespace_in_python_and_sql() -> None:
    keys = [block("tenant-a", 1), "plain", "/lead", "a/b/c", "x.y/z"]
    conn = sqlite3.connect(":memory:")
    in_sql = [conn.execute(f"SELECT {ns_of('?')}", (k, k)).fetchone()[0] for k in keys]
    assert [namespace_of(k) for k in keys] == in_sql == ["tenant-a", "", "", "a", "x.y"]


def test_one_namespace_filling_the_store_leaves_the_other_whole(tmp_path: Path) -> None:
    """B keeps a working set within its share; A puts twenty times the capacity. Objects of
    112 KiB slots share slabs between the two namespaces."""
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=32MiB&namespace_share=50%") as store:
        mine = [block("tenant-b", i) for i in range(120)]  # 120 x 128 KiB: 15 of 16 MiB
        assert store.put_many([(k, [bytes([7]) * (100 * KiB)]) for k in mine]) == [True] * 120
        for i in range(0, 6000, 50):
            assert all(store.put_many([(block("tenant-a", j), [bytes(100 * KiB)]) for j in range(i, i + 50)]))
        assert present(store, mine) == set(mine)
        assert store.get_many(mine[:1]) == [bytes([7]) * (100 * KiB)]
        assert counted(path) == held(path)
        assert held(path)["tenant-a"] <= 16 * MiB
        newest = [block("tenant-a", j) for j in range(5950, 6000)]
        assert present(store, newest) == set(newest)  # A still caches, from its own oldest


def test_without_a_bound_the_same_fill_evicts_the_other(tmp_path: Path) -> None:
    """The control: the store's global recency takes B's objects."""
    with open_store(f"local://{tmp_path}/s?capacity=32MiB") as store:
        mine = [block("tenant-b", i) for i in range(120)]
        assert all(store.put_many([(k, [bytes(100 * KiB)]) for k in mine]))
        for i in range(0, 6000, 50):
            store.put_many([(block("tenant-a", j), [bytes(100 * KiB)]) for j in range(i, i + 50)])
        assert not present(store, mine)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 3), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40),
                                              st.sampled_from([10, 100, 300, 700]),
                                              st.sampled_from(["put", "put", "put", "touch", "delete"])),
                                    min_size=1, max_size=80))
def test_no_namespace_loses_an_object_to_another_s_puts(
        tmp_path_factory: pytest.TempPathFactory, n: int, ops: list[tuple[int, int, int, str]]) -> None:
    """Interleaved puts (inline, slots sharing slabs, whole slabs), touches and deletes of two
    or three namespaces, each bounded to its share of the capacity: an object leaves only
    through its own namespace's calls, every count equals a recount and stays within the bound."""
    path = tmp_path_factory.mktemp("shares") / "s"
    capacity, share = 12 * MiB, 100 // n
    budget = capacity * share // 100
    names = NAMES[:n]
    ever: dict[str, list[str]] = {ns: [] for ns in names}
    with open_store(f"local://{path}?capacity={capacity}&namespace_share={share}%") as store:
        for who, i, kib, op in ops:
            ns = names[who % n]
            key = (state if i % 3 == 0 else block)(ns, i)
            others = [k for other in names if other != ns for k in ever[other]]
            before = present(store, others)
            if op == "put":
                store.put_many([(key, [bytes(kib * KiB)])])
                if key not in ever[ns]:
                    ever[ns].append(key)
            elif op == "touch":
                store.touch_many([key])
            else:
                store.delete_many([key])
            assert present(store, others) == before, f"{ns}'s {op} took another namespace's object"
            assert counted(path) == held(path)
            assert all(v <= budget for v in held(path).values())


def test_the_bound_survives_reopening_and_a_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "s"
    LocalStore(path, capacity=16 * MiB).close()  # made without a bound
    with open_store(f"local://{path}?namespace_share=4MiB") as store:
        assert all(store.put_many([(block("tenant-b", i), [bytes(MiB)]) for i in range(3)]))
    for query in ("", "?capacity=16MiB"):  # opened again without the parameter: kept
        with open_store(f"local://{path}{query}") as store:
            for i in range(40):  # one by one: of a batch past the bound the later are refused
                assert store.put_many([(block("tenant-a", i), [bytes(MiB)])]) == [True]
            assert store.exists_many([block("tenant-b", i) for i in range(3)]) == [True] * 3
            assert held(path)["tenant-a"] <= 4 * MiB
    LocalStore.rebuild(path)
    conn = sqlite3.connect(path / INDEX_NAME)
    assert dict(conn.execute("SELECT name, value FROM meta WHERE name LIKE 'ns_%'")) == {
        "ns_size": 4 * MiB, "ns_budget": 4 * MiB}
    conn.close()
    with open_store(f"local://{path}?namespace_share=0") as store:  # removed: global recency again
        for i in range(10):
            assert store.put_many([(block("tenant-a", i), [bytes(MiB)])]) == [True]
        assert held(path)["tenant-a"] > 4 * MiB


def test_a_store_made_before_bounds_opens_and_is_trimmed_by_a_bound(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=32MiB") as store:  # no ns_held, no keys_ns
        assert all(store.put_many([(block("tenant-a", i), [bytes(MiB)]) for i in range(12)]))
        assert all(store.put_many([(block("tenant-b", i), [bytes(MiB)]) for i in range(3)]))
    conn = sqlite3.connect(path / INDEX_NAME)
    made = conn.execute("SELECT name FROM sqlite_master WHERE name IN ('ns_held', 'keys_ns')").fetchall()
    assert made == []
    conn.close()
    with open_store(f"local://{path}", readonly=True) as store:
        assert len(list(store.scan())) == 15
    with open_store(f"local://{path}?namespace_share=25%") as store:  # 8 MiB each, A trimmed at open
        assert counted(path) == held(path) == {"tenant-a": 8 * MiB, "tenant-b": 3 * MiB}
        # put together, the first given ranks most recent: the last four went
        assert store.exists_many([block("tenant-a", i) for i in range(12)]) == [True] * 8 + [False] * 4
        assert all(store.exists_many([block("tenant-b", i) for i in range(3)]))


def test_every_way_an_object_leaves_is_counted(tmp_path: Path) -> None:
    """Whole slabs given to another size, deletes, replacements, a slab lost, a repair: each
    namespace's count always equals a recount."""
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=16MiB&namespace_share=100%") as store:
        assert isinstance(store, LocalStore)
        for i in range(30):
            assert all(store.put_many([(state("tenant-a", i), [bytes(200 * KiB)]),
                                       (block("tenant-b", i), [bytes(30 * KiB)])]))
        for i in range(200):  # one namespace alone: it evicts its own slabs of another size
            store.put_many([(block("tenant-a", i), [bytes(150 * KiB)])])
            assert counted(path) == held(path)
        assert store.delete_many([block("tenant-a", 199), block("tenant-b", 0)]) == 2
        assert store.put_many([(block("tenant-a", 198), [bytes(10 * KiB)])]) == [True]
        assert counted(path) == held(path)
        conn = sqlite3.connect(path / INDEX_NAME)
        conn.execute("DELETE FROM keys WHERE key = ?", (block("tenant-b", 1),))  # damage
        conn.commit()
        conn.close()
        store.heal()
        assert counted(path) == held(path)


def test_a_batch_keeps_its_first_and_an_object_larger_than_the_bound_is_refused(tmp_path: Path) -> None:
    with open_store(f"local://{tmp_path}/s?capacity=16MiB&namespace_share=2MiB") as store:
        batch = [(block("tenant-a", i), [bytes(MiB)]) for i in range(3)]
        assert store.put_many(batch) == [True, True, False]
        assert store.put_many([(block("tenant-a", 9), [bytes(3 * MiB)])]) == [False]
        assert store.put_if_absent(block("tenant-a", 8), bytes(3 * MiB)) is False
        assert store.exists_many([block("tenant-a", i) for i in range(2)]) == [True, True]


def test_states_over_their_budget_evict_states_of_their_own_namespace(tmp_path: Path) -> None:
    with open_store(f"local://{tmp_path}/s?capacity=32MiB&states=4MiB&namespace_share=50%") as store:
        assert all(store.put_many([(state("tenant-b", i), [bytes(MiB)]) for i in range(2)]))
        for i in range(10):
            assert store.put_many([(state("tenant-a", i), [bytes(MiB)])]) == [True]
        assert store.exists_many([state("tenant-b", i) for i in range(2)]) == [True, True]
        assert store.stats().state_bytes <= 4 * MiB


def _fill(path: str, ns: str, count: int) -> None:
    """A writer in a process of its own: ``count`` objects of ``ns`` (sizes that share slabs
    with the other writers' and slabs of sizes of their own), batch by batch, as a producer
    engine saves."""
    with open_store(f"local://{path}") as store:
        for i in range(0, count, 8):
            store.put_many([(block(ns, j), [bytes((60 + 50 * (j % 3)) * KiB)]) for j in range(i, i + 8)])


def _use(path: str, keys: list[str], rounds: int) -> None:
    """A reader in a process of its own: reads and touches ``keys`` again and again, as the
    lookups and loads of an engine serving them do."""
    with open_store(f"local://{path}") as store:
        for _ in range(rounds):
            store.touch_many(keys)
            store.get_many(keys[:4])


def test_writers_in_several_processes_keep_every_namespace_within_its_bound(tmp_path: Path) -> None:
    """Two engines' processes fill the store with their namespaces' objects at once (each ten
    times its bound), while a third process keeps reading tenant B's working set: B loses
    nothing, no namespace passes its bound, and the store's count equals a recount."""
    path = tmp_path / "s"
    with open_store(f"local://{path}?capacity=24MiB&namespace_share=33%") as store:
        mine = [block("tenant-b", i) for i in range(50)]  # 50 x 112 KiB slots: 5.5 of 8 MiB
        assert all(store.put_many([(k, [bytes([7]) * (100 * KiB)]) for k in mine]))
    procs = [SPAWN.Process(target=_fill, args=(str(path), ns, 800)) for ns in ("tenant-a", "tenant-c")]
    procs.append(SPAWN.Process(target=_use, args=(str(path), mine, 200)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    assert counted(path) == held(path)
    assert all(v <= 24 * MiB * 33 // 100 for v in held(path).values()), held(path)
    assert held(path).keys() == {"tenant-a", "tenant-b", "tenant-c"}
    with open_store(f"local://{path}") as store:
        assert present(store, mine) == set(mine)
        assert store.get_many(mine[-1:]) == [bytes([7]) * (100 * KiB)]
        for ns in ("tenant-a", "tenant-c"):  # each still caches: its newest objects are in
            newest = [block(ns, j) for j in range(792, 800)]
            assert present(store, newest) == set(newest), ns


@pytest.mark.parametrize(
    ("query", "message"),
    [("namespace_share=lots", "namespace_share='lots'"), ("namespace_share=150%", "between 0% and 100%"),
     ("namespace_share=-5%", "between 0% and 100%"),
     ("capacity=8MiB&namespace_share=9MiB", "namespace_share=9437184 bytes is more than its capacity"),
     ("namespace_shares=25%", "unknown local store parameter")],
)
def test_bad_bounds_are_refused_in_one_line(tmp_path: Path, query: str, message: str) -> None:
    with pytest.raises(StoreError, match=message) as raised:
        open_store(f"local://{tmp_path}/s?{query}")
    assert "\n" not in str(raised.value)
