"""The local store converges back to serving after damage to its own files.

Scenarios run in a child process where a regression would kill the process (SIGBUS), so a
failure is a clear exit code instead of a dead test runner.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.local import LocalStore
from prefixvault.vault import ObjectRef, Vault

MiB = 1 << 20


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_a_slab_cut_short_under_a_mapping_is_a_miss_not_a_sigbus(tmp_path: Path) -> None:
    done = _child(f"""
        import os
        from pathlib import Path
        from prefixvault.stores.local import LocalStore
        store = LocalStore({str(tmp_path / "s")!r}, capacity=256 << 20)  # 4 MiB slabs
        big = bytes(range(256)) * 4096  # 1 MiB: lives in a slab
        assert store.put_many([("a", [big]), ("b", [big])]) == [True, True]
        assert store.get_many(["a"]) == [big]  # the slab is mapped in this process now
        slabs = sorted(p for p in Path({str(tmp_path / "s")!r}).iterdir() if p.name.startswith("slab-"))
        os.truncate(slabs[0], 4096)  # someone else cuts the file short
        assert store.get_many(["a", "b"]) == [None, None]
        assert store.exists_many(["a", "b"]) == [False, False], "damaged keys must be forgotten"
        assert store.put_many([("a", [big])]) == [True]  # the next save repairs it
        assert store.get_many(["a"]) == [big]
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_removed_slab_is_forgotten_by_every_process(tmp_path: Path) -> None:
    path = tmp_path / "s"
    big = bytes(range(256)) * 4096
    with LocalStore(path, capacity=64 * MiB) as store:
        assert store.put_many([("a", [big])]) == [True]
    for p in path.iterdir():
        if p.name.startswith("slab-"):
            os.unlink(p)
    with LocalStore(path) as other:  # another process, no mapping yet
        assert other.exists_many(["a"]) == [True]
        assert other.get_many(["a"]) == [None]
        assert other.exists_many(["a"]) == [False]
        assert other.put_many([("a", [big])]) == [True] and other.get_many(["a"]) == [big]


def test_the_vault_stops_hitting_a_damaged_prefix_and_the_next_save_repairs_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((256 << 10,), "uint8")])
    layout = CacheLayout(model="heal", block_size=4, groups=(attn,))
    tokens = list(range(16))

    def read(ref: ObjectRef, block_id: int) -> bytes:
        return bytes([block_id]) * (256 << 10)

    def produce(vault: Vault) -> None:
        from prefixvault.boundary import plan_saves

        hashes = vault.hashes(tokens)
        d = plan_saves(layout, 16, {0: [1, 2, 3, 4]}, [], step=1)
        vault.publish(hashes, vault.save(0, hashes, d.publishable, read))

    with LocalStore(path, capacity=64 * MiB) as store:
        vault = Vault(store, layout)
        produce(vault)
        hashes = vault.hashes([*tokens, 1])
        assert vault.lookup(hashes, 17) == 16
        for p in path.iterdir():
            if p.name.startswith("slab-"):
                os.truncate(p, 0)
        assert not vault.load(vault.needed(hashes, 16)).ok  # found damaged at load
        assert vault.lookup(hashes, 17) == 0  # no hit-then-fail loop
        produce(vault)  # the objects are written again, not skipped as existing
        assert vault.lookup(hashes, 17) == 16
        assert vault.load(vault.needed(hashes, 16)).ok


def test_a_replace_that_cannot_fit_keeps_the_old_value(tmp_path: Path) -> None:
    with LocalStore(tmp_path / "s", capacity=32 << 10) as store:
        assert store.put_many([("k", [b"old" * 1000])]) == [True]
        assert store.put_many([("k", [b"x" * (60 << 10)])]) == [False]  # larger than the store
        assert store.get_many(["k"]) == [b"old" * 1000]
        assert store.put_many([("k", [b"new" * 2000])]) == [True]
        assert store.get_many(["k"]) == [b"new" * 2000]


