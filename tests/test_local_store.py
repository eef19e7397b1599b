"""What only the local store promises: crash safety, persistence, its directory and URI."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from prefixvault import stores
from prefixvault.stores import StoreError, _arena, default_local_dir, open_store
from prefixvault.stores.local import LocalStore

SPAWN = mp.get_context("spawn")
MiB = 1 << 20


def version(seq: int, slot: int, size: int) -> bytes:
    """Header (seq, slot, size) then one repeated byte: a torn copy cannot pass ``whole``."""
    fill = (seq * 31 + slot * 7 + 1) % 251
    return struct.pack("<IIQ", seq, slot, size) + bytes([fill]) * (size - 16)


def whole(data: bytes) -> bool:
    seq, slot, size = struct.unpack_from("<IIQ", data)
    return size == len(data) and data == version(seq, slot, size)


def slab_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("slab-"))


# -- SIGKILL mid-put ---------------------------------------------------------------------


def _put_forever(path: str, started: Any) -> None:
    """Overwrite four keys in a loop; most of the time goes to copying bytes into slots."""
    store = LocalStore(path)
    sizes = [2 * MiB + 4096, 5 * MiB // 2, 3 * MiB - 1, 1 * MiB + 3]
    pool = [version(seq, slot, sizes[(seq + slot) % 4]) for seq in range(6) for slot in range(4)]
    started.set()
    seq = 0
    while True:
        seq += 1
        store.put_many([(f"crash/{i}", [pool[(seq % 6) * 4 + i]]) for i in range(4)])


def test_sigkill_mid_put_leaves_only_whole_objects(tmp_path: Path) -> None:
    path = tmp_path / "store"
    watcher = LocalStore(path, capacity=256 * MiB)  # opened before the kills: sees the debris
    leaked = 0
    rng = random.Random(1)
    for _ in range(4):
        started = SPAWN.Event()
        child = SPAWN.Process(target=_put_forever, args=(str(path), started))
        child.start()
        assert started.wait(60)
        time.sleep(rng.uniform(0.05, 0.25))
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        leaked += watcher.usage().writing_slots
        # Every visible object is one whole version, whatever moment the kill hit.
        for key, data in zip(
            [f"crash/{i}" for i in range(4)],
            watcher.get_many([f"crash/{i}" for i in range(4)]),
            strict=True,
        ):
            assert data is None or whole(data), f"{key} is torn"
    assert leaked > 0, "no kill landed mid-put; the test did not exercise recovery"
    watcher.close()

    # A fresh open gives back the slots of dead writers and removes half-made slab files
    # (those old enough that no live writer can still be making them: age them here).
    old = time.time() - _arena.STRAY_TMP_AGE_S - 1
    for name in slab_files(path):
        if name.endswith(".tmp"):
            os.utime(path / name, (old, old))
    young = path / "slab-1-2-young.tmp"
    young.write_bytes(b"a live writer is making this one")
    store = LocalStore(path)
    assert young.exists()
    young.unlink()
    usage = store.usage()
    assert usage.writing_slots == 0
    slot_keys = sum(1 for _, size in store.scan() if size > _arena.INLINE_MAX)
    assert usage.live_slots == slot_keys
    assert len(slab_files(path)) == usage.slabs
    assert not [n for n in slab_files(path) if n.endswith(".tmp")]
    # Nothing was lost for good: later puts work and the whole capacity is usable again.
    for i in range(12):
        items = [(f"after/{i}/{j}", [version(i, j, 6 * MiB)]) for j in range(2)]
        assert store.put_many(items) == [True, True]
    assert [whole(d) for d in store.get_many(["after/11/0", "after/11/1"]) if d] == [True, True]
    assert store.stats().bytes <= store.stats().capacity
    store.close()


def test_dead_writers_slots_are_reclaimed_while_open(tmp_path: Path) -> None:
    """A store that stays open takes back a dead writer's slots when it needs room."""
    path = tmp_path / "store"
    store = LocalStore(path, capacity=64 * MiB)
    started = SPAWN.Event()
    child = SPAWN.Process(target=_put_forever, args=(str(path), started))
    child.start()
    assert started.wait(60)
    time.sleep(0.3)
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(30)
    for i in range(40):  # 240 MiB through a 64 MiB store
        assert store.put_many([(f"k/{i}", [version(i, 0, 6 * MiB)])]) == [True]
    assert store.usage().writing_slots == 0
    store.close()


# -- directory, reopen, capacity ---------------------------------------------------------


def test_reopen_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "store"
    data = {f"keep/{n}": os.urandom(n) for n in (0, 10, 100_000, 3 * MiB)}
    with LocalStore(path, capacity=64 * MiB) as store:
        assert store.put_many([(k, [v]) for k, v in data.items()]) == [True] * len(data)
    with open_store(f"local://{path}") as store:
        assert store.get_many(list(data)) == list(data.values())
        assert store.stats().objects == len(data)
        assert store.stats().capacity == 64 * MiB


