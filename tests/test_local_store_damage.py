"""A local store comes back from damage to its own files (issue 31).

Each scenario damages a real store a real vault filled, then asks what an operator cares about:
an engine opening the store starts (serving cold where it must), no consumer is ever handed
wrong bytes as valid, a hit that fails once is not a hit again, ``prefixvault audit --repair``
exits 0, and a producer afterwards gets full hits again, for the prompt it wrote before and for
a new one. A hypothesis campaign then composes random damage of the same kinds.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.cli import app
from prefixvault.inventory import audit
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores import StoreError, StoreUnavailable, open_store_or_retry
from prefixvault.stores.local import LocalStore
from prefixvault.vault import ObjectRef, Vault

BS = 8
MiB = 1 << 20
#: KV blocks of 128 KiB and states of 80 KiB: every object lives in a slab, not inline.
LAYOUT = CacheLayout(model="damage", block_size=BS, groups=(
    CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, BS, 32, 64), "float32")]),
    CacheGroup.uniform(GroupKind.STATE, [TensorSpec((128, 160), "float32")]),
))
X = list(range(64))
Y = [*range(24), *range(500, 540)]  # shares three blocks with X
Z = list(range(1000, 1064))  # new after the damage


def right(ref: ObjectRef, block_id: int) -> bytes:
    """The bytes an engine computes for ``ref``: a function of its identity alone."""
    n = LAYOUT.groups[ref.group].nbytes(ref.rank)
    seed = int.from_bytes(ref.key_hash[:4], "little") + ref.group
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8).tobytes()


def produce(vault: Vault, tokens: list[int]) -> None:
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    caps = [StateCapture(1, b, 200 + b, 1) for b in range(BS, len(tokens) + 1, BS)]
    d = plan_saves(vault.layout, len(tokens), tables, caps, step=1)
    vault.publish(hashes, vault.save(0, hashes, d.publishable, right))


def consume(vault: Vault, tokens: list[int]) -> tuple[int, bool | None]:
    """(tokens hit, whether the load verified; None on a miss). Fails the test on wrong bytes."""
    ask = [*tokens, 7]
    hashes = vault.hashes(ask)
    hit = vault.lookup(hashes, len(ask))
    if not hit:
        return 0, None
    got = vault.load(vault.needed(hashes, hit))
    wrong = [r.key for r, p in got.payloads.items() if bytes(p) != right(r, 0)]
    assert not wrong, f"wrong bytes returned as valid: {wrong}"
    return hit, got.ok


def fill(path: Path) -> None:
    with LocalStore(path, capacity=64 * MiB) as store:
        vault = Vault(store, LAYOUT)
        produce(vault, X)
        produce(vault, Y)
        assert consume(vault, X) == (64, True) and consume(vault, Y) == (64, True)


def serve_then_repair_then_produce(path: Path, strict: bool = True) -> None:
    """What follows any damage: the checks named in the module's docstring. Not ``strict``: an
    index SQLite itself finds malformed (its pages damaged) may answer queries inconsistently
    until a repair rebuilds it, so hits that fail again are allowed then (wrong bytes never)."""
    store = open_store_or_retry(f"local://{path}")  # an engine starting: must not raise
    vault = Vault(store, LAYOUT)
    for tokens in (X, Y):
        try:
            # Each failed load removes the bad objects it read: a later hit is shorter, and
            # after at most one failure per boundary a hit verifies or there is none.
            failed: list[int] = []
            for _ in range(len(tokens) // BS + 1):
                hit, ok = consume(vault, tokens)
                if ok is not False:
                    break
                assert not strict or not failed or hit < failed[-1], f"a hit failed again: {failed}, {hit}"
                failed.append(hit)
            else:
                assert not strict, f"hits kept failing: {failed}"
        except StoreUnavailable:
            continue  # down (breaker open): the engine serves cold
    store.close()
    res = CliRunner().invoke(app, ["audit", "--repair", "--store", f"local://{path}"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    with LocalStore(path) as fresh:
        vault = Vault(fresh, LAYOUT)
        produce(vault, X)
        produce(vault, Z)
        assert consume(vault, X) == (64, True)
        assert consume(vault, Z) == (64, True)
        assert consume(vault, Y)[1] is not False


def slabs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith("slab-") and p.name.endswith(".bin"))


def replace_with_dir(target: Callable[[Path], Path]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        where = target(path)
        if os.path.lexists(where):
            os.unlink(where)
        where.mkdir()
    return damage


def replace_with_link(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        other = path.parent / f"{path.name}-elsewhere"
        other.write_bytes(b"not the store's" * 10)
        if os.path.lexists(path / name):
            os.unlink(path / name)
        (path / name).symlink_to(other)
    return damage


def index_sql(script: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        conn = sqlite3.connect(path / "index.db")
        conn.executescript(script)
        conn.commit()
        conn.close()
    return damage


def with_wal(name: str) -> Callable[[Path], None]:
    """An index with its log there (as while engines run), then ``name`` made a directory."""
    def damage(path: Path) -> None:
        conn = sqlite3.connect(path / "index.db")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("UPDATE meta SET value = value WHERE name = 'epoch'")
        conn.commit()
        for n in ("index.db-wal", "index.db-shm"):
            if n == name:
                shutil.copy(path / n, path / f"{n}.copy")
        conn.close()
        for n in ("index.db-wal", "index.db-shm"):
            if os.path.lexists(path / n):
                os.unlink(path / n)
        (path / name).mkdir()
    return damage


def flip_bytes(path: Path) -> None:
    rng = random.Random(1)
    for slab in slabs(path):
        data = bytearray(slab.read_bytes())
        for _ in range(50):
            data[rng.randrange(len(data))] ^= 0xFF
        slab.write_bytes(data)


def swap_slabs(path: Path) -> None:
    a, b = slabs(path)[:2]
    os.rename(a, path / "t")
    os.rename(b, a)
    os.rename(path / "t", b)


def link_slab(path: Path) -> None:
    a, b = slabs(path)[:2]
    b.unlink()
    b.symlink_to(a)


def rename_key_column(path: Path) -> None:
    """The keys table's schema text damaged: it names another column than the store's queries."""
    conn = sqlite3.connect(path / "index.db")
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = replace(sql, 'key TEXT PRIMARY KEY', 'kez TEXT PRIMARY KEY')"
                 " WHERE name = 'keys'")
    conn.commit()
    conn.close()


def write_writers_file(path: Path) -> None:
    shutil.rmtree(path / "writers", ignore_errors=True)
    (path / "writers").write_text("not a directory")


SCENARIOS: dict[str, Callable[[Path], None]] = {
    "a slab path is a directory": replace_with_dir(lambda p: slabs(p)[0]),
    "a directory inside writers/": replace_with_dir(lambda p: p / "writers" / "12-abcdef"),
    "writers/ is a file": write_writers_file,
    "index.db is a directory": replace_with_dir(lambda p: p / "index.db"),
    "index.db-wal is a directory": with_wal("index.db-wal"),
    "index.db-shm is a directory": with_wal("index.db-shm"),
    "index.db.lock is a directory": replace_with_dir(lambda p: p / "index.db.lock"),
    "index.db is a link": replace_with_link("index.db"),
    "index.db-wal is a link": replace_with_link("index.db-wal"),
    "index.db-shm is a link": replace_with_link("index.db-shm"),
    "index.db.lock is a link": replace_with_link("index.db.lock"),
    "two rows name each other's slots": index_sql(
        "CREATE TEMP TABLE t AS SELECT key, slab, slot FROM keys WHERE slab IS NOT NULL ORDER BY key LIMIT 2;"
        "UPDATE keys SET slot = (SELECT slot FROM t WHERE t.key != keys.key)"
        " WHERE key IN (SELECT key FROM t);"),
    "two rows name one slot": index_sql(
        "CREATE TEMP TABLE t AS SELECT key, slab, slot, gen FROM keys WHERE slab IS NOT NULL"
        " ORDER BY key LIMIT 2;"
        "UPDATE keys SET slab = (SELECT slab FROM t WHERE t.key != keys.key),"
        " slot = (SELECT slot FROM t WHERE t.key != keys.key),"
        " gen = (SELECT gen FROM t WHERE t.key != keys.key)"
        " WHERE key IN (SELECT key FROM t);"),
    "rows name a slab the slab table lacks": index_sql(
        "UPDATE keys SET slab = 9999 WHERE key IN (SELECT key FROM keys WHERE slab IS NOT NULL LIMIT 3);"),
    "a slab row is gone": index_sql("DELETE FROM slabs WHERE id = (SELECT MIN(id) FROM slabs);"),
    "a slot number out of range": index_sql(
        "UPDATE keys SET slot = 1000000 WHERE key = (SELECT MIN(key) FROM keys WHERE slab IS NOT NULL);"),
    "the keys table's schema text names another column": rename_key_column,
    "stored capacity 0": index_sql("UPDATE meta SET value = 0 WHERE name = 'capacity';"),
    "next generation moved back": index_sql("UPDATE meta SET value = 1 WHERE name = 'next_gen';"),
    "random flips in every slab": flip_bytes,
    "a zeroed slab": lambda p: slabs(p)[0].write_bytes(bytes(slabs(p)[0].stat().st_size)),
    "two slabs swapped": swap_slabs,
    "a slab linked to another": link_slab,
    "a block's and a state's rows swapped": index_sql(
        "CREATE TEMP TABLE a AS SELECT key FROM keys WHERE key LIKE '%/b/%' AND slab IS NOT NULL LIMIT 1;"
        "CREATE TEMP TABLE b AS SELECT key FROM keys WHERE key LIKE '%/s/%' AND slab IS NOT NULL LIMIT 1;"
        "UPDATE keys SET key = 'tmp' WHERE key = (SELECT key FROM a);"
        "UPDATE keys SET key = (SELECT key FROM a) WHERE key = (SELECT key FROM b);"
        "UPDATE keys SET key = (SELECT key FROM b) WHERE key = 'tmp';"),
    "a class byte zeroed": index_sql(
        "UPDATE keys SET cls = 0 WHERE key IN (SELECT key FROM keys WHERE slab IS NOT NULL LIMIT 2);"),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_store_comes_back_from(tmp_path: Path, name: str) -> None:
    path = tmp_path / "s"
    fill(path)
    SCENARIOS[name](path)
    serve_then_repair_then_produce(path)


def test_a_stored_capacity_of_0_takes_its_default_share_again(tmp_path: Path) -> None:
    path = tmp_path / "s"
    LocalStore(path, capacity=64 * MiB).close()
    index_sql("UPDATE meta SET value = 0 WHERE name = 'capacity';")(path)
    with LocalStore(path) as store:  # a writer's open, no capacity given
        assert store.stats().capacity > 0
        assert store.put_many([("k", [bytes(MiB)])]) == [True] and store.get_many(["k"]) == [bytes(MiB)]
    with pytest.raises(StoreError, match="capacity=0 keeps nothing"):
        LocalStore(tmp_path / "t", capacity=0)


def test_heal_drops_rows_that_share_a_slot_and_frees_slots_no_key_names(tmp_path: Path) -> None:
    path = tmp_path / "s"
    big = bytes(range(256)) * 1024
    with LocalStore(path, capacity=64 * MiB) as store:
        assert store.put_many([(f"k{i}", [big]) for i in range(4)]) == [True] * 4
        index_sql("UPDATE keys SET slab = (SELECT slab FROM keys WHERE key = 'k0'),"
                  " slot = (SELECT slot FROM keys WHERE key = 'k0'),"
                  " gen = (SELECT gen FROM keys WHERE key = 'k0') WHERE key = 'k1';"
                  "UPDATE meta SET value = 0 WHERE name = 'next_gen';")(path)
        fixed = store.heal()
        assert fixed.rows_dropped == 2 and fixed.slots_freed == 2, fixed  # k0's slot and k1's old one
        assert store.exists_many(["k0", "k1", "k2", "k3"]) == [False, False, True, True]
        assert store.get_many(["k2", "k3"]) == [big, big]  # nothing valid removed
        assert store.usage().live_slots == 2
        assert store.put_many([("k4", [big])]) == [True] and store.get_many(["k2", "k4"]) == [big, big]
        top = sqlite3.connect(path / "index.db").execute("SELECT MAX(gen) FROM slots").fetchone()[0]
        assert store.heal().rows_dropped == 0
        assert sqlite3.connect(path / "index.db").execute(
            "SELECT value FROM meta WHERE name = 'next_gen'").fetchone()[0] >= top


def test_repair_walks_objects_no_record_names(tmp_path: Path) -> None:
    """A corrupt KV block whose record was evicted stayed; a producer then skipped it as present
    and published a record over it. The repair now checks it on its own and removes it."""
    path = tmp_path / "s"
    with LocalStore(path, capacity=64 * MiB) as store:
        vault = Vault(store, LAYOUT)
        produce(vault, X)
        records = [k for k, _ in store.scan() if "/r/" in k]
        store.delete_many(records)
        block = next(k for k, _ in store.scan() if "/b/" in k)
        blob = bytearray(store.get_many([block])[0] or b"")
        blob[-1] ^= 1
        store.put_many([(block, [bytes(blob)])])
    res = CliRunner().invoke(app, ["audit", "--store", f"local://{path}"])
    assert res.exit_code == 1 and block in res.output.replace("\n", ""), res.output
    res = CliRunner().invoke(app, ["audit", "--repair", "--store", f"local://{path}"])
    assert res.exit_code == 0 and "bad: 1 (removed)" in res.output, res.output
    with LocalStore(path) as store:
        assert store.exists_many([block]) == [False]
        vault = Vault(store, LAYOUT)
        produce(vault, X)
        assert consume(vault, X) == (64, True)
        assert audit(store).unreached_bad == []


def test_sealed_objects_no_record_names_are_kept_without_their_secret(tmp_path: Path) -> None:
    from prefixvault.tenancy import NamespaceKey

    key = NamespaceKey.derive(b"tenant-secret-0123456789abcdef!!", "t")
    with LocalStore(tmp_path / "s", capacity=64 * MiB) as store:
        vault = Vault(store, LAYOUT, "t", key)
        produce(vault, X)
        store.delete_many([k for k, _ in store.scan()
                           if "/r/" in k or k.rsplit("/", 1)[1].startswith("layout")])
        before = sorted(k for k, _ in store.scan())
        report = audit(store, repair=True)
        assert report.unreached_bad == [] and sorted(k for k, _ in store.scan()) == before


def test_an_unreadable_slab_is_lost_not_an_error_on_every_read(tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    """chmod 000 on a slab, read by a process that is not root (a forked child that gives up
    root: root reads any file, so this is the only way to see it here)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    base = Path(tempfile.mkdtemp(prefix="prefixvault-other-user-"))  # pytest's are root-only
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o755)
    os.chown(base, 65534, 65534)
    path = base / "s"
    fill(tmp_path / "warm")  # every import the child needs is done before it gives up root
    with LocalStore(tmp_path / "warm") as warm:
        warm.heal()
        audit(warm, repair=True)
        consume(Vault(warm, LAYOUT), X)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit code
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            fill(path)
            for slab in slabs(path):
                os.chmod(slab, 0)
            store = open_store_or_retry(f"local://{path}")
            vault = Vault(store, LAYOUT)
            assert consume(vault, X)[1] is not True  # its slabs cannot be read
            assert consume(vault, X) == (0, None)  # forgotten: no hit-then-fail loop
            store.close()
            with LocalStore(path, existing=True) as s:
                s.heal()
                audit(s, repair=True)
            with LocalStore(path) as s:
                vault = Vault(s, LAYOUT)
                produce(vault, X)
                assert consume(vault, X) == (64, True)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- the campaign -----------------------------------------------------------------------------

