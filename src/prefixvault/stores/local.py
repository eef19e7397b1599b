"""The embedded default store: one directory shared by every process on a machine.

Bytes live in slots of pre-faulted slab files mapped once per process (see ``_arena``);
small objects live inline in the index. The index is SQLite in WAL mode and is the only
source of truth: a key names (slab, slot, generation), and a slot is free, being written,
or live. Crash safety comes from ordering, not from locks held during copies:

* put: transaction 1 claims slots (state writing, a fresh generation); the bytes are
  copied with no lock held; transaction 2 points the keys at the new slots and frees the
  slots they held before. A writer killed in between leaves only claimed slots, which go
  back to the free list once its owner is seen dead.
* get: one SELECT finds every key, the bytes are copied, then one more SELECT checks each
  key still names the same (slab, slot, generation). Generations are never reused, so a
  slot recycled by a concurrent writer or evictor during the copy is always noticed and
  that key is read again (or reported missing).

Liveness of a writer is an flock its process holds on a file of its own, so it holds
across pid reuse and pid namespaces, and is released by the kernel on SIGKILL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np

from prefixvault.stores import _arena
from prefixvault.stores._arena import Bytes, Mappings
from prefixvault.stores.base import Buffer, Store, StoreError, StoreStats, StoreUnavailable, check_key
from prefixvault.units import parse_size

INDEX_NAME = "index.db"
#: Rows the index's meta table must hold.
META_NAMES = ("schema", "capacity", "slab_size", "inline_bytes", "next_gen", "evictions", "epoch")
WRITERS_DIR = "writers"
SCHEMA_VERSION = 1
#: Share of the filesystem's free space a new store takes when no capacity is given.
DEFAULT_CAPACITY_SHARE = 0.25
#: Filesystem space the store never fills with objects: room for the index and its log.
FS_RESERVE = 2 << 20
#: How long a process waits for the index's write lock before giving up.
BUSY_TIMEOUT_S = 30.0
#: Recency from gets is written back at most this often (and before any eviction).
TOUCH_FLUSH_S = 1.0
TOUCH_FLUSH_MAX = 4096
TOUCH_PENDING_MAX = 65536
#: A read that loses a race with slot reuse is retried this many times in all.
READ_ATTEMPTS = 3
#: SQLite bound-parameter batch size.
_CHUNK = 500

FREE, WRITING, LIVE = 0, 1, 2
_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slabs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cls INTEGER NOT NULL,
    nslots INTEGER NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS slots (
    slab INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    cls INTEGER NOT NULL,
    state INTEGER NOT NULL,
    owner TEXT,
    gen INTEGER NOT NULL,
    PRIMARY KEY (slab, slot)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS slots_free ON slots (cls, state);
CREATE INDEX IF NOT EXISTS slots_state ON slots (state);
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    cls INTEGER NOT NULL,
    slab INTEGER,
    slot INTEGER,
    gen INTEGER NOT NULL,
    last_used REAL NOT NULL,
    data BLOB
);
CREATE INDEX IF NOT EXISTS keys_lru ON keys (cls, last_used);
CREATE INDEX IF NOT EXISTS keys_slab ON keys (slab, last_used);
"""


class IndexFull(StoreError):
    """The store's filesystem has no room left for the index to grow."""


class StoreDamaged(StoreUnavailable):
    """The index cannot be read as a store index: engines serve cold (it is unavailable, as
    a store that is down), and ``prefixvault audit --repair`` rebuilds it."""


@dataclass(frozen=True)
class LocalUsage:
    """How the store's space is used right now (for diagnostics and tests)."""

    slabs: int
    slab_bytes: int
    inline_bytes: int
    free_slots: int
    writing_slots: int
    live_slots: int
    capacity: int
    slab_size: int


class _Loc(NamedTuple):
    size: int
    slab: int | None
    slot: int | None
    gen: int
    cls: int
    data: bytes | None
    nbytes: int | None


class _Claim(NamedTuple):
    slab: int
    slot: int
    gen: int
    cls: int
    nbytes: int  # of the slab


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _u8(part: Buffer) -> Bytes:
    """A flat uint8 view of any contiguous buffer, without copying."""
    return np.frombuffer(part, dtype=np.uint8)


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", 0) == sqlite3.SQLITE_FULL


def _owner_alive(writers: Path, owner: str) -> bool:
    """Whether the process behind ``owner`` still holds the flock on its owner file."""
    path = writers / owner
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        _arena.remove_file(path)  # dead: nobody will need its file again
        return False
    finally:
        os.close(fd)


