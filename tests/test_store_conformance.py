"""What every store must do, written against the Store contract only."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from prefixvault.stores import Store, StoreError, open_store

SPAWN = mp.get_context("spawn")
UriFactory = Callable[..., str]  # the store_uri_factory fixture

#: Sizes that cross every storage path a store may have: empty, tiny, around a small-object
#: threshold, around a page, a few MiB, and more than a modest store's slab.
SIZES = [0, 1, 100, 4095, 4096, 65535, 65536, 65537, 300_000, 1 << 20, 3_000_001, 9 << 20]


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ between seeds and between positions."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def version(writer: int, seq: int, size: int) -> bytes:
    """A self-describing version: its stamp (writer, seq, size) repeated to ``size`` bytes."""
    stamp = struct.pack("<IIQ", writer, seq, size)
    return (stamp * (size // len(stamp) + 1))[:size]


def whole(data: bytes) -> bool:
    """Whether ``data`` is exactly one version as written by ``version``."""
    if len(data) < 16:
        return False
    writer, seq, size = struct.unpack_from("<IIQ", data)
    return size == len(data) and data == version(writer, seq, size)


def same_size_mix(data: bytes) -> bool:
    """Whether ``data`` is made of parts of versions of its own size only (each whole stamp
    names that size): what a read racing an in-place overwrite returns."""
    n = len(data) // 16
    return n > 0 and bool((np.frombuffer(data, "<u8", count=2 * n)[1::2] == len(data)).all())


def versioned_size(writer: int, seq: int) -> int:
    # Sizes move between small (inline) and large objects, so overwrites change slots.
    return [200, 70_000, 400_000, 1_500_000][(writer + seq) % 4] + seq % 5


# -- round trips -------------------------------------------------------------------------


def test_round_trip_every_size(store_spec: Any, any_store: Store) -> None:
    items = [(f"obj/{n}", pattern(n, n)) for n in SIZES if n or store_spec.empty_objects]
    assert any_store.put_many([(k, [v]) for k, v in items]) == [True] * len(items)
    assert any_store.get_many([k for k, _ in items]) == [v for _, v in items]
    bufs = [bytearray(len(v) + 10) for _, v in items]
    sizes = any_store.get_into([k for k, _ in items], [memoryview(b) for b in bufs])
    assert sizes == [len(v) for _, v in items]
    for buf, (_, v) in zip(bufs, items, strict=True):
        assert bytes(buf[: len(v)]) == v
        assert bytes(buf[len(v) :]) == bytes(10), "get_into wrote past the object"


def test_multi_part_put_concatenates_any_buffers(any_store: Store) -> None:
    header = b"HDR:" + bytes(range(60))
    payload = np.arange(300_000, dtype=np.float32).reshape(1000, 300)
    tail = bytearray(b"tail" * 1000)
    parts: list[Any] = [header, memoryview(payload), tail, b"", memoryview(b"end")]
    expect = header + payload.tobytes() + bytes(tail) + b"end"
    assert any_store.put_many([("multi", parts), ("small", [b"a", b"b", b"c"])]) == [True, True]
    assert any_store.get_many(["multi", "small"]) == [expect, b"abc"]
    out = np.zeros(len(expect), dtype=np.uint8)
    assert any_store.get_into(["multi"], [memoryview(out)]) == [len(expect)]
    assert out.tobytes() == expect


def test_filled_puts_and_taken_gets_move_every_size(store_spec: Any, any_store: Store) -> None:
    """``put_filled`` stores what each fill writes; ``get_taken`` hands each object whole to
    ``take`` (its last call per key counts), and never calls it for a missing or too large one."""
    items = [(f"fill/{n}", pattern(n + 1, n)) for n in SIZES if n or store_spec.empty_objects]

    def filler(data: bytes) -> Callable[[memoryview], None]:
        def fill(dst: memoryview) -> None:
            assert len(dst) == len(data)
            dst[:] = data
        return fill

    assert any_store.put_filled([(k, len(v), filler(v)) for k, v in items]) == [True] * len(items)
    assert any_store.get_many([k for k, _ in items]) == [v for _, v in items]
    keys = [k for k, _ in items] + ["fill/missing", items[-1][0]]
    bufs = [bytearray(len(v)) for _, v in items] + [bytearray(8), bytearray(8)]  # the last: too small
    taken: dict[int, bytes] = {}

    def take(i: int, src: memoryview, dst: memoryview) -> None:
        assert len(src) <= len(dst)
        taken[i] = bytes(src)  # (a decryption would write dst)

    sizes = any_store.get_taken(keys, [memoryview(b) for b in bufs], take)
    assert sizes == [len(v) for _, v in items] + [None, len(items[-1][1])]
    assert taken == {i: v for i, (_, v) in enumerate(items)}


def test_same_uri_opened_twice_shares_objects(store_kind: str, store_uri_factory: UriFactory) -> None:
    uri = store_uri_factory(store_kind)
    with open_store(uri) as one, open_store(uri) as two:
        assert one.put_many([("shared/a", [b"a"]), ("shared/b", [pattern(3, 200_000)])]) == [True] * 2
        assert two.get_many(["shared/a", "shared/b"]) == [b"a", pattern(3, 200_000)]
        assert two.delete_many(["shared/a"]) == 1
        assert one.exists_many(["shared/a", "shared/b"]) == [False, True]


def test_get_into_typed_buffer(any_store: Store) -> None:
    src = np.arange(200_000, dtype=np.float16)
    assert any_store.put_many([("typed", [memoryview(src)])]) == [True]
    dst = np.zeros_like(src)
    assert any_store.get_into(["typed"], [memoryview(dst)]) == [src.nbytes]
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("size", [100, 200_000])
def test_get_into_too_small_buffer_reports_size_and_copies_nothing(any_store: Store, size: int) -> None:
    data = pattern(size, size)
    any_store.put_many([("big", [data])])
    small = bytearray(b"\xee" * (size - 1))
    assert any_store.get_into(["big"], [memoryview(small)]) == [size]
    assert small == bytearray(b"\xee" * (size - 1))


def test_batches_with_duplicates_and_missing(any_store: Store) -> None:
    results = any_store.put_many(
        [("dup", [b"first"]), ("other", [pattern(1, 90_000)]), ("dup", [pattern(2, 80_000)])]
    )
    assert results == [True, True, True]
    keys = ["dup", "missing", "other", "dup", "missing/too"]
    got = any_store.get_many(keys)
    assert got == [pattern(2, 80_000), None, pattern(1, 90_000), pattern(2, 80_000), None]
    bufs = [memoryview(bytearray(100_000)) for _ in keys]
    assert any_store.get_into(keys, bufs) == [80_000, None, 90_000, 80_000, None]
    assert bytes(bufs[3][:80_000]) == pattern(2, 80_000)
    assert any_store.exists_many(keys) == [True, False, True, True, False]
    assert any_store.stats().objects == 2


def test_touch_and_get_answers_as_touch_many_and_get_many(any_store: Store) -> None:
    """What a lookup's first round trip asks: some keys checked (touched as marked), some read."""
    big = pattern(3, 90_000)
    assert any_store.put_many([("tg/a", [b"alpha"]), ("tg/b", [big])]) == [True, True]
    found, blobs = any_store.touch_and_get(["tg/a", "tg/none", "tg/b"], [True, True, False],
                                           ["tg/b", "tg/none", "tg/a"])
    assert found == [True, False, True] and blobs == [big, None, b"alpha"]
    assert any_store.touch_and_get([], [], ["tg/a", "tg/c"]) == ([], [b"alpha", None])
    assert any_store.touch_and_get(["tg/a", "tg/c"], None, []) == ([True, False], [])
    assert any_store.touch_and_get([], None, []) == ([], [])


