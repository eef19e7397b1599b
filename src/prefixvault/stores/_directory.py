"""A local store's directory: made ready, its index created or checked, started afresh.

A store directory holds only what the store made (its index, slab files, writer files), so a
foreign directory is never taken over. An index that cannot be read as one (not a database,
another schema, rows missing) is *damaged*: engines serve cold meanwhile (it reads as an
unavailable store) and ``prefixvault audit --repair`` sets it aside and starts afresh; a
cache loses nothing it cannot recompute.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from prefixvault.stores import _arena
from prefixvault.stores._index import (
    INDEX_NAME,
    META_NAMES,
    SCHEMA,
    SCHEMA_VERSION,
    add_pools,
    count_namespaces,
    state_bytes,
)
from prefixvault.stores._writers import WRITERS_DIR
from prefixvault.stores.base import StoreError, StoreUnavailable

log = logging.getLogger("prefixvault.stores.local")

#: Share of the filesystem's free space a new store takes when no capacity is given.
DEFAULT_CAPACITY_SHARE = 0.25


class StoreDamaged(StoreUnavailable):
    """The index cannot be read as a store index: engines serve cold (it is unavailable, as
    a store that is down), and ``prefixvault audit --repair`` rebuilds it."""


def damaged(path: Path, why: str) -> StoreDamaged:
    return StoreDamaged(
        f"local store {path}: its index is damaged ({why}); rebuild it with `prefixvault "
        f"audit --repair --store local://{path}` (the cached objects are dropped)"
    )


def check_meta(path: Path, meta: dict[str, int]) -> None:
    """StoreDamaged unless ``meta`` is a whole meta table of this schema."""
    if meta.get("schema") != SCHEMA_VERSION:
        raise damaged(path, f"schema {meta.get('schema')}, this version reads {SCHEMA_VERSION}")
    missing = sorted(set(META_NAMES) - set(meta))
    if missing:
        raise damaged(path, f"no {', '.join(missing)} in its meta table")


@dataclass(frozen=True)
class StateBudget:
    """The most bytes recurrent states (``states=``), or each namespace (``namespace_share=``),
    may take: a size, or a share of the capacity."""

    nbytes: int | None = None
    share: float | None = None

    def resolve(self, capacity: int) -> int:
        return self.nbytes if self.nbytes is not None else int(capacity * (self.share or 0.0))


#: The budgets an index keeps: meta rows ``{kind}_share_ppm`` or ``{kind}_size`` (as given) and
#: ``{kind}_budget`` (resolved), and the URI parameter that sets each.
BUDGETS = {"state": "states", "ns": "namespace_share"}


def apply_budget(conn: sqlite3.Connection, path: Path, given: StateBudget | None, kind: str = "state") -> int:
    """Set a budget (``kind``: ``state`` or ``ns``) as given (None: keep the one there) and
    resolve it against the capacity as it is now: a share of it, or a size held to it; return
    it (0: none). A size larger than the capacity is an error when given; a capacity that
    shrinks under it later holds it only while it is smaller."""
    if given is not None:
        capacity = int(conn.execute("SELECT value FROM meta WHERE name = 'capacity'").fetchone()[0])
        if given.resolve(capacity) > capacity:
            raise StoreError(f"local store {path}: {BUDGETS[kind]}={given.resolve(capacity)} bytes is more "
                             f"than its capacity ({capacity} bytes)")
        conn.execute(f"DELETE FROM meta WHERE name IN ('{kind}_share_ppm', '{kind}_size')")
        if given.share is not None:
            conn.execute("INSERT INTO meta (name, value) VALUES (?, ?)",
                         (f"{kind}_share_ppm", round(given.share * 1e6)))
        else:
            conn.execute("INSERT INTO meta (name, value) VALUES (?, ?)", (f"{kind}_size", given.nbytes or 0))
    kept = kept_budget(conn, kind)
    capacity = int(conn.execute("SELECT value FROM meta WHERE name = 'capacity'").fetchone()[0])
    budget = 0 if kept is None else min(kept.resolve(capacity), capacity)
    conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", (f"{kind}_budget", budget))
    return budget


def kept_budget(conn: sqlite3.Connection, kind: str = "state") -> StateBudget | None:
    """The budget (``kind``: ``state`` or ``ns``) an index holds, as it was given; None if none."""
    meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    if f"{kind}_share_ppm" in meta:
        return StateBudget(share=int(meta[f"{kind}_share_ppm"]) / 1e6)
    if int(meta.get(f"{kind}_size", 0) or 0):
        return StateBudget(nbytes=int(meta[f"{kind}_size"]))
    return None


def create_or_check(conn: sqlite3.Connection, path: Path, capacity: int | None,
                    states: StateBudget | None = None, namespaces: StateBudget | None = None) -> None:
    """Create the index's tables and meta rows, or check those there; apply a new capacity,
    states' budget and namespaces' bound (None: keep the one there)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        add_pools(conn)
        meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        if not meta:
            if capacity is None:
                capacity = _default_capacity(path)
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
            check_meta(path, meta)
            if capacity is None and int(meta["capacity"]) <= 0:
                # Damage (no store is made that way): a store that keeps nothing, forever and
                # silently, is worse than one that takes its default share again.
                capacity = _default_capacity(path)
                log.warning("local store %s: its stored capacity was %s; it is %d bytes again (a "
                            "quarter of the free space; give ?capacity= to choose)", path,
                            meta["capacity"], capacity)
            elif not _arena.SLAB_MIN <= int(meta["slab_size"]) <= _arena.SLAB_MAX:
                conn.execute("UPDATE meta SET value = ? WHERE name = 'slab_size'",
                             (_arena.slab_size_for(int(meta["capacity"])),))
        if meta and capacity is not None and capacity != meta["capacity"]:
            # New slabs follow the new capacity; existing ones keep their size.
            conn.executemany(
                "UPDATE meta SET value = ? WHERE name = ?",
                [(capacity, "capacity"), (_arena.slab_size_for(capacity), "slab_size")],
            )
        kept = int(conn.execute("SELECT value FROM meta WHERE name = 'capacity'").fetchone()[0])
        if kept < _arena.SLAB_MIN:
            log.warning("local store %s: its capacity is %d bytes: it keeps no object larger than that",
                        path, kept)
        apply_budget(conn, path, states, "state")
        held = state_bytes(conn)  # counted afresh at every writer's open
        conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('state_bytes', ?)", (held,))
        if apply_budget(conn, path, namespaces, "ns"):
            count_namespaces(conn)  # so are the namespaces', while they are bounded
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _default_capacity(path: Path) -> int:
    return max(int(shutil.disk_usage(path).free * DEFAULT_CAPACITY_SHARE), _arena.SLAB_MIN)


