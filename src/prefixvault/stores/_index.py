"""The local store's index: its schema and one write transaction's view of it.

SQLite in WAL mode, the only source of truth. A key names (slab, slot, generation) or holds
a small object inline; a slot is free, being written (claimed by a writer) or live. A
``Transaction`` claims, publishes and releases slots, removes keys, and evicts by recency
(an object of the same size class, a whole slab of another class, or an inline object),
keeping the counters of the ``meta`` table. Recurrent states (keys of class ``s``) may have a
budget of their own: a state that would take the states past it evicts the least recently
used state, never a KV block, so states can never crowd out more than their budget. Every
namespace (a key's first segment) may have a bound of its own, the same for each: a namespace
that would pass it evicts its own least recently used objects, and while bounds are set no
put evicts another namespace's object, so one tenant filling the store cannot crowd out another.
Generations are never reused, so a reader can always tell whether a slot changed under it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from prefixvault.stores import _arena
from prefixvault.stores._writers import WRITERS_DIR, owner_alive
from prefixvault.stores.base import STATE_CLASS, key_class, namespace_of

INDEX_NAME = "index.db"
#: Rows the index's meta table must hold.
META_NAMES = ("schema", "capacity", "slab_size", "inline_bytes", "next_gen", "evictions", "epoch")
#: Optional meta rows (a store made before them lacks them): ``state_budget`` is the most
#: bytes states may take now (0 or absent: no budget of their own), resolved at every writer's
#: open from how it was given: ``state_share_ppm`` (a share of the capacity) or ``state_size``
#: (a size, held to the capacity); ``state_bytes`` what they take (counted afresh whenever a
#: writer opens the store, kept by every transaction after). ``ns_budget``, ``ns_share_ppm`` and
#: ``ns_size`` are the same for every namespace's bound (see ``NS_HELD``).
META_OPTIONAL = ("state_budget", "state_share_ppm", "state_size", "state_bytes",
                 "ns_budget", "ns_share_ppm", "ns_size")
SCHEMA_VERSION = 1
#: Filesystem space the store never fills with objects: room for the index and its log.
FS_RESERVE = 2 << 20
#: How long a process waits for the index's write lock before giving up.
BUSY_TIMEOUT_S = 30.0
#: SQLite bound-parameter batch size.
_CHUNK = 500

FREE, WRITING, LIVE = 0, 1, 2

SCHEMA = """
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
    data BLOB,
    pool INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS keys_lru ON keys (cls, last_used);