def test_empty_batches(any_store: Store) -> None:
    assert any_store.put_many([]) == []
    assert any_store.get_many([]) == []
    assert any_store.get_into([], []) == []
    assert any_store.exists_many([]) == []
    assert any_store.delete_many([]) == 0


def test_overwrite_across_sizes(store_spec: Any, any_store: Store) -> None:
    sizes = [10, 500_000, 0, 2_000_000, 70_000, 9 << 20, 5]
    for i, size in enumerate(n for n in sizes if n or store_spec.empty_objects):
        data = pattern(i, size)
        assert any_store.put_many([("k", [data])]) == [True]
        assert any_store.get_many(["k"]) == [data]
        stats = any_store.stats()
        assert (stats.objects, stats.bytes) == (1, size)
    assert list(any_store.scan()) == [("k", 5)]


def test_delete_and_exists(any_store: Store) -> None:
    any_store.put_many([(f"d/{i}", [pattern(i, 100_000 * (i % 2) + i + 1)]) for i in range(6)])
    assert any_store.delete_many(["d/0", "d/1", "d/1", "nope"]) == 2
    assert any_store.exists_many([f"d/{i}" for i in range(6)]) == [False, False] + [True] * 4
    assert any_store.get_many(["d/0", "d/1", "d/2"]) == [None, None, pattern(2, 3)]
    assert any_store.get_into(["d/1"], [memoryview(bytearray(200_000))]) == [None]
    assert any_store.delete_many(["d/0"]) == 0
    stats = any_store.stats()
    assert stats.objects == 4
    assert stats.bytes == sum(100_000 * (i % 2) + i + 1 for i in range(2, 6))
    # The space is reusable.
    assert any_store.put_many([("d/1", [b"again"])]) == [True]
    assert any_store.get_many(["d/1"]) == [b"again"]