def _check_private(path: Path) -> None:
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise StoreError(f"local store directory {path} belongs to another user (uid {st.st_uid}): use a "
                         "directory of your own, or ?shared=1 for a store shared by one group")
    if st.st_mode & 0o022:
        raise StoreError(f"local store directory {path} is writable by others "
                         f"({oct(st.st_mode & 0o777)}): chmod 700 it, or use ?shared=1")
    if st.st_mode & 0o077:  # ours, but readable by others (made by an older version): tighten
        os.chmod(path, 0o700)
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == st.st_uid:
                os.chmod(entry.path, 0o600)


#: The index and the files SQLite keeps beside it: each one's mode is the store's file mode.
INDEX_FILES = (INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", f"{INDEX_NAME}.lock")


def own_index_files(root: Path, mode: int) -> None:
    """Give the index and its log files the store's mode (0600, or 0660 shared) whatever
    the umask: the index is made here first with that mode, as SQLite gives its WAL and
    shared-memory files the mode of the database they belong to; files of ours made
    before (by an older version, under another umask) are set to it. Files of another owner
    are left as they are."""
    index = root / INDEX_NAME
    # Only a file that does not exist yet is opened here: closing any descriptor of a database
    # file drops every POSIX lock this process holds on it, so opening and closing the index
    # while a connection of this process has it open (an engine's scheduler and worker each
    # open the store) would strip that connection's locks, and other processes would then
    # recover the database under it (a reader that no longer sees new rows; "disk I/O error").
    try:
        fd = os.open(index, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    except FileExistsError:
        pass
    else:
        os.close(fd)
    for name in INDEX_FILES:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(root / name)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
                os.chmod(root / name, mode)


def check_index_files(root: Path) -> None:
    """StoreDamaged if the index, its log or its shared-memory file is there as anything but a
    regular file (a directory, a link): SQLite cannot open it as the store's, and what it held
    cannot be trusted. A lock file that is not one is replaced (it holds nothing)."""
    for name in INDEX_FILES:
        where = root / name
        try:
            mode = os.lstat(where).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode):
            continue
        what = "a directory" if stat.S_ISDIR(mode) else "a link" if stat.S_ISLNK(mode) else "not a file"
        if name.endswith(".lock"):
            _arena.remove_file(where)
            continue
        raise damaged(root, f"{name} is {what}")


def set_aside(root: Path) -> tuple[Path, int, int | None, StateBudget | None, StateBudget | None]:
    """Move a damaged index aside and remove the slab files it named: (where the index went,
    slab files removed, the old capacity, states' budget and namespaces' bound where they
    could still be read)."""
    capacity: int | None = None
    states: StateBudget | None = None
    namespaces: StateBudget | None = None
    index_is_file = os.path.isfile(root / INDEX_NAME) and not os.path.islink(root / INDEX_NAME)
    with contextlib.suppress(sqlite3.Error, TypeError, ValueError, KeyError):
        if not index_is_file:
            raise KeyError(INDEX_NAME)  # nothing of ours to read the old settings from
        conn = sqlite3.connect(root / INDEX_NAME)
        try:
            row = conn.execute("SELECT value FROM meta WHERE name = 'capacity'").fetchone()
            capacity = int(row[0]) if row else None
            states = kept_budget(conn, "state")
            namespaces = kept_budget(conn, "ns")
        finally:
            conn.close()
    aside = root / f"{INDEX_NAME}.damaged-{int(time.time())}"
    for suffix in ("", "-wal", "-shm"):
        src = root / f"{INDEX_NAME}{suffix}"
        if os.path.lexists(src):  # a link or a directory moves aside as it is
            os.replace(src, Path(f"{aside}{suffix}"))
    lock = root / f"{INDEX_NAME}.lock"
    if os.path.lexists(lock) and not (os.path.isfile(lock) and not os.path.islink(lock)):
        _arena.remove_file(lock)
    removed = 0
    for entry in os.scandir(root):
        if entry.name.startswith("slab-"):
            _arena.remove_file(Path(entry.path))
            removed += 1
    return aside, removed, capacity, states, namespaces


def prepare(path: Path, shared: bool = False) -> None:
    """Create the store directory, or say in one line why it cannot be one.

    A private store (the default) lives in a directory of its own user that nobody else can
    write (a directory someone else controls could hold planted objects or be swapped); its
    files are owner-only, and a directory of ours that others could read is tightened.
    ``shared`` lets users of one group share it (group read/write)."""
    try:
        _prepare(path, shared)
    except OSError as exc:  # a name too long, a parent that is a file, no permission, ...
        shown = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
        # A full filesystem is a state that passes: a store that is down, not a wrong config.
        error = StoreUnavailable if exc.errno in (errno.ENOSPC, errno.EDQUOT) else StoreError
        raise error(f"cannot use local store directory {shown!r}: {exc.strerror or exc}") from None


def _prepare(path: Path, shared: bool) -> None:
    if path.exists() and not path.is_dir():
        raise StoreError(f"local store path {path} exists and is not a directory")
    try:
        path.mkdir(mode=0o770 if shared else 0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create local store directory {path}: {exc.strerror or exc}") from None
    if shared and os.stat(path).st_uid == os.geteuid():
        # The umask took group bits from mkdir's mode: a shared store's directory is 0770.
        os.chmod(path, (os.stat(path).st_mode & 0o7000) | 0o770)
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"local store directory {path} is not writable")
    if not shared:
        _check_private(path)
    if not (path / INDEX_NAME).exists():
        foreign = [
            name for name in os.listdir(path) if not name.startswith(("slab-", WRITERS_DIR, INDEX_NAME))
        ]
        if foreign:
            raise StoreError(
                f"local store directory {path} is not empty and holds no {INDEX_NAME};"
                " use an empty or new directory"
            )