FILES = ["index.db", "slab:0", "slab:1", "slab:-1", "writers", "index.db.lock"]


def _file(path: Path, which: str) -> Path:
    if which.startswith("slab:"):
        found = slabs(path)
        return found[int(which[5:]) % len(found)] if found else path / "slab-0000000001.bin"
    return path / which


def _apply(path: Path, op: tuple[str, str, int]) -> None:
    kind, which, seed = op
    rng = random.Random(seed)
    target = _file(path, which)
    if kind == "rows":  # rows of the index swapped or changed, the file itself whole
        try:
            conn = sqlite3.connect(path / "index.db")
        except sqlite3.Error:
            return  # not a database any more: other damage did it
        try:
            keys = [k for (k,) in conn.execute("SELECT key FROM keys ORDER BY key")]
            if len(keys) >= 2:
                a, b = rng.sample(keys, 2)
                column = rng.choice(["slab", "slot", "gen", "cls", "size"])
                conn.execute(f"UPDATE keys SET {column} = (SELECT {column} FROM keys WHERE key = ?)"
                             " WHERE key = ?", (a, b))
            meta = rng.choice(["capacity", "slab_size", "next_gen", "inline_bytes", "epoch"])
            # (A small positive capacity is not among them: it is a choice the store keeps, and
            # says so when it opens; nothing would tell it from damage.)
            conn.execute("UPDATE meta SET value = ? WHERE name = ?", (rng.choice([0, -5, 1 << 40]), meta))
            conn.commit()
        except sqlite3.Error:
            pass  # the index is already damaged past SQL: other damage does the rest
        finally:
            conn.close()
        return
    if not os.path.lexists(target):
        return
    if kind == "bytes" and target.is_file() and not target.is_symlink():
        data = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 64)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        target.write_bytes(bytes(data))
    elif kind == "truncate" and target.is_file() and not target.is_symlink():
        os.truncate(target, rng.randrange(max(target.stat().st_size, 1)))
    elif kind == "dir":
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
        target.mkdir()
        (target / "inside").write_text("x")
    elif kind == "link":
        real = [p for p in slabs(path) if p != target and p.is_file() and not p.is_symlink()]
        other = real[0] if real and rng.random() < 0.5 else path.parent / "elsewhere"
        if not os.path.lexists(other):
            other.write_text("elsewhere")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
        target.symlink_to(other)
    elif kind == "remove":
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()


OPS = st.tuples(st.sampled_from(["bytes", "truncate", "dir", "link", "remove", "rows"]),
                st.sampled_from(FILES), st.integers(0, 2**16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=3))
@example(ops=[("bytes", "index.db", 1463)])  # schema text damaged: "no such column" on open
@example(ops=[("bytes", "index.db", 243)])  # an index page answering keys not asked
def test_no_damage_leaves_the_store_unusable_after_repair(tmp_path_factory: pytest.TempPathFactory,
                                                         ops: list[tuple[str, str, int]]) -> None:
    path = tmp_path_factory.mktemp("campaign") / "s"
    fill(path)
    for op in ops:
        _apply(path, op)
    serve_then_repair_then_produce(path, strict=_sqlite_finds_whole(path))


def _sqlite_finds_whole(path: Path) -> bool:
    try:
        conn = sqlite3.connect(f"file:{path / 'index.db'}?mode=ro", uri=True)
        try:
            return bool(conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)])
        finally:
            conn.close()
    except (sqlite3.Error, UnicodeDecodeError):
        return False