def test_zero_length_objects(store_spec: Any, any_store: Store) -> None:
    if not store_spec.empty_objects:
        # Refused cleanly: False, never an exception, and nothing half-stored afterwards.
        refused = any_store.put_many([("empty/a", []), ("empty/b", [b""]), ("x", [b"1"])])
        assert refused == [False, False, True]
        assert any_store.get_many(["empty/a", "empty/b"]) == [None, None]
        assert any_store.exists_many(["empty/a", "empty/b"]) == [False, False]
        assert any_store.put_if_absent("empty/d", b"") is False
        assert any_store.put_if_absent("empty/d", b"x") is True
        assert list(any_store.scan("empty/")) == [("empty/d", 1)]
        return
    assert any_store.put_many([("empty/a", []), ("empty/b", [b""]), ("empty/c", [b"", b""])]) == [True] * 3
    assert any_store.get_many(["empty/a", "empty/b", "empty/c"]) == [b"", b"", b""]
    assert any_store.get_into(["empty/a"], [memoryview(bytearray(0))]) == [0]
    assert any_store.exists_many(["empty/a"]) == [True]
    assert sorted(any_store.scan("empty/")) == [("empty/a", 0), ("empty/b", 0), ("empty/c", 0)]
    assert any_store.put_if_absent("empty/d", b"") is True
    assert any_store.put_if_absent("empty/d", b"x") is False
    assert any_store.get_many(["empty/d"]) == [b""]


def test_scan_prefix_and_stats(any_store: Store) -> None:
    sizes = {"a/1": 10, "a/2": 200_000, "a/:x=y": 1, "ab": 3, "b/a/1": 70_000}
    any_store.put_many([(k, [bytes(n)]) for k, n in sizes.items()])
    assert sorted(any_store.scan("a/")) == [("a/1", 10), ("a/2", 200_000), ("a/:x=y", 1)]
    assert sorted(any_store.scan()) == sorted(sizes.items())
    assert sorted(any_store.scan("a")) == sorted((k, n) for k, n in sizes.items() if k[0] == "a")
    assert list(any_store.scan("zzz")) == []
    stats = any_store.stats()
    assert (stats.objects, stats.bytes) == (5, sum(sizes.values()))


def test_invalid_keys_are_rejected(any_store: Store) -> None:
    for bad in ["", "has space", "x" * 251, "é", "a\nb"]:
        with pytest.raises(ValueError):
            any_store.put_many([(bad, [b"x"])])
        with pytest.raises(ValueError):
            any_store.get_many([bad])
        with pytest.raises(ValueError):
            any_store.put_if_absent(bad, b"x")
    assert any_store.stats().objects == 0


def test_object_larger_than_capacity_is_refused_not_raised(
    store_kind: str, store_uri_factory: UriFactory
) -> None:
    with open_store(store_uri_factory(store_kind, capacity="4MiB")) as store:
        assert store.put_many([("huge", [bytes(5 << 20)]), ("ok", [b"fine"])]) == [False, True]
        assert store.get_many(["huge", "ok"]) == [None, b"fine"]
        assert store.put_if_absent("huge2", bytes(5 << 20)) is False


def test_small_objects_filling_the_store_make_way_for_a_large_one(
    store_kind: str, store_uri_factory: UriFactory
) -> None:
    with open_store(store_uri_factory(store_kind, capacity="4MiB")) as store:
        for i in range(100):  # 6 MB of small objects through a 4 MiB store
            assert store.put_many([(f"small/{i}", [pattern(i, 60_000)])]) == [True]
        assert store.stats().bytes > 3 << 20
        assert store.put_many([("large", [pattern(7, 1 << 20)])]) == [True]
        assert store.get_many(["large"]) == [pattern(7, 1 << 20)]
        assert store.stats().bytes <= 4 << 20
        assert store.exists_many(["small/99"]) == [True]


