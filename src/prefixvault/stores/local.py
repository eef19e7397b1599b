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

The ideas around it live in their own modules: the byte arena (``_arena``), the index and
eviction (``_index``), writer liveness (``_writers``), the directory and its index's
creation, checks and rebuild (``_directory``). This module is the read/write protocol, a
forked child's fresh start (``_db``), and how the store heals: damaged slabs forgotten, a
full filesystem given room.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from prefixvault.stores import _arena, _directory
from prefixvault.stores._arena import Bytes, Mappings
from prefixvault.stores._directory import StateBudget, StoreDamaged
from prefixvault.stores._index import (
    BUSY_TIMEOUT_S,
    CONSISTENT,
    FREE,
    INDEX_NAME,
    LIVE,
    SLOT_JOIN,
    WRITING,
    Claim,
    Location,
    Transaction,
    chunks,
    connect,
    is_full,
    marks,
    pool_of,
    state_bytes,
)
from prefixvault.stores._writers import WriterToken
from prefixvault.stores.base import (
    Buffer,
    Fill,
    Medium,
    Store,
    StoreError,
    StoreStats,
    StoreUnavailable,
    Take,
    check_distinct,
    check_key,
    medium_of_path,
    namespace_of,
)
from prefixvault.units import parse_size

#: Recency from gets is written back at most this often (and before any eviction).
TOUCH_FLUSH_S = 1.0
TOUCH_FLUSH_MAX = 4096
TOUCH_PENDING_MAX = 65536
#: Keys used together are this many seconds apart in recency, in the order given.
RANK_TICK = 1e-6
#: A read that loses a race with slot reuse is retried this many times in all.
READ_ATTEMPTS = 3

#: How long a fork waits for a thread of this process to finish a store call before it forks
#: anyway; a store still busy then is unusable in the child (a clear error, never a hang).
FORK_WAIT_S = 5.0
#: SQLite's errors for a statement of ours naming what the index's schema lacks: its schema
#: text is damaged (never a transient failure, as a lock or an I/O error is).
_SCHEMA_GONE = ("no such column", "no such table")

__all__ = ["IndexFull", "IndexRepair", "LocalStore", "LocalUsage", "StoreDamaged"]

_T = TypeVar("_T")


class IndexFull(StoreUnavailable):
    """The store's filesystem has no room left for the index to grow: like a store that is
    down, it costs hits until room comes back (an engine that opens it then serves cold, with
    one warning, and its breaker tries again later), never an engine that fails to start."""


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


@dataclass(frozen=True)
class IndexRepair:
    """What ``LocalStore.heal`` set right."""

    slabs_lost: int  # slab files gone, cut short, damaged, or whose rows do not fit them
    rows_dropped: int  # key rows that named nothing, or a slot another key names too
    slots_freed: int  # live slots no key names, and slot rows of no slab
    strays_removed: int  # files in the directory no index row names

    def __str__(self) -> str:
        return (f"slabs lost: {self.slabs_lost}  index rows dropped: {self.rows_dropped}  "
                f"slots freed: {self.slots_freed}  stray files removed: {self.strays_removed}")


def _state_budget(text: str, name: str = "states") -> StateBudget:
    """``states=`` or ``namespace_share=``: a size (``8GiB``) or a share of the capacity
    (``25%``); ``0`` for none."""
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{text!r} is not between 0% and 100%")
            return StateBudget(share=share)
        return StateBudget(nbytes=parse_size(text))
    except ValueError as exc:
        raise StoreError(f"bad local store parameter {name}={text[:100]!r}: {exc} "
                         "(use a size such as 8GiB, or a share of the capacity such as 25%)") from None


def _fits(slot: int, cls: int, size: int, slab_bytes: int) -> bool:
    """Whether an index row's slot lies inside its slab (a damaged index can say otherwise:
    such a row is the slab's damage, a store error's worth, never a ValueError)."""
    return slot >= 0 and 0 <= size <= cls and (slot + 1) * cls <= slab_bytes


def _nameable(key: object) -> bool:
    """Whether an index row's key is one a caller could name (damage can leave others)."""
    try:
        check_key(key)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def _u8(part: Buffer) -> Bytes:
    """A flat uint8 view of any contiguous buffer, without copying."""
    return np.frombuffer(part, dtype=np.uint8)