def test_capacity_is_kept_and_can_be_changed(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with open_store(f"local://{path}?capacity=32MiB") as store:
        assert store.stats().capacity == 32 * MiB
        assert all(store.put_many([(f"c/{i}", [bytes(MiB)]) for i in range(20)]))
    with open_store(f"local://{path}") as store:
        assert store.stats().capacity == 32 * MiB
    with open_store(f"local://{path}?capacity=64MiB") as store:
        assert store.stats().capacity == 64 * MiB
    with open_store(f"local://{path}?capacity=8MiB") as store:
        stats = store.stats()
        assert stats.capacity == 8 * MiB
        assert stats.bytes <= 8 * MiB  # shrinking evicts down to the new bound
        assert 0 < stats.objects < 20
        assert isinstance(store, LocalStore)
        assert store.usage().slab_bytes + store.usage().inline_bytes <= 8 * MiB


def test_slabs_made_before_a_capacity_change_stay_usable(tmp_path: Path) -> None:
    path = tmp_path / "store"
    obj = os.urandom(3 * MiB)
    with LocalStore(path, capacity=16 * MiB) as store:
        small_slab = store.usage().slab_size
        assert store.put_many([("a", [obj]), ("b", [obj[:100_000]])]) == [True, True]
        assert store.delete_many(["a"]) == 1  # leaves a free slot in a slab of the old size
    with LocalStore(path, capacity=1 << 40) as store:
        assert store.usage().slab_size > small_slab
        assert store.put_many([("c", [obj]), ("d", [obj[:100_000]])]) == [True, True]
        assert store.get_many(["b", "c", "d"]) == [obj[:100_000], obj, obj[:100_000]]


def test_default_capacity_is_a_share_of_free_space(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with LocalStore(tmp_path / "store") as store:
        capacity = store.stats().capacity
    assert capacity is not None
    assert abs(capacity - free * 0.25) < free * 0.02


def test_sizes_beyond_a_slab_and_class_changes(tmp_path: Path) -> None:
    """Objects bigger than a slab get their own; a class with no room takes old slabs."""
    with LocalStore(tmp_path / "store", capacity=64 * MiB) as store:
        slab = store.usage().slab_size
        big = os.urandom(slab + 12345)
        assert store.put_many([("big", [big])]) == [True]
        assert store.get_many(["big"]) == [big]
        # Fill with one class, then switch to another: puts keep succeeding within capacity.
        for i in range(100):
            assert store.put_many([(f"a/{i}", [bytes(300_000)])]) == [True]
        for i in range(60):
            assert store.put_many([(f"b/{i}", [bytes(2 * MiB + i)])]) == [True]
            usage = store.usage()
            assert usage.slab_bytes + usage.inline_bytes <= 64 * MiB
        assert all(store.exists_many([f"b/{i}" for i in range(50, 60)]))
        assert store.stats().evictions > 0
        assert len(slab_files(store.path)) == store.usage().slabs


def test_full_filesystem_refuses_puts_and_other_errors_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with LocalStore(tmp_path / "store", capacity=64 * MiB) as store:

        def no_space(root: Path, nbytes: int) -> Path:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_arena, "create_slab_file", no_space)
        assert store.put_many([("big", [bytes(MiB)]), ("small", [b"s"])]) == [False, True]
        assert store.get_many(["big", "small"]) == [None, b"s"]

        def broken(root: Path, nbytes: int) -> Path:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(_arena, "create_slab_file", broken)
        with pytest.raises(StoreError, match="Input/output error"):
            store.put_many([("big", [bytes(MiB)])])
        monkeypatch.undo()
        assert store.put_many([("big", [bytes(MiB)])]) == [True]
        assert store.usage().writing_slots == 0


def test_concurrent_first_open(tmp_path: Path) -> None:
    """Processes that create the same directory at once all get one working store."""
    path = tmp_path / "fresh"
    barrier = SPAWN.Barrier(4)
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_open_and_put, args=(str(path), i, barrier, out)) for i in range(4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(i, "ok") for i in range(4)]
    with LocalStore(path) as store:
        assert store.get_many([f"first/{i}" for i in range(4)]) == [bytes([i]) * 100_000 for i in range(4)]


def _open_and_put(path: str, i: int, barrier: Any, out: Any) -> None:
    barrier.wait()
    try:
        with open_store(f"local://{path}?capacity=64MiB") as store:
            assert store.put_many([(f"first/{i}", [bytes([i]) * 100_000])]) == [True]
        out.put((i, "ok"))
    except Exception as exc:
        out.put((i, repr(exc)))


# -- bad paths and URIs ------------------------------------------------------------------


def test_path_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(StoreError, match=str(target)):
        open_store(f"local://{target}")


def test_parent_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    bad = blocker / "x" / "y"
    with pytest.raises(StoreError, match=str(bad)):
        open_store(f"local://{bad}")


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty"):
        open_store(f"local://{tmp_path}")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("local://host/x", "three slashes"),
        ("local:///{tmp}/s?capacity=lots", "capacity"),
        ("local:///{tmp}/s?capcity=1GiB", "capcity"),
    ],
)
def test_bad_uris(tmp_path: Path, uri: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(uri.format(tmp=tmp_path))


def test_corrupt_index_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / "index.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=str(path)):
        LocalStore(path)


def test_closed_store_refuses(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", capacity=64 * MiB)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get_many(["k"])


# -- default directory -------------------------------------------------------------------


def test_default_dir_prefers_shm_with_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "SHM_MIN_FREE", 0)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        assert default_local_dir() == shm / "prefixvault"
    else:
        assert default_local_dir().name == "prefixvault"
        assert default_local_dir().parent != shm


def test_default_dir_falls_back_to_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "SHM_MIN_FREE", 1 << 62)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_local_dir() == tmp_path / "cache" / "prefixvault"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_local_dir() == tmp_path / "home" / ".cache" / "prefixvault"


def test_bare_local_uri_opens_the_default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "default_local_dir", lambda: tmp_path / "default")
    with open_store("local://?capacity=16MiB") as store:
        assert store.put_many([("k", [b"v"])]) == [True]
        assert isinstance(store, LocalStore)
        assert store.path == tmp_path / "default"
    assert (tmp_path / "default" / "index.db").exists()