# -- put_if_absent races -----------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 300_000])
def test_put_if_absent_threads_exactly_one_wins(any_store: Store, size: int) -> None:
    n = 8
    barrier = threading.Barrier(n)
    results: list[bool] = [False] * n

    def contend(i: int) -> None:
        barrier.wait()
        results[i] = any_store.put_if_absent("race", version(i, 0, size))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    winner = results.index(True)
    assert any_store.get_many(["race"]) == [version(winner, 0, size)]


@pytest.mark.parametrize("size", [64, 300_000])
def test_put_if_absent_many_threads_exactly_one_wins_per_key(any_store: Store, size: int) -> None:
    """Batches over overlapping keys, some already stored: each key has one winner, whose
    bytes are what every reader gets; a key stored before stays as it was."""
    assert any_store.put_if_absent("batch/old", b"before") is True
    n, keys = 6, [f"batch/{k}" for k in range(5)]
    barrier = threading.Barrier(n)
    results: list[list[bool]] = [[] for _ in range(n)]

    def contend(i: int) -> None:
        mine = [*keys[i % 2 :], "batch/old"]  # overlapping, in different orders
        barrier.wait()
        won = any_store.put_if_absent_many([(k, version(i, j, size)) for j, k in enumerate(mine)])
        results[i] = [k for k, w in zip(mine, won, strict=True) if w]

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in keys:
        winners = [i for i in range(n) if key in results[i]]
        assert len(winners) == 1, f"{key}: winners {winners}"
        i = winners[0]
        mine = [*keys[i % 2 :], "batch/old"]
        assert any_store.get_many([key]) == [version(i, mine.index(key), size)]
    assert not any("batch/old" in won for won in results)
    assert any_store.get_many(["batch/old"]) == [b"before"]


def test_put_if_absent_many_edges(any_store: Store) -> None:
    assert any_store.put_if_absent_many([]) == []
    with pytest.raises(ValueError):
        any_store.put_if_absent_many([("dup", b"a"), ("dup", b"b")])
    assert any_store.exists_many(["dup"]) == [False]
    with pytest.raises(ValueError):
        any_store.put_if_absent_many([("bad key!", b"a")])


def _absent_worker(uri: str, i: int, size: int, barrier: Any, out: Any, batched: bool) -> None:
    with open_store(uri) as store:
        barrier.wait()
        if batched:  # all five keys in one put_if_absent_many, racing the others' batches
            won = store.put_if_absent_many([(f"race/{r}", version(i, r, size)) for r in range(5)])
        else:
            won = [store.put_if_absent(f"race/{r}", version(i, r, size)) for r in range(5)]
    out.put((i, won))


@pytest.mark.parametrize("size,batched", [(64, False), (300_000, False), (64, True)])
def test_put_if_absent_processes_exactly_one_wins(
    shared_store_kind: str, store_uri_factory: UriFactory, size: int, batched: bool
) -> None:
    uri = store_uri_factory(shared_store_kind)  # the store is first opened by the racers
    n = 4
    barrier = SPAWN.Barrier(n)
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_absent_worker, args=(uri, i, size, barrier, out, batched))
             for i in range(n)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    with open_store(uri) as store:
        for r in range(5):
            winners = [i for i in range(n) if results[i][r]]
            assert len(winners) == 1, f"round {r}: winners {winners}"
            assert store.get_many([f"race/{r}"]) == [version(winners[0], r, size)]


# -- several processes -------------------------------------------------------------------


def _writer(uri: str, first: int, count: int) -> None:
    with open_store(uri) as store:
        ok = store.put_many(
            [(f"x/{i}", [pattern(i, 1000 + 150_000 * (i % 3))]) for i in range(first, first + count)]
        )
        assert all(ok)


def _reader(uri: str, first: int, count: int, out: Any) -> None:
    with open_store(uri) as store:
        keys = [f"x/{i}" for i in range(first, first + count)]
        got = store.get_many(keys)
        bufs = [memoryview(bytearray(400_000)) for _ in keys]
        sizes = store.get_into(keys, bufs)
    good = [
        g == pattern(i, 1000 + 150_000 * (i % 3)) and s == len(g) and bytes(b[: len(g)]) == g
        for i, g, s, b in zip(range(first, first + count), got, sizes, bufs, strict=True)
        if g is not None and s is not None
    ]
    out.put((len(good), all(good)))