class _Tx:
    """One write transaction on the index, with the counters it keeps in ``meta``."""

    def __init__(self, conn: sqlite3.Connection, root: Path) -> None:
        self.conn = conn
        self.root = root
        meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        self.capacity = int(meta["capacity"])
        self.slab_size = int(meta["slab_size"])
        self.inline_bytes = int(meta["inline_bytes"])
        self.next_gen = int(meta["next_gen"])
        self.evictions = int(meta["evictions"])
        self.epoch = int(meta["epoch"])
        self.slab_bytes = int(conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM slabs").fetchone()[0])
        # The filesystem may hold less than the capacity: never plan to use more than it has,
        # and leave room for the index (and its write-ahead log) to grow.
        self.configured_capacity = self.capacity
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(root).free
            self.capacity = min(self.capacity, max(0, self.used + free - FS_RESERVE))
        self.now = time.time()
        self.created: list[Path] = []  # slab files made here: removed if the transaction fails
        self.doomed: list[Path] = []  # slab files dropped here: removed once it commits
        self.no_grow = False
        self.reclaimed = False

    @property
    def used(self) -> int:
        return self.slab_bytes + self.inline_bytes

    def save(self) -> None:
        self.conn.executemany(
            "UPDATE meta SET value = ? WHERE name = ?",
            [
                (self.inline_bytes, "inline_bytes"),
                (self.next_gen, "next_gen"),
                (self.evictions, "evictions"),
                (self.epoch, "epoch"),
            ],
        )

    def gen(self) -> int:
        self.next_gen += 1
        return self.next_gen

    # -- recency ---------------------------------------------------------------------

    def touch(self, touches: Iterable[tuple[str, float]]) -> None:
        self.conn.executemany("UPDATE keys SET last_used = ?2 WHERE key = ?1 AND last_used < ?2", touches)

    # -- keys ------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.conn.execute("SELECT 1 FROM keys WHERE key = ?", (key,)).fetchone() is not None

    def remove(self, key: str) -> bool:
        """Delete a key and release what it held."""
        row = self.conn.execute("SELECT size, slab, slot, gen FROM keys WHERE key = ?", (key,)).fetchone()
        if row is None:
            return False
        size, slab, slot, gen = row
        self.conn.execute("DELETE FROM keys WHERE key = ?", (key,))
        if slab is None:
            self.inline_bytes -= size
        else:
            self.conn.execute(
                "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ?",
                (FREE, slab, slot, gen),
            )
        return True

    def put_inline(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        """Store a small object in the index; a replace that cannot fit keeps the old value."""
        if if_absent and self.exists(key):
            return False
        old = self.conn.execute("SELECT size FROM keys WHERE key = ? AND slab IS NULL", (key,)).fetchone()
        if len(data) > self.capacity or not self.make_room(len(data) - (int(old[0]) if old else 0)):
            return False
        self.remove(key)
        if not self.make_room(len(data)):  # only if the old value was itself evicted just now
            return False
        self.conn.execute(
            "INSERT INTO keys (key, size, cls, slab, slot, gen, last_used, data)"
            " VALUES (?, ?, 0, NULL, NULL, ?, ?, ?)",
            (key, len(data), self.gen(), self.now, data),
        )
        self.inline_bytes += len(data)
        return True

    def publish(self, key: str, size: int, claim: _Claim, if_absent: bool = False) -> bool:
        """Point ``key`` at a slot this writer filled; False if the slot was taken back."""
        row = self.conn.execute(
            "SELECT state, gen FROM slots WHERE slab = ? AND slot = ?", (claim.slab, claim.slot)
        ).fetchone()
        if row is None or tuple(row) != (WRITING, claim.gen):
            return False
        if if_absent and self.exists(key):
            self.release([claim])
            return False
        self.remove(key)
        self.conn.execute(
            "INSERT INTO keys (key, size, cls, slab, slot, gen, last_used, data)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
            (key, size, claim.cls, claim.slab, claim.slot, claim.gen, self.now),
        )
        self.conn.execute(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ?",
            (LIVE, claim.slab, claim.slot),
        )
        return True

    def release(self, claims: Iterable[_Claim]) -> None:
        self.conn.executemany(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ? AND state = ?",
            [(FREE, c.slab, c.slot, c.gen, WRITING) for c in claims],
        )

    # -- slots -----------------------------------------------------------------------

    def claim(self, cls: int, owner: str, inflight: set[int]) -> _Claim | None:
        """A slot of class ``cls`` for this writer, evicting if needed; None if no room."""
        found = self._free_slot(cls)
        if found is None and not self.reclaimed:
            self.reclaim(owner, inflight)
            found = self._free_slot(cls)
        need = _arena.slab_bytes(cls, self.slab_size)
        while found is None:
            if need > self.capacity:
                return None
            if not self.no_grow and self.used + need <= self.capacity:
                found = self._grow(cls, need)
                continue
            # Evict whichever is least recently used: an object of this class (its slot),
            # a whole slab of another class, or a small inline object (room to grow).
            key = self._oldest_key(cls)
            slab = self._oldest_slab(exclude_cls=cls)
            inline = None if self.no_grow else self._oldest_inline()
            reusable = slab is not None and slab[2] == need and cls <= self.slab_size
            if slab is not None and not reusable and self.no_grow:
                slab = None  # dropping it would not let us grow anyway
            ages = [(c[-1], rank) for rank, c in enumerate((key, slab, inline)) if c is not None]
            if not ages:
                return None
            victim = min(ages)[1]
            if victim == 0 and key is not None:
                self._evict_key(key[0], key[1], key[2])
                found = (key[1], key[2])
            elif victim == 1 and slab is not None and reusable:
                found = self._reformat(slab[0], cls)
            elif victim == 1 and slab is not None:
                self._drop_slab(slab[0], slab[2])
            elif inline is not None:
                self.remove(inline[0])
                self.evictions += 1
        gen = self.gen()
        inflight.add(gen)  # before any later reclaim in this transaction can see it
        self.conn.execute(
            "UPDATE slots SET state = ?, owner = ?, gen = ? WHERE slab = ? AND slot = ?",
            (WRITING, owner, gen, found[0], found[1]),
        )
        # Slabs made before a capacity change may differ in size from ``need``.
        return _Claim(found[0], found[1], gen, cls, self._slab_nbytes(found[0]))

    def _free_slot(self, cls: int) -> tuple[int, int] | None:
        row = self.conn.execute(
            "SELECT slab, slot FROM slots WHERE cls = ? AND state = ? LIMIT 1", (cls, FREE)
        ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def _slab_nbytes(self, slab_id: int) -> int:
        row = self.conn.execute("SELECT nbytes FROM slabs WHERE id = ?", (slab_id,)).fetchone()
        return int(row[0])

    def _grow(self, cls: int, nbytes: int) -> tuple[int, int] | None:
        try:
            tmp = _arena.create_slab_file(self.root, nbytes)
        except OSError as exc:
            if not _is_full(exc):
                raise
            self.no_grow = True
            return None
        nslots = _arena.slots_per_slab(cls, self.slab_size)
        try:
            slab_id = self.conn.execute(
                "INSERT INTO slabs (cls, nslots, nbytes) VALUES (?, ?, ?)", (cls, nslots, nbytes)
            ).lastrowid
            assert slab_id is not None
            final = _arena.slab_path(self.root, slab_id)
            os.rename(tmp, final)
        except BaseException:
            _arena.remove_file(tmp)
            raise
        self.created.append(final)
        self._add_slots(slab_id, cls, nslots)
        self.slab_bytes += nbytes
        return (slab_id, 0)

    def _add_slots(self, slab_id: int, cls: int, nslots: int) -> None:
        self.conn.executemany(
            "INSERT INTO slots (slab, slot, cls, state, owner, gen) VALUES (?, ?, ?, ?, NULL, 0)",
            [(slab_id, i, cls, FREE) for i in range(nslots)],
        )

    def _oldest_key(self, cls: int) -> tuple[str, int, int, float] | None:
        row = self.conn.execute(
            "SELECT key, slab, slot, last_used FROM keys WHERE cls = ? ORDER BY last_used, gen LIMIT 1",
            (cls,),
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _oldest_slab(self, exclude_cls: int) -> tuple[int, int, int, float] | None:
        """The slab whose newest object is oldest, among slabs no writer is filling."""
        row = self.conn.execute(
            "SELECT s.id, s.cls, s.nbytes,"
            " COALESCE((SELECT MAX(k.last_used) FROM keys k WHERE k.slab = s.id), -1.0) AS lu"
            " FROM slabs s WHERE s.cls != ?"
            " AND NOT EXISTS (SELECT 1 FROM slots t WHERE t.slab = s.id AND t.state = ?)"
            " ORDER BY lu, s.id LIMIT 1",
            (exclude_cls, WRITING),
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _oldest_inline(self) -> tuple[str, float] | None:
        row = self.conn.execute(
            "SELECT key, last_used FROM keys WHERE cls = 0 ORDER BY last_used, gen LIMIT 1"
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def _evict_key(self, key: str, slab: int, slot: int) -> None:
        self.conn.execute("DELETE FROM keys WHERE key = ?", (key,))
        self.conn.execute(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ?",
            (FREE, slab, slot),
        )
        self.evictions += 1

    def _empty_slab(self, slab_id: int) -> None:
        dropped = self.conn.execute("DELETE FROM keys WHERE slab = ?", (slab_id,)).rowcount
        self.evictions += max(dropped, 0)
        self.conn.execute("DELETE FROM slots WHERE slab = ?", (slab_id,))

    def _reformat(self, slab_id: int, cls: int) -> tuple[int, int]:
        """Give a whole slab of another class to ``cls``; its objects are evicted."""
        self._empty_slab(slab_id)
        nslots = _arena.slots_per_slab(cls, self.slab_size)
        self.conn.execute("UPDATE slabs SET cls = ?, nslots = ? WHERE id = ?", (cls, nslots, slab_id))
        self._add_slots(slab_id, cls, nslots)
        return (slab_id, 0)

    def lose_slab(self, slab_id: int, nbytes: int) -> None:
        """Forget a slab whose file is gone or damaged, with its keys (not counted as evictions)."""
        self.conn.execute("DELETE FROM keys WHERE slab = ?", (slab_id,))
        self.conn.execute("DELETE FROM slots WHERE slab = ?", (slab_id,))
        self.conn.execute("DELETE FROM slabs WHERE id = ?", (slab_id,))
        self.slab_bytes -= nbytes
        self.epoch += 1
        self.doomed.append(_arena.slab_path(self.root, slab_id))

    def _drop_slab(self, slab_id: int, nbytes: int) -> None:
        self._empty_slab(slab_id)
        self.conn.execute("DELETE FROM slabs WHERE id = ?", (slab_id,))
        self.slab_bytes -= nbytes
        self.epoch += 1
        self.doomed.append(_arena.slab_path(self.root, slab_id))

    def make_room(self, nbytes: int) -> bool:
        """Evict until ``nbytes`` more fit: the older of the oldest inline object and slab."""
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            inline = self._oldest_inline()
            slab = self._oldest_slab(exclude_cls=0)
            if inline is None and slab is None:
                return False
            if inline is not None and (slab is None or inline[1] <= slab[3]):
                self.remove(inline[0])
                self.evictions += 1
            elif slab is not None:
                self._drop_slab(slab[0], slab[2])
        return True

    def reclaim(self, owner: str | None, inflight: set[int]) -> int:
        """Free slots claimed by writers that died (or by this one, then abandoned)."""
        self.reclaimed = True
        writers = self.root / WRITERS_DIR
        alive: dict[str, bool] = {}
        lost: list[tuple[int, int, int]] = []
        for slab, slot, who, gen in self.conn.execute(
            "SELECT slab, slot, owner, gen FROM slots WHERE state = ?", (WRITING,)
        ).fetchall():
            if who == owner:
                dead = gen not in inflight
            else:
                if who not in alive:
                    alive[who] = bool(who) and _owner_alive(writers, who)
                dead = not alive[who]
            if dead:
                lost.append((slab, slot, gen))
        self.conn.executemany(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ?",
            [(FREE, *row) for row in lost],
        )
        return len(lost)


class LocalStore(Store):
    """Slab arena plus SQLite index in one directory; safe across processes and threads."""

    def __init__(self, path: Path | str, capacity: int | None = None, *, existing: bool = False,
                 readonly: bool = False) -> None:
        """``existing``: never create a store, never change its capacity (maintenance);
        ``readonly``: also never write (read commands: stats, audit without repair)."""
        self.path = Path(path).expanduser().absolute()
        self.uri = f"local://{self.path}"
        self._readonly = readonly
        if existing or readonly:
            if not (self.path / INDEX_NAME).is_file():
                raise StoreError(f"no local store at {self.path}: it has no {INDEX_NAME}")
            capacity = None
        else:
            _prepare_dir(self.path)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        self._inherited: list[sqlite3.Connection] = []  # never touched again after a fork
        self._maps = Mappings(self.path)
        self._epoch = -1
        self._touches: dict[str, float] = {}
        self._last_flush = time.monotonic()
        self._inflight: set[int] = set()
        self._lost: set[int] = set()  # slabs given up to free filesystem space, not yet out of the index
        self._owner: str | None = None
        self._owner_fd: int | None = None
        self._closed = False
        with self._guard("open"):
            if readonly:
                self._check_index()
            else:
                self._init_index(capacity)

    @classmethod
    def from_params(cls, path: Path, params: dict[str, str], existing: bool = False,
                    readonly: bool = False) -> LocalStore:
        """Open from URI parameters; only ``capacity`` is known."""
        unknown = sorted(set(params) - {"capacity"})
        if unknown:
            raise StoreError(f"unknown local store parameter(s): {', '.join(unknown)} (known: capacity)")
        capacity: int | None = None
        if params.get("capacity"):
            try:
                capacity = parse_size(params["capacity"])
            except ValueError as exc:
                raise StoreError(f"bad local store capacity: {exc}") from None
        return cls(path, capacity, existing=existing, readonly=readonly)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.path)!r})"

    # -- plumbing --------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn index and filesystem failures into one clear StoreError line."""
        try:
            yield
        except StoreError:
            raise
        except (sqlite3.Error, OSError) as exc:
            if _is_full(exc):
                raise IndexFull(f"local store {self.path}: {what} failed: no space left on its "
                                "filesystem") from None
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                    exc, (sqlite3.OperationalError, sqlite3.ProgrammingError, sqlite3.IntegrityError)):
                raise self._damaged(str(exc)) from None
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"local store {self.path}: {what} failed: {exc}") from None
            detail = exc.strerror or str(exc)
            where = f" ({exc.filename})" if exc.filename else ""
            raise StoreError(f"local store {self.path}: {what} failed: {detail}{where}") from None

    def _db(self) -> sqlite3.Connection:
        """This process's connection (a forked child opens its own)."""
        if self._closed:
            raise StoreError(f"local store {self.path} is closed")
        if self._pid != os.getpid():
            if self._conn is not None:
                self._inherited.append(self._conn)
            self._conn = None
            self._pid = os.getpid()
            if self._owner_fd is not None:
                os.close(self._owner_fd)  # the parent's flock stays with the parent
            self._owner = None
            self._owner_fd = None
            self._inflight.clear()
            self._touches.clear()
        if self._conn is None:
            conn = sqlite3.connect(
                self.path / INDEX_NAME,
                timeout=BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            # Keep the write-ahead log small: it lives on the same (maybe small) filesystem.
            conn.execute("PRAGMA wal_autocheckpoint = 256")
            conn.execute(f"PRAGMA journal_size_limit = {FS_RESERVE // 2}")
            self._conn = conn
        return self._conn

    @contextlib.contextmanager
    def _write(self, wait: bool = True) -> Iterator[_Tx]:
        """A write transaction; slab files are created or removed in step with it. With
        ``wait=False`` it fails at once (sqlite3.OperationalError) if another holds the lock."""
        with self._lock:
            conn = self._db()
            if wait:
                conn.execute("BEGIN IMMEDIATE")
            else:
                conn.execute("PRAGMA busy_timeout = 0")
                try:
                    conn.execute("BEGIN IMMEDIATE")
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            tx: _Tx | None = None
            try:
                tx = _Tx(conn, self.path)
                for slab_id in list(self._lost):
                    known = conn.execute("SELECT nbytes FROM slabs WHERE id = ?", (slab_id,)).fetchone()
                    if known is not None:
                        tx.lose_slab(slab_id, int(known[0]))
                self._lost.clear()
                if self._touches:
                    tx.touch(self._touches.items())
                    self._touches.clear()
                    self._last_flush = time.monotonic()
                yield tx
                tx.save()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                for path in tx.created if tx is not None else ():
                    _arena.remove_file(path)
                raise
            for path in tx.doomed:
                _arena.remove_file(path)
            if tx.epoch != self._epoch:
                self._sync_maps(conn, tx.epoch)

    def _sync_maps(self, conn: sqlite3.Connection, epoch: int) -> None:
        live = {int(r[0]) for r in conn.execute("SELECT id FROM slabs").fetchall()}
        self._maps.retain(live)
        self._epoch = epoch

    def _owner_token(self) -> str:
        """This process's writer identity, backed by an flock held until it exits."""
        if self._owner is not None and self._pid == os.getpid():
            return self._owner
        writers = self.path / WRITERS_DIR
        writers.mkdir(exist_ok=True)
        while True:
            token = f"{os.getpid()}-{os.urandom(6).hex()}"
            tmp = writers / f"{token}.new"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.rename(tmp, writers / token)
            except FileNotFoundError:  # swept as stale between create and lock: try again
                os.close(fd)
                continue
            self._owner, self._owner_fd = token, fd
            return token

    def _init_index(self, capacity: int | None) -> None:
        # Switching a fresh index to WAL while another process does the same can fail at
        # once with "database is locked" (SQLite does not wait there), so first opens queue
        # on an flock.
        fd = os.open(self.path / f"{INDEX_NAME}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._create_index(capacity)
        finally:
            os.close(fd)

        def housekeeping() -> None:
            with self._guard("open"), self._write() as tx:
                tx.reclaim(None, set())
                known = {int(r[0]) for r in tx.conn.execute("SELECT id FROM slabs").fetchall()}
                tx.doomed.extend(_arena.stray_files(self.path, known))
                if tx.used > tx.capacity:
                    tx.make_room(0)

        # On a full filesystem the store still opens (and serves reads) even if nothing
        # could be freed: the next put that finds room tidies up.
        with contextlib.suppress(IndexFull):
            self._with_room(housekeeping)
        self._sweep_writers()

    def _create_index(self, capacity: int | None) -> None:
        conn = self._db()
        with self._lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
                if not meta:
                    if capacity is None:
                        free = shutil.disk_usage(self.path).free
                        capacity = int(free * DEFAULT_CAPACITY_SHARE)
                    conn.executemany(
                        "INSERT INTO meta (name, value) VALUES (?, ?)",
                        [
                            ("schema", SCHEMA_VERSION),
                            ("capacity", capacity),
                            ("slab_size", _arena.slab_size_for(capacity)),
                            ("inline_bytes", 0),
                            ("next_gen", 0),
                            ("evictions", 0),
                            ("epoch", 0),
                        ],
                    )
                else:
                    self._check_meta(meta)
                if meta and capacity is not None and capacity != meta["capacity"]:
                    # New slabs follow the new capacity; existing ones keep their size.
                    conn.executemany(
                        "UPDATE meta SET value = ? WHERE name = ?",
                        [(capacity, "capacity"), (_arena.slab_size_for(capacity), "slab_size")],
                    )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _damaged(self, why: str) -> StoreDamaged:
        return StoreDamaged(
            f"local store {self.path}: its index is damaged ({why}); rebuild it with `prefixvault "
            f"audit --repair --store local://{self.path}` (the cached objects are dropped)"
        )

    def _check_meta(self, meta: dict[str, int]) -> None:
        if meta.get("schema") != SCHEMA_VERSION:
            raise self._damaged(f"schema {meta.get('schema')}, this version reads {SCHEMA_VERSION}")
        missing = sorted(set(META_NAMES) - set(meta))
        if missing:
            raise self._damaged(f"no {', '.join(missing)} in its meta table")

    def _check_index(self) -> None:
        """What a read-only open checks: the index answers and is of this schema."""
        self._check_meta(dict(self._db().execute("SELECT name, value FROM meta").fetchall()))

    @classmethod
    def rebuild(cls, path: Path | str) -> tuple[Path, int]:
        """Start a damaged store afresh: its index is moved aside (returned), its slab files
        removed (counted); a new, empty index keeps the old capacity where it can be read."""
        root = Path(path).expanduser().absolute()
        capacity: int | None = None
        with contextlib.suppress(sqlite3.Error, TypeError, ValueError):
            conn = sqlite3.connect(root / INDEX_NAME)
            try:
                row = conn.execute("SELECT value FROM meta WHERE name = 'capacity'").fetchone()
                capacity = int(row[0]) if row else None
            finally:
                conn.close()
        aside = root / f"{INDEX_NAME}.damaged-{int(time.time())}"
        for suffix in ("", "-wal", "-shm"):
            src = root / f"{INDEX_NAME}{suffix}"
            if src.exists():
                os.replace(src, Path(f"{aside}{suffix}"))
        removed = 0
        for entry in os.scandir(root):
            if entry.name.startswith("slab-"):
                _arena.remove_file(Path(entry.path))
                removed += 1
        cls(root, capacity).close()
        return aside, removed

    def _writable(self) -> None:
        if self._readonly:
            raise StoreError(f"local store {self.path} was opened read-only")

    def _sweep_writers(self) -> None:
        """Remove owner files of writers that are gone."""
        writers = self.path / WRITERS_DIR
        if not writers.is_dir():
            return
        for entry in os.scandir(writers):
            if entry.name != self._owner:
                _owner_alive(writers, entry.name)

    # -- reads -----------------------------------------------------------------------

    def _locate(self, keys: Sequence[str]) -> dict[str, _Loc]:
        """Where each key lives now."""
        with self._lock:
            conn = self._db()
            found: dict[str, _Loc] = {}
            unique = list(dict.fromkeys(keys))
            for chunk in _chunks(unique):
                for row in conn.execute(
                    "SELECT k.key, k.size, k.slab, k.slot, k.gen, k.cls, k.data, s.nbytes"
                    " FROM keys k LEFT JOIN slabs s ON s.id = k.slab"
                    f" WHERE k.key IN ({_marks(len(chunk))})",
                    chunk,
                ):
                    found[row[0]] = _Loc(*row[1:])
            epoch = conn.execute("SELECT value FROM meta WHERE name = 'epoch'").fetchone()[0]
            if epoch != self._epoch:
                self._sync_maps(conn, epoch)
            return found

    def _moved(self, checks: Sequence[tuple[str, _Loc]]) -> set[str]:
        """Keys that no longer name the slot they were read from."""
        if not checks:
            return set()
        want = {key: (loc.slab, loc.slot, loc.gen) for key, loc in checks}
        same: set[str] = set()
        with self._lock:
            conn = self._db()
            for chunk in _chunks(list(want)):
                for key, slab, slot, gen in conn.execute(
                    f"SELECT key, slab, slot, gen FROM keys WHERE key IN ({_marks(len(chunk))})",
                    chunk,
                ):
                    if want[key] == (slab, slot, gen):
                        same.add(key)
        return set(want) - same

    def _touch(self, keys: Iterable[str]) -> None:
        """Note reads for LRU; written back later in batches, never waiting for the index.

        A read must not wait behind another process's write transaction just to record its
        recency: the write-back tries the index lock without waiting, and if it is taken the
        touches stay pending (at most ``TOUCH_PENDING_MAX``, oldest dropped: recency is lossy).
        """
        if self._readonly:
            return
        now = time.time()
        with self._lock:
            for key in keys:
                self._touches[key] = now
            while len(self._touches) > TOUCH_PENDING_MAX:
                del self._touches[next(iter(self._touches))]
            due = time.monotonic() - self._last_flush >= TOUCH_FLUSH_S
            if self._touches and (due or len(self._touches) >= TOUCH_FLUSH_MAX):
                self._last_flush = time.monotonic()
                with contextlib.suppress(sqlite3.OperationalError), self._write(wait=False):
                    pass  # the write transaction flushes pending touches

    def _read(
        self,
        keys: Sequence[str],
        room: Callable[[int], int],
        take: Callable[[int, Bytes], None],
    ) -> list[int | None]:
        """Hand each key's bytes to ``take(i, bytes)``; return sizes, None where missing.

        An object larger than ``room(i)`` is reported with its size and not copied. A copy
        that raced with reuse of its slot is discarded and read again.
        """
        for key in keys:
            check_key(key)
        sizes: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        broken: dict[int, int] = {}  # slab id -> bytes, for slabs whose file is gone or short
        with self._guard("get"):
            for _ in range(READ_ATTEMPTS):
                found = self._locate([keys[i] for i in todo])
                copied: list[tuple[int, _Loc]] = []
                retry: list[int] = []
                for i in todo:
                    loc = found.get(keys[i])
                    if loc is None:
                        sizes[i] = None
                    elif loc.size > room(i):
                        sizes[i] = loc.size
                    elif loc.data is not None or loc.size == 0:
                        take(i, np.frombuffer(loc.data or b"", dtype=np.uint8))
                        sizes[i] = loc.size
                    elif loc.slab is not None and loc.slot is not None and loc.nbytes is not None:
                        with self._lock:
                            view = self._maps.view(loc.slab, loc.nbytes)
                        if view is None:  # its file is gone or short, or the slab was dropped
                            broken[loc.slab] = loc.nbytes
                            retry.append(i)
                            continue
                        start = loc.slot * loc.cls
                        take(i, view[start : start + loc.size])
                        copied.append((i, loc))
                    else:
                        retry.append(i)  # its slab went away after the lookup
                moved = self._moved([(keys[i], loc) for i, loc in copied])
                for i, loc in copied:
                    if keys[i] in moved:
                        retry.append(i)
                    else:
                        sizes[i] = loc.size
                todo = retry
                if not todo:
                    break
            for i in todo:
                sizes[i] = None
            if broken and not self._readonly:
                self._forget_slabs(broken)
            self._touch(keys[i] for i in range(len(keys)) if sizes[i] is not None)
        return sizes

    def _forget_slabs(self, slabs: dict[int, int]) -> None:
        """Drop slabs whose file is gone or cut short, with every key they hold (best effort):
        lookups stop finding those keys, and the next save writes them again."""
        with contextlib.suppress(sqlite3.Error, OSError), self._write() as tx:
            for slab_id in slabs:
                known = tx.conn.execute("SELECT nbytes FROM slabs WHERE id = ?", (slab_id,)).fetchone()
                if known is None or self._maps.view(slab_id, int(known[0])) is not None:
                    continue  # dropped already, or whole
                tx.lose_slab(slab_id, int(known[0]))

    def _release_space(self) -> bool:
        """The filesystem is full and the index cannot grow, so no transaction can evict:
        give up the least recently used slab by truncating its file first (the space comes
        back at once, even where other processes map it; they see the short file before
        any copy and forget it) and taking it out of the index in the next transaction."""
        with self._lock:
            row = self._db().execute(
                "SELECT s.id, COALESCE((SELECT MAX(k.last_used) FROM keys k WHERE k.slab = s.id), -1.0)"
                " AS lu FROM slabs s WHERE s.id NOT IN (SELECT slab FROM slots WHERE state = ?)"
                f" {'AND s.id NOT IN (' + ','.join(map(str, self._lost)) + ')' if self._lost else ''}"
                " ORDER BY lu, s.id LIMIT 1",
                (WRITING,),
            ).fetchone()
            if row is None:
                return False
            slab_id = int(row[0])
            path = _arena.slab_path(self.path, slab_id)
            with contextlib.suppress(FileNotFoundError):
                os.truncate(path, 0)
            _arena.remove_file(path)
            self._maps.forget(slab_id)
            self._lost.add(slab_id)
            return True

    def _with_room(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; if the filesystem was full, free a slab's space and run it once more."""
        try:
            return fn()
        except IndexFull:
            with self._guard("free space"):
                if not self._release_space():
                    raise
            return fn()

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        dsts = [np.frombuffer(buf, dtype=np.uint8) for buf in buffers]

        def take(i: int, src: Bytes) -> None:
            np.copyto(dsts[i][: src.nbytes], src)

        return self._read(keys, lambda i: int(dsts[i].nbytes), take)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        got: dict[int, bytes] = {}

        def take(i: int, src: Bytes) -> None:
            got[i] = src.tobytes()

        sizes = self._read(keys, lambda i: sys.maxsize, take)
        return [None if size is None else got[i] for i, size in enumerate(sizes)]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        present: set[str] = set()
        with self._guard("exists"), self._lock:
            conn = self._db()
            for chunk in _chunks(list(dict.fromkeys(keys))):
                present.update(
                    r[0]
                    for r in conn.execute(f"SELECT key FROM keys WHERE key IN ({_marks(len(chunk))})", chunk)
                )
        return [key in present for key in keys]

    def touch_many(self, keys: Sequence[str]) -> list[bool]:
        found = self.exists_many(keys)
        with self._guard("exists"):
            self._touch(k for k, ok in zip(keys, found, strict=True) if ok)
        return found

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        # Every key character sorts below DEL, so [prefix, prefix + DEL) is the prefix range.
        with self._guard("scan"), self._lock:
            rows = (
                self._db()
                .execute(
                    "SELECT key, size FROM keys WHERE key >= ? AND key < ? ORDER BY key",
                    (prefix, prefix + "\x7f"),
                )
                .fetchall()
            )
        return iter([(str(k), int(n)) for k, n in rows])

    def stats(self) -> StoreStats:
        with self._guard("stats"), self._lock:
            conn = self._db()
            objects, nbytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM keys").fetchone()
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        return StoreStats(int(objects), int(nbytes), int(meta["capacity"]), int(meta["evictions"]))

    def usage(self) -> LocalUsage:
        """Slabs, slots by state and bytes reserved: what ``stats`` does not show."""
        with self._guard("usage"), self._lock:
            conn = self._db()
            slabs, slab_bytes = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM slabs"
            ).fetchone()
            states = dict(conn.execute("SELECT state, COUNT(*) FROM slots GROUP BY state").fetchall())
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        return LocalUsage(
            slabs=int(slabs),
            slab_bytes=int(slab_bytes),
            inline_bytes=int(meta["inline_bytes"]),
            free_slots=int(states.get(FREE, 0)),
            writing_slots=int(states.get(WRITING, 0)),
            live_slots=int(states.get(LIVE, 0)),
            capacity=int(meta["capacity"]),
            slab_size=int(meta["slab_size"]),
        )

    # -- writes ----------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self._writable()
        keys = [check_key(key) for key, _ in items]
        parts = [[_u8(p) for p in ps] for _, ps in items]
        sizes = [sum(p.nbytes for p in ps) for ps in parts]
        return self._put(keys, parts, sizes, if_absent=False)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self._writable()
        check_key(key)
        if self.exists_many([key])[0]:
            return False
        part = _u8(data)
        return self._put([key], [[part]], [part.nbytes], if_absent=True)[0]

    def _put(
        self, keys: list[str], parts: list[list[Bytes]], sizes: list[int], if_absent: bool
    ) -> list[bool]:
        """Put, and on a full filesystem free one slab's space and try once more; a put that
        still finds no room is refused (False), never an error."""
        for attempt in range(2):
            done = self._put_once(keys, parts, sizes, if_absent)
            if done is not None:
                return done
            with self._guard("free space"):
                if attempt or not self._release_space():
                    break
        return [False] * len(keys)

    def _put_once(
        self, keys: list[str], parts: list[list[Bytes]], sizes: list[int], if_absent: bool
    ) -> list[bool] | None:
        """One try; None if the filesystem had no room for the index to grow."""
        ok = [False] * len(keys)
        claims: dict[int, _Claim] = {}
        published = False
        try:
            with self._guard("put"):
                try:
                    with self._lock:
                        slab_size = self._slab_size()
                        classes = [_arena.size_class(n, slab_size) for n in sizes]
                        if any(classes):
                            self._claim(keys, classes, claims, if_absent)
                    lost = self._copy(parts, sizes, claims)
                    with self._write() as tx:
                        for i, key in enumerate(keys):
                            if classes[i] == 0:
                                ok[i] = tx.put_inline(key, b"".join(p.data for p in parts[i]), if_absent)
                            elif i in claims and i not in lost:
                                ok[i] = tx.publish(key, sizes[i], claims[i], if_absent)
                    published = True
                except (OSError, sqlite3.Error) as exc:
                    if _is_full(exc):
                        return None
                    raise
        finally:
            if claims and not published:
                self._abandon(list(claims.values()))
            with self._lock:
                self._inflight.difference_update(c.gen for c in claims.values())
        return ok

    def _slab_size(self) -> int:
        row = self._db().execute("SELECT value FROM meta WHERE name = 'slab_size'").fetchone()
        return int(row[0])

    def _claim(self, keys: list[str], classes: list[int], claims: dict[int, _Claim], if_absent: bool) -> None:
        owner = self._owner_token()
        with self._write() as tx:
            for i, cls in enumerate(classes):
                if cls == 0 or (if_absent and tx.exists(keys[i])):
                    continue
                claim = tx.claim(cls, owner, self._inflight)
                if claim is not None:
                    claims[i] = claim

    def _copy(self, parts: list[list[Bytes]], sizes: list[int], claims: dict[int, _Claim]) -> set[int]:
        """Fill claimed slots (no index lock held, so readers and other writers proceed);
        return the items whose slab file is gone or cut short (those slabs are forgotten)."""
        lost: dict[int, int] = {}
        failed: set[int] = set()
        for i, claim in claims.items():
            with self._lock:
                view = self._maps.view(claim.slab, claim.nbytes)
            if view is None:
                lost[claim.slab] = claim.nbytes
                failed.add(i)
                continue
            start = claim.slot * claim.cls
            dst = view[start : start + sizes[i]]
            pos = 0
            for part in parts[i]:
                n = part.nbytes
                if n:
                    np.copyto(dst[pos : pos + n], part)
                    pos += n
        if lost:
            self._forget_slabs(lost)
        return failed

    def _abandon(self, claims: list[_Claim]) -> None:
        """Give back slots of a put that failed midway (best effort)."""
        with contextlib.suppress(sqlite3.Error, OSError, StoreError), self._write() as tx:
            tx.release(claims)

    def delete_many(self, keys: Sequence[str]) -> int:
        self._writable()
        for key in keys:
            check_key(key)

        def delete() -> int:
            with self._guard("delete"), self._write() as tx:
                return sum(tx.remove(key) for key in dict.fromkeys(keys))

        return self._with_room(delete)

    def close(self) -> None:
        """Write back pending recency, drop mappings and this writer's owner file."""
        with self._lock:
            if self._closed:
                return
            if self._touches and self._pid == os.getpid():
                with contextlib.suppress(StoreError, sqlite3.Error, OSError), self._write():
                    pass
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
            self._maps.clear()
            if self._owner is not None and self._owner_fd is not None and self._pid == os.getpid():
                _arena.remove_file(self.path / WRITERS_DIR / self._owner)
                os.close(self._owner_fd)
            self._owner = self._owner_fd = None
            self._closed = True


def _prepare_dir(path: Path) -> None:
    """Create the store directory, or say in one line why it cannot be one."""
    if path.exists() and not path.is_dir():
        raise StoreError(f"local store path {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create local store directory {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"local store directory {path} is not writable")
    if not (path / INDEX_NAME).exists():
        foreign = [
            name for name in os.listdir(path) if not name.startswith(("slab-", WRITERS_DIR, INDEX_NAME))
        ]
        if foreign:
            raise StoreError(
                f"local store directory {path} is not empty and holds no {INDEX_NAME};"
                " use an empty or new directory"
            )