def _filled(fill: Fill, size: int) -> bytes:
    """The bytes ``fill`` writes, for an object kept inline (too small for a slot)."""
    buf = bytearray(size)
    fill(memoryview(buf))
    return bytes(buf)


class LocalStore(Store):
    """Slab arena plus SQLite index in one directory; safe across processes and threads."""

    def __init__(self, path: Path | str, capacity: int | None = None, *, existing: bool = False,
                 readonly: bool = False, shared: bool = False, states: StateBudget | None = None,
                 namespace_share: StateBudget | None = None) -> None:
        """``existing``: never create a store, never change its capacity (maintenance);
        ``readonly``: also never write (read commands: stats, audit without repair);
        ``shared``: a store for several users of one group (files 0660) instead of its owner
        alone (files 0600, a directory of its own that nobody else can write);
        ``states``: the most the recurrent states may take (None: keep what the store has;
        ``StateBudget(0)``: no budget of their own, they share the capacity with the rest);
        ``namespace_share``: the most each namespace's objects may take, the same for each (None:
        keep what the store has; ``StateBudget(0)``: none); with it, a put evicts only objects of
        its own namespace, so one tenant filling the store leaves the others' objects alone."""
        self.path = Path(path).expanduser().absolute()
        self.uri = f"local://{self.path}"
        self._medium = medium_of_path(str(self.path))
        self._readonly = readonly
        self._mode = 0o660 if shared else 0o600
        if existing or readonly:
            if not os.path.lexists(self.path / INDEX_NAME):
                raise StoreError(f"no local store at {self.path}: it has no {INDEX_NAME}")
            # Maintenance opens (no ``?shared=``) keep the store as it was made: shared or not.
            with contextlib.suppress(OSError):
                self._mode = 0o600 | (os.stat(self.path / INDEX_NAME).st_mode & 0o060)
            capacity = None
            states = namespace_share = None
        else:
            if capacity is not None and capacity <= 0:
                raise StoreError(f"local store {self.path}: capacity={capacity} keeps nothing; give a "
                                 "size such as 64GiB, or none for a quarter of the free space")
            _directory.prepare(self.path, shared)
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
        self._writer = WriterToken(self.path, self._mode)
        self._closed = False
        self._torn_by_fork = False  # forked while another thread was inside a call: unusable here
        _OPEN.add(self)
        # A store that is there but cannot be opened now (its files damaged, an I/O error) is
        # down, not misconfigured: an engine serves cold with one warning and tries again later.
        with self._guard("open", down=True):
            _directory.check_index_files(self.path)
            if readonly:
                self._check_index()
            else:
                self._init_index(capacity, states, namespace_share)

    @classmethod
    def from_params(cls, path: Path, params: dict[str, str], existing: bool = False,
                    readonly: bool = False) -> LocalStore:
        """Open from URI parameters: ``capacity``, ``states`` and ``namespace_share`` (each a
        size or ``N%`` of the capacity) and ``shared`` (``1``: several users)."""
        unknown = sorted(set(params) - {"capacity", "shared", "states", "namespace_share"})
        if unknown:
            raise StoreError(f"unknown local store parameter(s): {', '.join(unknown)} "
                             "(known: capacity, states, namespace_share, shared)")
        shared = params.get("shared", "0")
        if shared not in ("0", "1"):
            raise StoreError(f"bad local store parameter shared={shared[:100]!r}: use 0 or 1")
        capacity: int | None = None
        if params.get("capacity"):
            try:
                capacity = parse_size(params["capacity"])
            except ValueError as exc:
                raise StoreError(f"bad local store capacity: {exc}") from None
        states = _state_budget(params["states"]) if params.get("states") else None
        share = params.get("namespace_share")
        namespaces = _state_budget(share, "namespace_share") if share else None
        return cls(path, capacity, existing=existing, readonly=readonly, shared=shared == "1",
                   states=states, namespace_share=namespaces)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.path)!r})"

    # -- plumbing --------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str, down: bool = False) -> Iterator[None]:
        """Turn index and filesystem failures into one clear StoreError line (``down``: a
        StoreUnavailable, for a store that is there but cannot be used now)."""
        error = StoreUnavailable if down else StoreError
        try:
            yield
        except StoreError:
            raise
        except UnicodeDecodeError:  # SQLite quoting damaged schema text in its message
            raise _directory.damaged(self.path, "text in it is not UTF-8") from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            if not down:
                raise
            # Opening reads rows every index has (meta's counters): one missing, or of the
            # wrong type, is an index whose pages answer wrongly.
            raise _directory.damaged(self.path, f"{type(exc).__name__}: {exc}"[:200]) from None
        except (sqlite3.Error, OSError) as exc:
            if is_full(exc):
                raise IndexFull(f"local store {self.path}: {what} failed: no space left on its "
                                "filesystem") from None
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                    exc, (sqlite3.OperationalError, sqlite3.ProgrammingError, sqlite3.IntegrityError)):
                raise _directory.damaged(self.path, str(exc)) from None
            if isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(_SCHEMA_GONE):
                # Our own statements name what our schema has: the index's schema text was damaged.
                raise _directory.damaged(self.path, str(exc)[:200]) from None
            if isinstance(exc, sqlite3.Error):
                raise error(f"local store {self.path}: {what} failed: {exc}") from None
            detail = exc.strerror or str(exc)
            where = f" ({exc.filename})" if exc.filename else ""
            raise error(f"local store {self.path}: {what} failed: {detail}{where}") from None

    def _db(self) -> sqlite3.Connection:
        """This process's connection (a forked child opens its own)."""
        if self._closed:
            raise StoreError(f"local store {self.path} is closed")
        if self._torn_by_fork and self._pid != os.getpid():
            raise StoreError(f"local store {self.path}: this process was forked while another thread "
                             "was inside a call on it; open the store again in this process")
        if self._pid != os.getpid():
            if self._conn is not None:
                self._inherited.append(self._conn)
            self._conn = None
            self._pid = os.getpid()
            self._writer.after_fork()
            self._inflight.clear()
            self._touches.clear()
        if self._conn is None:
            self._conn = connect(self.path / INDEX_NAME)
        return self._conn

    @contextlib.contextmanager
    def _write(self, wait: bool = True) -> Iterator[Transaction]:
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
            tx: Transaction | None = None
            try:
                tx = Transaction(conn, self.path)
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

    def _init_index(self, capacity: int | None, states: StateBudget | None,
                    namespaces: StateBudget | None = None) -> None:
        # Switching a fresh index to WAL while another process does the same can fail at
        # once with "database is locked" (SQLite does not wait there), so first opens queue
        # on an flock.
        fd = os.open(self.path / f"{INDEX_NAME}.lock",
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, self._mode)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, self._mode)  # the umask may have taken group bits a shared store needs
            fcntl.flock(fd, fcntl.LOCK_EX)
            with self._lock:
                _directory.own_index_files(self.path, self._mode)  # before SQLite makes its log files
                _directory.create_or_check(self._db(), self.path, capacity, states, namespaces)
                _directory.own_index_files(self.path, self._mode)
        finally:
            os.close(fd)

        def housekeeping() -> None:
            with self._guard("open", down=True), self._write() as tx:
                tx.reclaim(None, set())
                known = {int(r[0]) for r in tx.conn.execute("SELECT id FROM slabs").fetchall()}
                tx.doomed.extend(_arena.stray_files(self.path, known))
                if tx.used > tx.capacity:
                    tx.make_room(0)
                tx.fit_state(0)  # a budget made smaller
                tx.fit_namespaces()  # a bound made smaller

        # On a full filesystem the store still opens (and serves reads) even if nothing
        # could be freed: the next put that finds room tidies up.
        with contextlib.suppress(IndexFull):
            self._with_room(housekeeping)
        self._writer.sweep()

    def _check_index(self) -> None:
        """What a read-only open checks: the index answers and is of this schema."""
        _directory.check_meta(self.path, dict(self._db().execute("SELECT name, value FROM meta").fetchall()))

    @classmethod
    def rebuild(cls, path: Path | str) -> tuple[Path, int]:
        """Start a damaged store afresh: its index is moved aside (returned) and its slab files
        removed (counted); a new, empty index keeps the old capacity, states' budget and
        namespaces' bound where they can be read."""
        root = Path(path).expanduser().absolute()
        aside, removed, capacity, states, namespaces = _directory.set_aside(root)
        cls(root, capacity, states=states, namespace_share=namespaces).close()
        return aside, removed

    def check_integrity(self) -> None:
        """StoreDamaged unless SQLite finds the index whole (reads all of it: for repairs)."""
        with self._guard("check", down=True), self._lock:
            problems = [str(r[0]) for r in self._db().execute("PRAGMA integrity_check(5)").fetchall()]
        if problems != ["ok"]:
            raise _directory.damaged(self.path, "; ".join(problems)[:300])

    def heal(self) -> IndexRepair:
        """Bring the index back in line with itself and with its files (``audit --repair``):
        slabs whose file is not whole or whose slot rows do not fit them are lost with their
        keys; key rows that name nothing, or that share a slot, are dropped; live slots no key
        names are freed; counters are counted afresh; stray files go. Every object left is
        one a read would find whole; none of them is removed."""
        self._writable()
        with self._guard("repair"), self._lock:
            conn = self._db()
            lost: dict[int, int] = {}
            for slab_id, nbytes in conn.execute("SELECT id, nbytes FROM slabs").fetchall():
                if not _arena.is_whole(self.path, int(slab_id), int(nbytes)):
                    lost[int(slab_id)] = int(nbytes)
            for slab_id, nbytes in conn.execute(
                "SELECT DISTINCT s.id, s.nbytes FROM slots t JOIN slabs s ON s.id = t.slab"
                " WHERE t.slot < 0 OR t.cls <= 0 OR t.cls != s.cls OR (t.slot + 1) * t.cls > s.nbytes"
            ).fetchall():
                lost[int(slab_id)] = int(nbytes)
            with self._write() as tx:
                for slab_id, nbytes in lost.items():
                    tx.lose_slab(slab_id, nbytes)
                orphan_slots = tx.conn.execute(
                    "DELETE FROM slots WHERE slab NOT IN (SELECT id FROM slabs)").rowcount
                shared = [r[0] for r in tx.conn.execute(
                    "SELECT key FROM keys WHERE (slab, slot) IN (SELECT slab, slot FROM keys"
                    " WHERE slab IS NOT NULL GROUP BY slab, slot HAVING COUNT(*) > 1)")]
                stale = [r[0] for r in tx.conn.execute(
                    f"SELECT k.key FROM keys k {SLOT_JOIN} WHERE NOT {CONSISTENT}"
                    " OR (k.slab IS NULL AND COALESCE(length(k.data), 0) != k.size)")]
                nameless = [k for (k,) in tx.conn.execute("SELECT key FROM keys") if not _nameable(k)]
                rows = list(dict.fromkeys([*shared, *stale, *nameless]))
                for key in rows:  # matched as bytes: a damaged key need not be text
                    tx.conn.execute("DELETE FROM keys WHERE CAST(key AS BLOB) = ?",
                                    (str(key).encode("utf-8", "surrogateescape"),))
                freed = tx.conn.execute(
                    "UPDATE slots SET state = ?, owner = NULL WHERE state = ? AND NOT EXISTS (SELECT 1"
                    " FROM keys k WHERE k.slab = slots.slab AND k.slot = slots.slot AND k.gen = slots.gen)",
                    (FREE, LIVE)).rowcount
                tx.inline_bytes = int(tx.conn.execute(
                    "SELECT COALESCE(SUM(size), 0) FROM keys WHERE slab IS NULL").fetchone()[0])
                tx.recount_states()
                top = tx.conn.execute("SELECT MAX(COALESCE((SELECT MAX(gen) FROM keys), 0),"
                                      " COALESCE((SELECT MAX(gen) FROM slots), 0))").fetchone()[0]
                tx.next_gen = max(tx.next_gen, int(top or 0))  # generations are never reused
                known = {int(r[0]) for r in tx.conn.execute("SELECT id FROM slabs").fetchall()}
                strays = _arena.stray_files(self.path, known)
                tx.doomed.extend(strays)
        self._writer.sweep()
        return IndexRepair(slabs_lost=len(lost), rows_dropped=len(rows),
                           slots_freed=max(freed, 0) + max(orphan_slots, 0), strays_removed=len(strays))

    def _writable(self) -> None:
        if self._readonly:
            raise StoreError(f"local store {self.path} was opened read-only")

    # -- reads -----------------------------------------------------------------------

    def _locate(self, keys: Sequence[str]) -> dict[str, Location]:
        """Where each key lives now."""
        with self._lock:
            conn = self._db()
            found: dict[str, Location] = {}
            unique = list(dict.fromkeys(keys))
            for chunk in chunks(unique):
                for row in conn.execute(
                    "SELECT k.key, k.size, k.slab, k.slot, k.gen, k.cls, k.data, s.nbytes,"
                    f" {CONSISTENT} AND (k.slab IS NULL OR s.id IS NOT NULL)"
                    f" FROM keys k LEFT JOIN slabs s ON s.id = k.slab {SLOT_JOIN}"
                    f" WHERE k.key IN ({marks(len(chunk))})",
                    chunk,
                ):
                    size, slab, slot, gen, cls, data, nbytes, sound = row[1:]
                    sound = sound and (slab is not None or len(data or b"") == size)
                    found[row[0]] = Location(size, slab, slot, gen, cls, data, nbytes, bool(sound))
            epoch = conn.execute("SELECT value FROM meta WHERE name = 'epoch'").fetchone()[0]
            if epoch != self._epoch:
                self._sync_maps(conn, epoch)
            return found

    def _moved(self, checks: Sequence[tuple[str, Location]]) -> set[str]:
        """Keys that no longer name the slot they were read from."""
        if not checks:
            return set()
        want = {key: (loc.slab, loc.slot, loc.gen) for key, loc in checks}
        same: set[str] = set()
        with self._lock:
            conn = self._db()
            for chunk in chunks(list(want)):
                for key, slab, slot, gen in conn.execute(
                    f"SELECT key, slab, slot, gen FROM keys WHERE key IN ({marks(len(chunk))})",
                    chunk,
                ):
                    if want.get(key) == (slab, slot, gen):  # (a damaged index may answer other keys)
                        same.add(key)
        return set(want) - same

    def _touch(self, keys: Iterable[str]) -> None:
        """Note reads for LRU; written back later in batches, never waiting for the index.
        Keys used together rank in the order given (``RANK_TICK`` apart, the first the most
        recent): the store evicts the last of them first.

        A read must not wait behind another process's write transaction just to record its
        recency: the write-back tries the index lock without waiting, and if it is taken the
        touches stay pending (at most ``TOUCH_PENDING_MAX``, oldest dropped: recency is lossy).
        """
        if self._readonly:
            return
        now = time.time()
        with self._lock:
            for i, key in enumerate(keys):
                at = now - i * RANK_TICK
                if self._touches.get(key, 0.0) < at:  # a key used twice keeps its most recent use
                    self._touches[key] = at
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
        damaged: set[int] = set()  # of those, slabs whose index rows point outside them
        stale: dict[str, int] = {}  # key -> generation, for rows that name nothing (damage)
        with self._guard("get"):
            for _ in range(READ_ATTEMPTS):
                found = self._locate([keys[i] for i in todo])
                copied: list[tuple[int, Location]] = []
                retry: list[int] = []
                for i in todo:
                    loc = found.get(keys[i])
                    if loc is None:
                        sizes[i] = None
                    elif not loc.sound:
                        stale[keys[i]] = loc.gen
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
                        if not _fits(loc.slot, loc.cls, loc.size, view.nbytes):
                            broken[loc.slab] = loc.nbytes  # a row that disagrees with its slab
                            damaged.add(loc.slab)
                            retry.append(i)
                            continue
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
                self._forget_slabs(broken, damaged)
            if stale and not self._readonly:
                self._drop_rows(stale)
            self._touch(keys[i] for i in range(len(keys)) if sizes[i] is not None)
        return sizes

    def _drop_rows(self, rows: dict[str, int]) -> None:
        """Drop key rows that name nothing (best effort; a row written again since stays):
        lookups stop finding those keys, and the next save writes them again."""
        with contextlib.suppress(sqlite3.Error, OSError, StoreError), self._write() as tx:
            for key, gen in rows.items():
                tx.remove_if(key, gen)

    def _forget_slabs(self, slabs: dict[int, int], damaged: Collection[int] = ()) -> None:
        """Drop slabs whose file is gone or cut short, or (``damaged``) whose index rows point
        outside them, with every key they hold (best effort): lookups stop finding those keys,
        and the next save writes them again."""
        with contextlib.suppress(sqlite3.Error, OSError), self._write() as tx:
            for slab_id in slabs:
                known = tx.conn.execute("SELECT nbytes FROM slabs WHERE id = ?", (slab_id,)).fetchone()
                if known is None or (slab_id not in damaged
                                     and self._maps.view(slab_id, int(known[0])) is not None):
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

    def get_taken(self, keys: Sequence[str], buffers: Sequence[memoryview], take: Take) -> list[int | None]:
        """``take`` reads each object straight from the slab it lives in (one pass: no copy
        before it); a read that raced with reuse of its slot calls it again (``_read``)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        dsts = [buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B") for buf in buffers]

        def moved(i: int, src: Bytes) -> None:
            take(i, src.data, dsts[i])

        return self._read(keys, lambda i: dsts[i].nbytes, moved)

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
            for chunk in chunks(list(dict.fromkeys(keys))):
                present.update(
                    r[0]
                    for r in conn.execute(
                        f"SELECT k.key FROM keys k {SLOT_JOIN} WHERE k.key IN ({marks(len(chunk))})"
                        f" AND {CONSISTENT}", chunk)
                )
        return [key in present for key in keys]

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        found = self.exists_many(keys)
        marks = touch if touch is not None else [True] * len(keys)
        with self._guard("exists"):
            self._touch(k for k, ok, t in zip(keys, found, marks, strict=True) if ok and t)
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
        return iter([(str(k), int(n)) for k, n in rows if _nameable(k)])

    @property
    def medium(self) -> Medium:
        return self._medium

    def stats(self) -> StoreStats:
        with self._guard("stats"), self._lock:
            conn = self._db()
            objects, nbytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM keys").fetchone()
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
            budget = int(meta.get("state_budget", 0))
            held = int(meta["state_bytes"]) if "state_bytes" in meta else state_bytes(conn)
        return StoreStats(int(objects), int(nbytes), int(meta["capacity"]), int(meta["evictions"]),
                          state_bytes=held, state_budget=budget or None,
                          namespace_budget=int(meta.get("ns_budget", 0)) or None)

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

    def put_filled(self, items: Sequence[tuple[str, int, Fill]]) -> list[bool]:
        """Each ``fill`` writes straight into the slot its object is claimed (one pass)."""
        self._writable()
        keys = [check_key(key) for key, _, _ in items]
        return self._put(keys, [[] for _ in items], [size for _, size, _ in items], if_absent=False,
                         fills=[fill for _, _, fill in items])

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self._writable()
        check_key(key)
        if self.exists_many([key])[0]:
            return False
        part = _u8(data)
        return self._put([key], [[part]], [part.nbytes], if_absent=True)[0]

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        self._writable()
        keys = [check_key(key) for key, _ in items]
        check_distinct(keys)
        parts = [_u8(data) for _, data in items]
        fresh = [i for i, found in enumerate(self.exists_many(keys)) if not found]
        out = [False] * len(keys)
        if fresh:  # one transaction for all; a key another writer stored meanwhile stays theirs
            done = self._put([keys[i] for i in fresh], [[parts[i]] for i in fresh],
                             [parts[i].nbytes for i in fresh], if_absent=True)
            for i, stored in zip(fresh, done, strict=True):
                out[i] = stored
        return out

    def _put(
        self, keys: list[str], parts: list[list[Bytes]], sizes: list[int], if_absent: bool,
        fills: list[Fill] | None = None,
    ) -> list[bool]:
        """Put, and on a full filesystem free one slab's space and try once more; a put that
        still finds no room is refused (False), never an error. With ``fills``, object i's
        bytes are what ``fills[i]`` writes (``parts`` unused)."""
        for attempt in range(2):
            done = self._put_once(keys, parts, sizes, if_absent, fills)
            if done is not None:
                return done
            with self._guard("free space"):
                if attempt or not self._release_space():
                    break
        return [False] * len(keys)

    def _put_once(
        self, keys: list[str], parts: list[list[Bytes]], sizes: list[int], if_absent: bool,
        fills: list[Fill] | None = None,
    ) -> list[bool] | None:
        """One try; None if the filesystem had no room for the index to grow."""
        ok = [False] * len(keys)
        claims: dict[int, Claim] = {}
        published = False
        try:
            with self._guard("put"):
                try:
                    with self._lock:
                        slab_size = self._slab_size()
                        classes = [_arena.size_class(n, slab_size) for n in sizes]
                        if any(classes):
                            self._claim(keys, classes, claims, if_absent)
                    lost = self._copy(parts, sizes, claims, fills)
                    inline = {i: _filled(fills[i], sizes[i]) if fills is not None
                              else b"".join(p.data for p in parts[i])
                              for i in range(len(keys)) if classes[i] == 0}
                    with self._write() as tx:
                        for i, key in enumerate(keys):
                            at = tx.now - i * RANK_TICK  # the first key given is the most recent
                            if classes[i] == 0:
                                ok[i] = tx.put_inline(key, inline[i], if_absent, at)
                            elif i in claims and i not in lost:
                                ok[i] = tx.publish(key, sizes[i], claims[i], if_absent, at)
                    published = True
                except (OSError, sqlite3.Error) as exc:
                    if is_full(exc):
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

    def _claim(self, keys: list[str], classes: list[int], claims: dict[int, Claim], if_absent: bool) -> None:
        """Claim slots; a slab file the store must grow by is made between transactions,
        never while holding the index lock (other writers would wait for megabytes of writes)."""
        owner = self._writer.get()
        spares: dict[int, list[Path]] = {}
        no_grow = False
        try:
            for _ in range(len(classes) + 2):
                wanted = 0
                with self._write() as tx:
                    tx.spares, tx.no_grow = spares, no_grow
                    for i, cls in enumerate(classes):
                        if cls == 0 or i in claims or (if_absent and tx.exists(keys[i])):
                            continue
                        claim = tx.claim(cls, owner, self._inflight, pool_of(keys[i]),
                                         namespace_of(keys[i]))
                        if claim is not None:
                            claims[i] = claim
                        elif tx.wanted:
                            wanted = tx.wanted
                            break
                if not wanted:
                    return
                try:
                    made = _arena.create_slab_file(self.path, wanted)  # owner-only
                    spares.setdefault(wanted, []).append(made)
                    if self._mode != 0o600:
                        os.chmod(made, self._mode)
                except OSError as exc:
                    if not is_full(exc):
                        raise
                    no_grow = True  # the filesystem is full: evict instead
        finally:
            for paths in spares.values():
                for path in paths:
                    _arena.remove_file(path)

    def _copy(self, parts: list[list[Bytes]], sizes: list[int], claims: dict[int, Claim],
              fills: list[Fill] | None = None) -> set[int]:
        """Fill claimed slots (no index lock held, so readers and other writers proceed);
        return the items whose slab file is gone or cut short (those slabs are forgotten)."""
        lost: dict[int, int] = {}
        damaged: set[int] = set()
        failed: set[int] = set()
        for i, claim in claims.items():
            with self._lock:
                view = self._maps.view(claim.slab, claim.nbytes)
            if view is None or not _fits(claim.slot, claim.cls, sizes[i], view.nbytes):
                lost[claim.slab] = claim.nbytes
                failed.add(i)
                if view is not None:  # a slot row outside its slab: the slab's rows are damaged
                    damaged.add(claim.slab)
                continue
            start = claim.slot * claim.cls
            dst = view[start : start + sizes[i]]
            if fills is not None:
                fills[i](dst.data)
                continue
            pos = 0
            for part in parts[i]:
                n = part.nbytes
                if n:
                    np.copyto(dst[pos : pos + n], part)
                    pos += n
        if lost:
            self._forget_slabs(lost, damaged)
        return failed

    def _abandon(self, claims: list[Claim]) -> None:
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
            self._writer.release()
            self._closed = True


# -- fork ------------------------------------------------------------------------------------
# Invariant: no thread of this process is inside a store call (its lock held, maybe inside
# SQLite) at the instant of a fork. Every call on the index holds ``_lock``, so the forking
# thread takes every open store's lock first (in one order, waiting at most FORK_WAIT_S
# each), and the child starts with fresh locks and opens its own connection (``_db``). A
# store whose lock could not be had is marked: the child gets a StoreError from it, not a
# lock that nobody will ever release.

_OPEN: weakref.WeakSet[LocalStore] = weakref.WeakSet()
_HELD: list[LocalStore] = []


def _before_fork() -> None:
    _HELD.clear()
    for store in sorted(list(_OPEN), key=id):
        if store._lock.acquire(timeout=FORK_WAIT_S):
            _HELD.append(store)


def _after_fork_in_parent() -> None:
    for store in _HELD:
        store._lock.release()
    _HELD.clear()


def _after_fork_in_child() -> None:
    held = {id(s) for s in _HELD}
    for store in list(_OPEN):
        store._lock = threading.RLock()
        store._torn_by_fork = id(store) not in held
    _HELD.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