def test_objects_cross_processes(shared_store_kind: str, store_uri_factory: UriFactory) -> None:
    uri = store_uri_factory(shared_store_kind)
    with open_store(uri) as store:
        store.put_many([(f"x/{i}", [pattern(i, 1000 + 150_000 * (i % 3))]) for i in range(10)])
        writer = SPAWN.Process(target=_writer, args=(uri, 10, 10))
        writer.start()
        writer.join(timeout=60)
        assert writer.exitcode == 0
        # What the other process wrote is visible here ...
        got = store.get_many([f"x/{i}" for i in range(20)])
        assert got == [pattern(i, 1000 + 150_000 * (i % 3)) for i in range(20)]
    # ... and what both wrote is visible to a third.
    out = SPAWN.Queue()
    reader = SPAWN.Process(target=_reader, args=(uri, 0, 20, out))
    reader.start()
    assert out.get(timeout=60) == (20, True)
    reader.join(timeout=30)
    assert reader.exitcode == 0


def _hot_writer(uri: str, writer: int, seconds: float, out: Any) -> None:
    seq = 0
    with open_store(uri) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert store.put_many([("hot", [version(writer, seq, versioned_size(writer, seq))])])
            seq += 1
    out.put(("writer", writer, seq))


def _hot_reader(uri: str, reader: int, seconds: float, out: Any) -> None:
    seen = torn = 0
    mixed: list[int] = []  # the sizes of torn reads that are not of one size
    buf = memoryview(bytearray(2 << 20))
    with open_store(uri) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            data = store.get_many(["hot"])[0]
            size = store.get_into(["hot"], [buf])[0]
            for item in (data, None if size is None else bytes(buf[:size])):
                if item is not None:
                    seen += 1
                    if not whole(item):
                        torn += 1
                        if not same_size_mix(item):
                            mixed.append(len(item))
    out.put(("reader", reader, seen, torn, mixed))