def test_reads_never_wait_for_another_writers_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3
    import time

    from prefixvault.stores import local

    monkeypatch.setattr(local, "TOUCH_FLUSH_S", 0.0)  # every read wants to write its recency back
    with LocalStore(tmp_path / "s", capacity=64 * MiB) as store:
        assert store.put_many([("k", [bytes(200 << 10)])]) == [True]
        other = sqlite3.connect(tmp_path / "s" / "index.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process in the middle of a long write
        try:
            t0 = time.monotonic()
            for _ in range(5):
                assert store.get_many(["k"]) == [bytes(200 << 10)]
                assert store.touch_many(["k"]) == [True]
            assert time.monotonic() - t0 < 1.0
        finally:
            other.execute("ROLLBACK")
            other.close()
        before = time.time()
        store.get_many(["k"])  # the lock is free again: pending recency is written back
        row = sqlite3.connect(tmp_path / "s" / "index.db").execute(
            "SELECT last_used FROM keys WHERE key = 'k'").fetchone()
        assert row[0] >= before - 0.01


@pytest.mark.parametrize("damage", ["not a database", "schema", "missing meta"])
def test_a_damaged_index_is_one_line_and_audit_repair_rebuilds_it(tmp_path: Path, damage: str) -> None:
    import sqlite3

    from typer.testing import CliRunner

    from prefixvault.cli import app
    from prefixvault.stores import StoreUnavailable, open_store_or_retry
    from prefixvault.stores.local import StoreDamaged

    path = tmp_path / "s"
    with LocalStore(path, capacity=64 * MiB) as store:
        store.put_many([("a", [bytes(MiB)]), ("b", [b"small"])])
    index = path / "index.db"
    if damage == "not a database":
        index.write_bytes(b"this is not a database" * 100)
        for extra in ("index.db-wal", "index.db-shm"):
            (path / extra).unlink(missing_ok=True)
    else:
        conn = sqlite3.connect(index)
        sql = "UPDATE meta SET value = 99 WHERE name = 'schema'" if damage == "schema" \
            else "DELETE FROM meta WHERE name = 'next_gen'"
        conn.execute(sql)
        conn.commit()
        conn.close()
    with pytest.raises(StoreDamaged) as info:
        LocalStore(path)
    message = str(info.value)
    assert "\n" not in message and "audit --repair" in message and str(path) in message
    assert isinstance(info.value, StoreUnavailable)  # an engine serves cold meanwhile
    with open_store_or_retry(f"local://{path}") as serving, pytest.raises(StoreUnavailable):
        serving.exists_many(["a"])  # the connector turns this into a miss and serves cold
    res = CliRunner().invoke(app, ["stats", "--store", f"local://{path}"])
    assert res.exit_code == 2 and "audit --repair" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["audit", "--repair", "--store", f"local://{path}"])
    assert res.exit_code == 0 and "rebuilt" in res.output, res.output
    with LocalStore(path) as store:
        assert store.stats().objects == 0
        if damage != "not a database":  # the old capacity is kept where it can be read
            assert store.stats().capacity == 64 * MiB
        assert store.put_many([("a", [bytes(MiB)])]) == [True] and store.get_many(["a"]) == [bytes(MiB)]
    assert [p for p in path.iterdir() if p.name.startswith("index.db.damaged-")]


@pytest.fixture
def small_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real 6 MiB tmpfs (needs the right to mount, as root in a container has)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_filesystem_smaller_than_the_capacity_keeps_serving(small_fs: Path) -> None:
    import shutil

    path = small_fs / "store"
    big = [bytes([i]) * (700 << 10) for i in range(30)]
    with LocalStore(path, capacity=64 * MiB) as store:
        for i, blob in enumerate(big):  # 21 MiB through a 6 MiB filesystem
            assert store.put_many([(f"big/{i}", [blob]), (f"small/{i}", [b"s" * 1000])]) == [True, True], i
        assert store.get_many(["big/29", "small/29"]) == [big[29], b"s" * 1000]
        assert store.stats().evictions > 0
        assert store.delete_many(["big/29"]) == 1
        # Someone else fills the filesystem to the last byte.
        filler = small_fs / "filler"
        with filler.open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        assert shutil.disk_usage(small_fs).free < (64 << 10)
        got = store.put_many([("after/0", [big[0]]), ("after/1", [b"x" * 100])])
        assert got[1] is True  # room made by giving up the oldest slab
        assert store.put_many([("gone", [b"g" * 100])]) == [True]
        assert store.delete_many(["gone", "never"]) == 1  # deletes work on a full filesystem
    with LocalStore(path, capacity=64 * MiB) as again:  # a restarting engine opens it, still full
        assert again.get_many(["after/1"]) in ([b"x" * 100], [None])  # kept, or evicted to fit
        assert again.put_many([("after/2", [b"y" * 100])]) == [True]
        assert again.get_many(["after/2"]) == [b"y" * 100]