CREATE INDEX IF NOT EXISTS keys_slab ON keys (slab, last_used);
"""
#: Invariant: a key's row (``keys k``) agrees with what it names: a slab object's slot row is
#: live, of its generation and class (and an inline object holds its size in bytes). Every write
#: keeps it, but damage to the index may not: a row that breaks it names nothing (a miss), never
#: bytes, and the next read or ``LocalStore.heal`` drops it. ``CONSISTENT`` is the check on
#: ``keys k`` joined by ``SLOT_JOIN`` (one primary-key lookup per key); an inline row's length is
#: checked where it is read.
SLOT_JOIN = "LEFT JOIN slots t ON t.slab = k.slab AND t.slot = k.slot"
CONSISTENT = f"(k.slab IS NULL OR (t.gen = k.gen AND t.state = {LIVE} AND t.cls = k.cls))"
#: ``keys.pool``: 1 for a recurrent state (budgeted on its own), 0 for anything else.
STATES, OTHER = 1, 0
#: The space an object takes (of ``keys k``, its slab ``s``): its share of its slab (a slab
#: whose size class does not divide it wastes the rest, and that waste is the object's), or
#: its bytes when it lives inline.
_HELD = "CASE WHEN k.slab IS NULL THEN k.size ELSE s.nbytes / s.nslots END"
_HELD_FROM = "keys k LEFT JOIN slabs s ON s.id = k.slab"


def ns_of(column: str) -> str:
    """A key's namespace in SQL: the text before its first ``/`` ("" without one), as
    ``namespace_of``; written the same way everywhere, so SQLite uses ``keys_ns``."""
    return f"substr({column}, 1, instr({column}, '/') - 1)"


NS_OF_KEY = ns_of("key")
#: Namespaces' bounds (``ns_budget`` > 0 in meta). Invariant: while a bound is set, ``ns_held``
#: holds, for every namespace with keys, the space (``_HELD``) its keys take, and no namespace's
#: exceeds ``ns_budget`` after a transaction that put one of its keys; a put evicts only keys of
#: its own namespace (by recency, on ``keys_ns``), or a slab no other namespace has a key in,
#: else it is refused. The rows are counted afresh whenever a writer opens the store with a
#: bound (an index made before bounds, or rows added by a writer of an earlier version, get
#: them there) and kept by every transaction after; without a bound they are neither read
#: nor kept. Nothing of it is needed to read: a store made before, or a read-only open, works.
NS_HELD = f"""
CREATE TABLE IF NOT EXISTS ns_held (ns TEXT PRIMARY KEY, bytes INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS keys_ns ON keys ({NS_OF_KEY}, last_used);
"""


def count_namespaces(conn: sqlite3.Connection) -> None:
    """Count every namespace's space afresh into ``ns_held`` (inside the caller's
    transaction; the table and index made first)."""
    for statement in NS_HELD.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("DELETE FROM ns_held")
    conn.execute(f"INSERT INTO ns_held (ns, bytes) SELECT {NS_OF_KEY}, COALESCE(SUM({_HELD}), 0)"
                 f" FROM {_HELD_FROM} GROUP BY 1")


def pool_of(key: str) -> int:
    return STATES if key_class(key) == STATE_CLASS else OTHER


def add_pools(conn: sqlite3.Connection) -> None:
    """Give every state key its ``pool`` (inside the caller's transaction, at a writer's
    open): the column on an index made before state budgets, and the mark on states that a
    writer of such a version added since. Costs one pass over the keys."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}
    if "pool" not in columns:
        conn.execute("ALTER TABLE keys ADD COLUMN pool INTEGER NOT NULL DEFAULT 0")
    # GLOB narrows to keys with an ``s`` segment past the second (SQLite, fast); ``pool_of``
    # decides. Every other key is a KV block or record and is never looked at in Python.
    marked = [(k,) for (k,) in conn.execute("SELECT key FROM keys WHERE pool = ? AND key GLOB '*/*/s/*'",
                                            (OTHER,)) if pool_of(k) == STATES]
    conn.executemany("UPDATE keys SET pool = 1 WHERE key = ?", marked)
    conn.execute("CREATE INDEX IF NOT EXISTS keys_pool ON keys (pool, last_used)")