def test_concurrent_writers_same_key_processes(shared_store_kind: str, store_spec: Any,
                                               store_uri_factory: UriFactory) -> None:
    """Readers in other processes only ever see one whole version of a hot key (where a store
    overwrites in place, ``torn_overwrites``: or parts of versions of one size)."""
    uri = store_uri_factory(shared_store_kind)
    with open_store(uri) as store:
        store.put_many([("hot", [version(99, 0, 1000)])])
    out = SPAWN.Queue()
    seconds = 1.0
    procs = [SPAWN.Process(target=_hot_writer, args=(uri, w, seconds, out)) for w in range(2)]
    procs += [SPAWN.Process(target=_hot_reader, args=(uri, r, seconds, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    writes = sum(r[2] for r in reports if r[0] == "writer")
    reads = sum(r[2] for r in reports if r[0] == "reader")
    torn = sum(r[3] for r in reports if r[0] == "reader")
    mixed = [n for r in reports if r[0] == "reader" for n in r[4]]
    assert writes > 10 and reads > 10, reports
    if store_spec.torn_overwrites:  # only same-size overwrites tear, and only some reads
        assert not mixed, f"torn reads of {mixed} bytes (of {reads} reads) mix versions of other sizes"
        assert torn < reads / 4, f"{torn} torn reads of {reads}"
    else:
        assert torn == 0, f"{torn} torn reads of {reads}"
    with open_store(uri) as store:
        last = store.get_many(["hot"])[0]
        assert last is not None and whole(last)


def test_concurrent_writers_same_key_threads(any_store: Store, store_spec: Any) -> None:
    """The same within one process, from threads sharing one store object."""
    stop = time.monotonic() + 0.8
    errors: list[str] = []
    torn: list[bytes] = []
    counts = [0, 0]

    def write(w: int) -> None:
        seq = 0
        while time.monotonic() < stop:
            if not all(any_store.put_many([("hot", [version(w, seq, versioned_size(w, seq))])])):
                errors.append("put refused")
            seq += 1
        counts[0] += seq

    def read() -> None:
        buf = memoryview(bytearray(2 << 20))
        while time.monotonic() < stop:
            size = any_store.get_into(["hot"], [buf])[0]
            data = any_store.get_many(["hot"])[0]
            for item in (data, None if size is None else bytes(buf[:size])):
                if item is not None:
                    counts[1] += 1
                    if not whole(item):
                        torn.append(item)

    any_store.put_many([("hot", [version(9, 0, 100)])])
    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert counts[0] > 10 and counts[1] > 10
    if store_spec.torn_overwrites:
        torn = [item for item in torn if not same_size_mix(item)]
    assert not torn, f"{len(torn)} torn reads of {counts[1]}: of {sorted({len(t) for t in torn})} bytes"


# -- capacity and eviction ---------------------------------------------------------------

OBJ = 120 << 10  # one size class everywhere, about 4 per MiB


def _fill(store: Store, keys: list[str], check: Callable[[], None]) -> None:
    for key in keys:
        assert store.put_many([(key, [pattern(hash(key) % 1000, OBJ)])]) == [True]
        check()


def test_capacity_bounds_bytes_and_evicts_lru(store_kind: str, store_uri_factory: UriFactory) -> None:
    capacity = 32 << 20
    with open_store(store_uri_factory(store_kind, capacity="32MiB")) as store:
        assert store.stats().capacity == capacity

        def check() -> None:
            assert store.stats().bytes <= capacity

        keys = [f"cap/{i}" for i in range(600)]  # ~70 MiB through a 32 MiB store
        _fill(store, keys, check)
        stats = store.stats()
        assert stats.evictions > 0
        assert stats.bytes > capacity // 2, "eviction should not empty the store"
        # The newest objects are there, the oldest went first, and evicted keys read as
        # missing everywhere.
        assert all(store.exists_many(keys[-50:]))
        assert store.get_many(keys[-1:]) == [pattern(hash(keys[-1]) % 1000, OBJ)]
        old = keys[:50]
        assert store.exists_many(old) == [False] * 50
        assert store.get_many(old) == [None] * 50
        assert store.get_into(old, [memoryview(bytearray(OBJ)) for _ in old]) == [None] * 50
        assert stats.objects == sum(store.exists_many(keys))


@pytest.mark.parametrize("use", ["read", "touch"])
def test_recently_used_keys_survive_longer(store_kind: str, store_uri_factory: UriFactory, use: str) -> None:
    """A read counts as a use for eviction, and so does ``touch_many`` (what a hit calls)."""
    with open_store(store_uri_factory(store_kind, capacity="32MiB")) as store:
        keys = [f"lru/{i}" for i in range(200)]
        _fill(store, keys, lambda: None)
        touched = keys[::4]
        time.sleep(0.01)
        if use == "read":
            for _ in range(3):
                store.get_into(touched, [memoryview(bytearray(OBJ)) for _ in touched])
        else:
            assert store.touch_many([*touched, "lru/none"]) == [True] * len(touched) + [False]
        _fill(store, [f"lru/new/{i}" for i in range(120)], lambda: None)
        assert store.stats().evictions > 0
        present = dict(zip(keys, store.exists_many(keys), strict=True))
        touched_left = sum(present[k] for k in touched)
        untouched_left = sum(present[k] for k in keys if k not in touched)
        assert touched_left == len(touched)
        assert untouched_left <= 150 - 40


def test_stats_capacity_matches_uri(store_kind: str, store_uri_factory: UriFactory) -> None:
    with open_store(store_uri_factory(store_kind, capacity="48MiB")) as store:
        assert store.stats().capacity == 48 << 20


def test_closed_store_is_an_error_or_still_usable(any_store: Store) -> None:
    """After close a store either refuses with StoreError or keeps working; never crashes."""
    any_store.put_many([("c", [b"x"])])
    any_store.close()
    with contextlib.suppress(StoreError):
        assert any_store.get_many(["c"]) == [b"x"]


@pytest.mark.parametrize("use", ["put", "touch"])
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_keys_used_together_are_evicted_from_the_last(kind: str, use: str,
                                                      store_uri_factory: UriFactory) -> None:
    """The stores prefixvault evicts from keep the order of keys put or touched together (the
    vault lists a prefix from its first block): what is left of them is always a prefix."""
    with open_store(store_uri_factory(kind, capacity="32MiB")) as store:
        chain = [f"chain/{i}" for i in range(40)]
        if use == "put":
            items = [(k, [pattern(i, OBJ)]) for i, k in enumerate(chain)]
            assert store.put_many(items) == [True] * len(chain)
        else:
            _fill(store, chain, lambda: None)  # one by one: the first is the oldest
            time.sleep(0.01)
            # A key given twice (two lookups sharing a head, in one batch) keeps its first place.
            assert store.touch_many([*chain, *chain[:5]]) == [True] * (len(chain) + 5)
        time.sleep(0.01)
        for i in range(400):
            _fill(store, [f"other/{i}"], lambda: None)
            left = store.exists_many(chain)
            assert left == sorted(left, reverse=True), f"evicted out of order: {left}"
            if not left[0]:
                break
        assert not any(store.exists_many(chain))