def test_a_new_slab_is_written_without_holding_the_index_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from prefixvault.stores import _arena

    make = _arena.create_slab_file
    lock_free: list[bool] = []

    def watched(root: Path, nbytes: int) -> Path:
        other = sqlite3.connect(root / "index.db", timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another writer gets the lock meanwhile
            other.execute("ROLLBACK")
            lock_free.append(True)
        except sqlite3.OperationalError:
            lock_free.append(False)
        finally:
            other.close()
        return make(root, nbytes)

    monkeypatch.setattr(_arena, "create_slab_file", watched)
    with LocalStore(tmp_path / "s", capacity=256 * MiB) as store:
        assert store.put_many([(f"k{i}", [bytes([i]) * MiB]) for i in range(8)]) == [True] * 8
        assert store.get_many(["k7"]) == [bytes([7]) * MiB]
    assert lock_free and all(lock_free)


def test_a_private_store_is_owner_only_and_refuses_directories_others_control(tmp_path: Path) -> None:
    import stat

    from prefixvault.stores import StoreError, open_store

    path = tmp_path / "private"
    with LocalStore(path, capacity=64 * MiB) as store:
        store.put_many([("big", [bytes(MiB)]), ("small", [b"s"])])
        store.exists_many(["big"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir() if p.is_file()}
    assert modes and all(m & 0o077 == 0 for m in modes.values()), modes
    # A directory others can write (as a pre-made /dev/shm/prefixvault might be): refused.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(StoreError, match="writable by others"):
        open_store(f"local://{open_dir}")
    # One owned by another user: refused, unless the store is shared on purpose.
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)  # nobody
        with pytest.raises(StoreError, match="belongs to another user"):
            open_store(f"local://{theirs}")
    # Ours but readable by others (made by an older version): tightened.
    loose = tmp_path / "loose"
    with LocalStore(loose, capacity=64 * MiB) as store:
        store.put_many([("k", [b"v"])])
    os.chmod(loose, 0o755)
    os.chmod(loose / "index.db", 0o644)
    LocalStore(loose).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    assert stat.S_IMODE((loose / "index.db").stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o770)
    os.chmod(shared, 0o770)
    with open_store(f"local://{shared}?shared=1&capacity=64MiB") as store:
        store.put_many([("k", [bytes(MiB)])])
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o060 == 0o060 for p in shared.iterdir() if p.is_file()
               and p.name.startswith(("index.db", "slab-")))


def test_a_new_store_on_a_full_filesystem_serves_cold_and_comes_back(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31: an engine whose new local store found its filesystem 100% full failed to
    start (an IndexFull traceback); it must serve cold with one warning, and use the store
    once there is room."""
    import logging

    from prefixvault.stores import open_store_or_retry
    from prefixvault.stores.base import StoreUnavailable

    filler = small_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, bytes(4096))
    os.close(fd)
    uri = f"local://{small_fs}/new?capacity=1MiB"
    with caplog.at_level(logging.ERROR):
        store = open_store_or_retry(uri)  # must not raise
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    with pytest.raises(StoreUnavailable):  # calls fail fast: the connector counts a miss
        store.put_many([("k", [b"v"])])
    store.close()
    filler.unlink()
    with LocalStore(small_fs / "new", capacity=1 << 20) as fresh:  # room again: it works
        assert fresh.put_many([("k", [b"v"])]) == [True]


@pytest.mark.parametrize("row", ["key", "free slot"])
def test_a_slot_number_out_of_range_is_a_miss_and_heals_never_a_value_error(tmp_path: Path, row: str) -> None:
    """Issue 31: an index row naming a slot past its slab's end made every later put raise
    ValueError. Now the slab whose rows disagree with it is set aside: a miss, then normal."""
    import sqlite3

    path = tmp_path / "s"
    big = bytes(range(256)) * 1200  # ~300 KiB: a slab object
    with LocalStore(path, capacity=64 * MiB) as store:
        assert store.put_many([("a", [big]), ("b", [big])]) == [True, True]
        conn = sqlite3.connect(path / "index.db")
        if row == "key":
            conn.execute("UPDATE keys SET slot = 1000000 WHERE key = 'a'")
            conn.execute("UPDATE slots SET slot = 1000000 WHERE (slab, slot) IN"
                         " (SELECT slab, 0 FROM keys WHERE key = 'a') AND slot = 0")
        else:
            conn.execute("UPDATE slots SET slot = slot + 1000000 WHERE state = 0")
        conn.commit()
        conn.close()
        got = store.get_many(["a"])
        assert got in ([None], [big])  # never a ValueError; never other bytes
        # The put that finds the damage is refused (False: a skipped save), the ones after work:
        # the damaged slab's slots are never handed out again.
        assert store.put_many([("first", [big])]) in ([True], [False])
        for i in range(40):
            assert store.put_many([(f"k{i}", [big])]) == [True], i
            assert store.get_many([f"k{i}"]) == [big]
        assert store.get_many(["a"]) in ([None], [big])
        assert store.put_many([("a", [big])]) == [True] and store.get_many(["a"]) == [big]