def state_bytes(conn: sqlite3.Connection) -> int:
    """Space the states take now, counted from their keys (an index without ``pool`` key by
    key: a read-only open of a store made before budgets)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}
    if "pool" in columns:
        row = conn.execute(f"SELECT COALESCE(SUM({_HELD}), 0) FROM {_HELD_FROM} WHERE k.pool = ?",
                           (STATES,)).fetchone()
        return int(row[0])
    return sum(int(held) for key, held in conn.execute(f"SELECT k.key, {_HELD} FROM {_HELD_FROM}")
               if pool_of(key) == STATES)



class Location(NamedTuple):
    size: int
    slab: int | None
    slot: int | None
    gen: int
    cls: int
    data: bytes | None
    nbytes: int | None
    sound: bool  # the row keeps ``CONSISTENT`` (and its slab is in the slab table)


class Claim(NamedTuple):
    slab: int
    slot: int
    gen: int
    cls: int
    nbytes: int  # of the slab


def chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def marks(n: int) -> str:
    return ",".join("?" * n)


def is_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", 0) == sqlite3.SQLITE_FULL


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the index at ``path``, set up as every process of the store needs it."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    # A key the store wrote is ASCII; damage can leave bytes that are not UTF-8. Such a row must
    # read as a key no caller can name (dropped by ``LocalStore.heal``), not fail every query.
    conn.text_factory = _lenient_text
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    # Keep the write-ahead log small: it lives on the same (maybe small) filesystem.
    conn.execute("PRAGMA wal_autocheckpoint = 256")
    conn.execute(f"PRAGMA journal_size_limit = {FS_RESERVE // 2}")
    return conn


class Transaction:
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
        self.state_budget = int(meta.get("state_budget", 0))
        self._states: int | None = int(meta["state_bytes"]) if "state_bytes" in meta else None
        self._batch: set[str] = set()  # states put in this transaction: never evicted for each other
        self.ns_budget = int(meta.get("ns_budget", 0))
        self._ns: dict[str, int] = {}  # namespace -> space held (``ns_held``, as kept here)
        self._fresh: set[str] = set()  # keys put in this transaction: never evicted for each other
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
        # Slab files are made outside any transaction (writing megabytes while holding the
        # index lock would stall every other writer): ``spares`` are files made for this one,
        # ``wanted`` the size of the file a claim asked for and did not find.
        self.spares: dict[int, list[Path]] = {}
        self.wanted = 0

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
        if self._states is not None:
            self.conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('state_bytes', ?)",
                              (self._states,))
        if self.ns_budget and self._ns:
            self.conn.executemany("INSERT OR REPLACE INTO ns_held (ns, bytes) VALUES (?, ?)",
                                  list(self._ns.items()))

    def recount_states(self) -> None:
        """Count the states' space (and, with bounds, the namespaces') afresh from their keys
        (after rows were dropped by hand)."""
        self._states = state_bytes(self.conn)
        if self.ns_budget:
            count_namespaces(self.conn)
            self._ns.clear()

    def gen(self) -> int:
        self.next_gen += 1
        return self.next_gen

    # -- the states' budget ----------------------------------------------------------

    @property
    def states_held(self) -> int:
        if self._states is None:
            self._states = state_bytes(self.conn)
        return self._states

    def _held(self, pool: int, nbytes: int) -> None:
        """A state taking ``nbytes`` came (positive) or went (negative)."""
        if pool == STATES and self._states is not None:
            self._states += nbytes

    def slot_share(self, slab_id: int) -> int:
        """The space one slot of a slab takes (``_HELD``; 0 for a slab the index lost)."""
        row = self.conn.execute("SELECT nbytes / nslots FROM slabs WHERE id = ?", (slab_id,)).fetchone()
        return 0 if row is None or row[0] is None else int(row[0])

    def new_slot_share(self, cls: int) -> int:
        """The space a slot of class ``cls`` takes in a slab made now."""
        return _arena.slab_bytes(cls, self.slab_size) // _arena.slots_per_slab(cls, self.slab_size)

    def fit_state(self, nbytes: int, ns: str | None = None) -> bool:
        """Evict the least recently used states until one taking ``nbytes`` fits their
        budget; False if it cannot: it alone is larger, or only states put earlier in this
        transaction (its own batch, which ranks them more recent) would have to go. Without a
        budget, always True. With namespaces' bounds only states of ``ns`` go."""
        if not self.state_budget:
            return True
        if nbytes > self.state_budget:
            return False
        keep = sorted(self._batch)
        scope, where = ((ns,), f" AND {NS_OF_KEY} = ?") if self.scoped and ns is not None else ((), "")
        while self.states_held + nbytes > self.state_budget:
            row = self.conn.execute(
                f"SELECT key FROM keys WHERE pool = ? AND key NOT IN ({marks(len(keep))}){where}"
                " ORDER BY last_used, gen LIMIT 1", (STATES, *keep, *scope)
            ).fetchone()
            if row is None:  # only this batch's states are left (or the count is off: recount)
                self._states = None
                return self.states_held + nbytes <= self.state_budget
            self.remove(row[0])
            self.evictions += 1
        return True

    # -- namespaces' bounds ----------------------------------------------------------

    @property
    def scoped(self) -> bool:
        """Whether a put may evict only its own namespace's objects (bounds are set)."""
        return self.ns_budget > 0

    def ns_held(self, ns: str) -> int:
        if ns not in self._ns:
            row = self.conn.execute("SELECT bytes FROM ns_held WHERE ns = ?", (ns,)).fetchone()
            self._ns[ns] = 0 if row is None else int(row[0])
        return self._ns[ns]

    def _ns_moved(self, key: str, nbytes: int) -> None:
        """A key taking ``nbytes`` came (positive) or went (negative)."""
        if self.ns_budget:
            ns = namespace_of(key)
            self._ns[ns] = self.ns_held(ns) + nbytes

    def _recount_ns(self, ns: str) -> int:
        row = self.conn.execute(f"SELECT COALESCE(SUM({_HELD}), 0) FROM {_HELD_FROM} WHERE {NS_OF_KEY} = ?",
                                (ns,)).fetchone()
        self._ns[ns] = int(row[0])
        return self._ns[ns]

    def fit_namespace(self, ns: str, nbytes: int) -> bool:
        """Evict the namespace's own least recently used objects until ``nbytes`` more fit its
        bound; False if it cannot (larger than the bound, or only objects put earlier in this
        transaction would have to go). Without bounds, always True."""
        if not self.ns_budget:
            return True
        if nbytes > self.ns_budget:
            return False
        while self.ns_held(ns) + nbytes > self.ns_budget:
            mine = sum(1 for k in self._fresh if namespace_of(k) == ns)
            rows = self.conn.execute(f"SELECT key FROM keys WHERE {NS_OF_KEY} = ? ORDER BY last_used, gen"
                                     " LIMIT ?", (ns, mine + 1)).fetchall()
            victim = next((k for (k,) in rows if k not in self._fresh), None)
            if victim is None:  # only this batch's objects are left (or the count is off: recount)
                return self._recount_ns(ns) + nbytes <= self.ns_budget
            self.remove(victim)
            self.evictions += 1
        return True

    def fit_namespaces(self) -> None:
        """Bring every namespace within a bound made smaller (at a writer's open)."""
        if self.ns_budget:
            for (ns,) in self.conn.execute("SELECT ns FROM ns_held WHERE bytes > ?",
                                           (self.ns_budget,)).fetchall():
                self.fit_namespace(ns, 0)

    # -- recency ---------------------------------------------------------------------

    def touch(self, touches: Iterable[tuple[str, float]]) -> None:
        self.conn.executemany("UPDATE keys SET last_used = ?2 WHERE key = ?1 AND last_used < ?2", touches)

    # -- keys ------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether ``key`` names an object (a row that breaks ``CONSISTENT`` names none)."""
        return self.conn.execute(f"SELECT 1 FROM keys k {SLOT_JOIN} WHERE k.key = ? AND {CONSISTENT}",
                                 (key,)).fetchone() is not None

    def remove_if(self, key: str, gen: int) -> bool:
        """``remove`` the key only if its row is still the one of generation ``gen``."""
        row = self.conn.execute("SELECT gen FROM keys WHERE key = ?", (key,)).fetchone()
        return row is not None and int(row[0]) == gen and self.remove(key)

    def remove(self, key: str) -> bool:
        """Delete a key and release what it held."""
        row = self.conn.execute(
            f"SELECT k.size, k.slab, k.slot, k.gen, k.pool, {_HELD} FROM {_HELD_FROM} WHERE k.key = ?",
            (key,)).fetchone()
        if row is None:
            return False
        size, slab, slot, gen, pool, held = row
        self._held(pool, -int(held or 0))  # NULL (a slab the index lost) counts 0, as in the recount
        self._ns_moved(key, -int(held or 0))
        self._batch.discard(key)
        self._fresh.discard(key)
        self.conn.execute("DELETE FROM keys WHERE key = ?", (key,))
        if slab is None:
            self.inline_bytes -= size
        else:
            self.conn.execute(
                "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ?",
                (FREE, slab, slot, gen),
            )
        return True

    def put_inline(self, key: str, data: bytes, if_absent: bool = False, at: float | None = None) -> bool:
        """Store a small object in the index; a replace that cannot fit keeps the old value."""
        if if_absent and self.exists(key):
            return False
        pool = pool_of(key)
        ns = namespace_of(key)
        when = self.now if at is None else at
        if pool == STATES:  # room among the states first: a state never evicts anything else
            self.remove(key)
            if not self.fit_state(len(data), ns):
                return False
        if self.scoped:  # then within its namespace's bound (a value larger than it keeps the old)
            if len(data) > self.ns_budget:
                return False
            self.remove(key)
            if not self.fit_namespace(ns, len(data)):
                return False
        scope = ns if self.scoped else None
        old = self.conn.execute("SELECT size FROM keys WHERE key = ? AND slab IS NULL", (key,)).fetchone()
        if len(data) > self.capacity or not self.make_room(len(data) - (int(old[0]) if old else 0), scope):
            return False
        self.remove(key)
        if not self.make_room(len(data), scope):  # only if the old value was itself evicted just now
            return False
        self.conn.execute(
            "INSERT INTO keys (key, size, cls, slab, slot, gen, last_used, data, pool)"
            " VALUES (?, ?, 0, NULL, NULL, ?, ?, ?, ?)",
            (key, len(data), self.gen(), when, data, pool),
        )
        self.inline_bytes += len(data)
        self._held(pool, len(data))
        self._ns_moved(key, len(data))
        if pool == STATES:
            self._batch.add(key)
        if self.scoped:
            self._fresh.add(key)
        return True

    def publish(self, key: str, size: int, claim: Claim, if_absent: bool = False,
                at: float | None = None) -> bool:
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
        pool = pool_of(key)
        ns = namespace_of(key)
        when = self.now if at is None else at
        share = self.slot_share(claim.slab) if pool == STATES or self.scoped else 0
        # Other writers' states may have come since the claim, or this batch's own earlier
        # (more recent) states: never evict those for this one. The same within a namespace.
        if (pool == STATES and not self.fit_state(share, ns)) or not self.fit_namespace(ns, share):
            self.release([claim])
            return False
        self.conn.execute(
            "INSERT INTO keys (key, size, cls, slab, slot, gen, last_used, data, pool)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
            (key, size, claim.cls, claim.slab, claim.slot, claim.gen, when, pool),
        )
        self._held(pool, share)
        self._ns_moved(key, share)
        if pool == STATES:
            self._batch.add(key)
        if self.scoped:
            self._fresh.add(key)
        self.conn.execute(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ?",
            (LIVE, claim.slab, claim.slot),
        )
        return True

    def release(self, claims: Iterable[Claim]) -> None:
        self.conn.executemany(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ? AND state = ?",
            [(FREE, c.slab, c.slot, c.gen, WRITING) for c in claims],
        )

    # -- slots -----------------------------------------------------------------------

    def claim(self, cls: int, owner: str, inflight: set[int], pool: int = OTHER,
              ns: str = "") -> Claim | None:
        """A slot of class ``cls`` for this writer, evicting if needed; None if no room, or
        if the store should grow and no spare slab file is at hand (then ``wanted`` says
        which size to make, outside the transaction, before asking again). A state first
        makes room within the states' budget (its slot may then be one a state just left),
        and an object of a bounded namespace ``ns`` within its bound; with bounds set, only
        ``ns``'s objects are evicted for it."""
        self.wanted = 0
        # The share a new slab's slot takes: a state that cannot fit that way evicts nothing.
        if pool == STATES and not self.fit_state(self.new_slot_share(cls), ns):
            return None
        if not self.fit_namespace(ns, self.new_slot_share(cls)):
            return None
        scope = ns if self.scoped else None
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
                if found is None:
                    self.wanted = need
                    return None
                continue
            # Evict whichever is least recently used: an object of this class (its slot),
            # a whole slab of another class, or a small inline object (room to grow).
            key = self._oldest_key(cls, scope)
            slab = self._oldest_slab(cls, scope)
            inline = None if self.no_grow else self._oldest_inline(scope)
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
        return Claim(found[0], found[1], gen, cls, self._slab_nbytes(found[0]))

    def _free_slot(self, cls: int) -> tuple[int, int] | None:
        row = self.conn.execute(
            "SELECT slab, slot FROM slots WHERE cls = ? AND state = ? LIMIT 1", (cls, FREE)
        ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def _slab_nbytes(self, slab_id: int) -> int:
        row = self.conn.execute("SELECT nbytes FROM slabs WHERE id = ?", (slab_id,)).fetchone()
        return int(row[0])

    def _grow(self, cls: int, nbytes: int) -> tuple[int, int] | None:
        """Add a slab made beforehand (a spare of this size); None if there is none."""
        spares = self.spares.get(nbytes)
        if not spares:
            return None
        tmp = spares.pop()
        nslots = _arena.slots_per_slab(cls, self.slab_size)
        try:
            slab_id = self.conn.execute(
                "INSERT INTO slabs (cls, nslots, nbytes) VALUES (?, ?, ?)", (cls, nslots, nbytes)
            ).lastrowid
            assert slab_id is not None
            final = _arena.slab_path(self.root, slab_id)
            try:
                os.rename(tmp, final)
            except (IsADirectoryError, NotADirectoryError):
                # Damage at a slab path the index has never named (ids are never reused):
                # nothing of the store's is there, so it goes.
                _arena.remove_file(final)
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

    def _oldest_key(self, cls: int, ns: str | None = None) -> tuple[str, int, int, float] | None:
        """The least recently used object of class ``cls`` (of namespace ``ns``, if given)."""
        if ns is None:
            row = self.conn.execute(
                "SELECT key, slab, slot, last_used FROM keys WHERE cls = ? ORDER BY last_used, gen LIMIT 1",
                (cls,),
            ).fetchone()
        else:
            row = self.conn.execute(
                f"SELECT key, slab, slot, last_used FROM keys WHERE {NS_OF_KEY} = ? AND cls = ?"
                " ORDER BY last_used, gen LIMIT 1", (ns, cls),
            ).fetchone()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _oldest_slab(self, exclude_cls: int, ns: str | None = None) -> tuple[int, int, int, float] | None:
        """The slab whose newest object is oldest, among slabs no writer is filling (and, with
        ``ns``, that hold no other namespace's object)."""
        foreign = (f" AND NOT EXISTS (SELECT 1 FROM keys o WHERE o.slab = s.id"
                   f" AND {ns_of('o.key')} != ?)") if ns is not None else ""
        row = self.conn.execute(
            "SELECT s.id, s.cls, s.nbytes,"
            " COALESCE((SELECT MAX(k.last_used) FROM keys k WHERE k.slab = s.id), -1.0) AS lu"
            " FROM slabs s WHERE s.cls != ?"
            f" AND NOT EXISTS (SELECT 1 FROM slots t WHERE t.slab = s.id AND t.state = ?){foreign}"
            " ORDER BY lu, s.id LIMIT 1",
            (exclude_cls, WRITING, *(() if ns is None else (ns,))),
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _oldest_inline(self, ns: str | None = None) -> tuple[str, float] | None:
        where, args = ("", ()) if ns is None else (f" AND {NS_OF_KEY} = ?", (ns,))
        row = self.conn.execute(
            f"SELECT key, last_used FROM keys WHERE cls = 0{where} ORDER BY last_used, gen LIMIT 1", args
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def _evict_key(self, key: str, slab: int, slot: int) -> None:
        row = self.conn.execute("SELECT pool FROM keys WHERE key = ?", (key,)).fetchone()
        if row is not None and row[0] == STATES:
            self._held(STATES, -self.slot_share(slab))
        if row is not None:
            self._ns_moved(key, -self.slot_share(slab))
        self.conn.execute("DELETE FROM keys WHERE key = ?", (key,))
        self.conn.execute(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ?",
            (FREE, slab, slot),
        )
        self.evictions += 1

    def _states_in(self, slab_id: int) -> None:
        """The objects of a slab are about to go: their space leaves the states' count and
        their namespaces'."""
        row = self.conn.execute(
            "SELECT COUNT(*) FROM keys WHERE slab = ? AND pool = ?", (slab_id, STATES)).fetchone()
        if row[0]:
            self._held(STATES, -int(row[0]) * self.slot_share(slab_id))
        if self.ns_budget:
            share = self.slot_share(slab_id)
            rows = self.conn.execute(f"SELECT {NS_OF_KEY}, COUNT(*) FROM keys WHERE slab = ? GROUP BY 1",
                                     (slab_id,)).fetchall()
            for ns, n in rows:
                self._ns[ns] = self.ns_held(ns) - int(n) * share

    def _empty_slab(self, slab_id: int) -> None:
        self._states_in(slab_id)
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
        self._states_in(slab_id)
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

    def make_room(self, nbytes: int, ns: str | None = None) -> bool:
        """Evict until ``nbytes`` more fit: the older of the oldest inline object and slab
        (with ``ns``, only that namespace's objects and slabs no other namespace uses)."""
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            inline = self._oldest_inline(ns)
            slab = self._oldest_slab(0, ns)
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
                    alive[who] = bool(who) and owner_alive(writers, who)
                dead = not alive[who]
            if dead:
                lost.append((slab, slot, gen))
        self.conn.executemany(
            "UPDATE slots SET state = ?, owner = NULL WHERE slab = ? AND slot = ? AND gen = ?",
            [(FREE, *row) for row in lost],
        )
        return len(lost)
