"""The byte side of the local store: slab files, size classes and per-process mappings.

Copying bytes is only as fast as memcpy when the pages are already resident and already in
this process's page tables. A file per object pays page allocation on write and page-table
population on every read, which costs as much as the copy itself. So objects live in slots
of a few large slab files, written in full once when created (pages allocated, never a
SIGBUS or ENOSPC later) and mapped once per process with MAP_POPULATE, then reused.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

Bytes: TypeAlias = npt.NDArray[np.uint8]

#: Objects up to this size live inline in the index, not in a slab.
INLINE_MAX = 64 << 10
#: Slots are page aligned.
PAGE = 4096
#: Slab size bounds; the size of one store's slabs follows from its capacity.
SLAB_MIN = 256 << 10
SLAB_MAX = 64 << 20
#: Size classes per doubling: an object wastes at most 1/8 of its slot.
STEPS_PER_DOUBLING = 8

#: A temporary slab file this old belongs to a writer that died while making it.
STRAY_TMP_AGE_S = 600.0

_PREFIX = "slab-"
_SUFFIX = ".bin"
_TMP_SUFFIX = ".tmp"
_ZEROS = bytes(8 << 20)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def slab_size_for(capacity: int) -> int:
    """A 64th of the capacity as a power of two, within [SLAB_MIN, SLAB_MAX].

    Every size class in use holds at least one slab, so slabs must be small enough that a
    store holding objects of many sizes still has room to spare, and large enough that
    mapping and index costs are amortised over many objects.
    """
    target = max(capacity // 64, 1)
    return max(SLAB_MIN, min(SLAB_MAX, 1 << (target.bit_length() - 1)))


def size_class(size: int, slab_size: int) -> int:
    """Slot size for an object: 0 means inline; above ``slab_size`` a dedicated slab.

    Classes grow geometrically so a store holding objects of many sizes needs few classes,
    while objects of one size (the common case: one model layout) waste at most 12.5%.
    """
    if size <= INLINE_MAX:
        return 0
    exp = (size - 1).bit_length() - 1  # 2**exp < size <= 2**(exp + 1)
    cls = _round_up(_round_up(size, 1 << max(exp - 3, 0)), PAGE)
    if cls > slab_size:
        return _round_up(size, PAGE)
    return cls


def slab_bytes(cls: int, slab_size: int) -> int:
    """File size of a slab holding class ``cls``."""
    return cls if cls > slab_size else slab_size


def slots_per_slab(cls: int, slab_size: int) -> int:
    return max(1, slab_size // cls)


def slab_path(root: Path, slab_id: int) -> Path:
    return root / f"{_PREFIX}{slab_id:010d}{_SUFFIX}"


def create_slab_file(root: Path, nbytes: int) -> Path:
    """Write a zero-filled temporary slab file in full; the caller renames it into place.

    Raises OSError (ENOSPC when the filesystem is full); leaves nothing behind on error.
    """
    tmp = root / f"{_PREFIX}{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}{_TMP_SUFFIX}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(_ZEROS)
        left = nbytes
        while left:
            left -= os.write(fd, view[: min(left, len(_ZEROS))])
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def remove_file(path: Path) -> None:
    """Remove whatever is at ``path``: a file, a link (not what it points to), or a directory
    that damage put where the store keeps a file of its own (a store directory holds only
    what the store made, so nothing else is lost)."""
    with contextlib.suppress(FileNotFoundError):
        try:
            os.unlink(path)
        except (IsADirectoryError, PermissionError):
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise
            shutil.rmtree(path)


#: Errors opening a slab file that mean the file is damaged (not a regular file, a link, no
#: longer readable): its slab is lost, as one whose file is gone. Others (EMFILE, ENOMEM, EIO)
#: pass and are the store's errors.
DAMAGE_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM,
                           errno.ENXIO, errno.ENODEV, errno.EROFS, errno.ETXTBSY})


def open_own_file(path: Path) -> int | None:
    """A read-write descriptor of the regular file at ``path``; None if nothing is there or
    what is there is damage (a directory, a link, a device, a file it may no longer open)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in DAMAGE_ERRNOS:
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def stray_files(root: Path, known: set[int]) -> list[Path]:
    """Slab files the index does not know: left by a writer that died mid-creation.

    A writer makes a new slab's file before the transaction that adds it (so it never writes
    megabytes while holding the index lock): a temporary file is stray only once it is older
    than any creation takes (``STRAY_TMP_AGE_S``)."""
    found: list[Path] = []
    now = time.time()
    for entry in os.scandir(root):
        name = entry.name
        if not name.startswith(_PREFIX):
            continue
        if name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime >= STRAY_TMP_AGE_S:
                    found.append(Path(entry.path))
        elif name.endswith(_SUFFIX):
            digits = name[len(_PREFIX) : -len(_SUFFIX)]
            if digits.isdigit() and int(digits) not in known:
                found.append(Path(entry.path))
    return found


def is_whole(root: Path, slab_id: int, nbytes: int) -> bool:
    """Whether the slab's file is a regular file of ours of at least ``nbytes`` (not mapped)."""
    fd = open_own_file(slab_path(root, slab_id))
    if fd is None:
        return False
    try:
        return os.fstat(fd).st_size >= nbytes
    finally:
        os.close(fd)


class Mappings:
    """This process's mappings of slab files, made once and reused; not thread-safe.

    A mapped file cut short by someone else would kill the process with SIGBUS at the next
    copy, so every view is handed out only after checking (fstat on a descriptor kept open)
    that the file is still whole: a damaged slab is reported as gone, and its objects are
    forgotten, at the cost of one fstat per object copied.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._maps: dict[int, tuple[int, Bytes]] = {}  # slab id -> (descriptor, mapping)

    def view(self, slab_id: int, nbytes: int) -> Bytes | None:
        """The slab's bytes as a writable uint8 array, or None if its file is gone, short or
        damaged (see ``open_own_file``)."""
        found = self._maps.get(slab_id)
        if found is not None and found[1].nbytes >= nbytes:
            fd, arr = found
            if os.fstat(fd).st_size >= arr.nbytes:
                return arr
            self.forget(slab_id)  # cut short under us: never touch that mapping again
            return None
        opened = open_own_file(slab_path(self.root, slab_id))
        if opened is None:
            return None
        fd = opened
        try:
            if os.fstat(fd).st_size < nbytes:
                os.close(fd)
                return None
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, nbytes, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        arr = np.frombuffer(mm, dtype=np.uint8)
        self.forget(slab_id)
        self._maps[slab_id] = (fd, arr)
        return arr

    def forget(self, slab_id: int) -> None:
        """Drop one slab's mapping (unmapped once no copy in flight holds a view)."""
        found = self._maps.pop(slab_id, None)
        if found is not None:
            os.close(found[0])

    def retain(self, live: set[int]) -> None:
        """Forget mappings of slabs that no longer exist.

        A deleted slab file keeps its memory while mapped; dropping the array unmaps it as
        soon as no copy in flight still holds a view.
        """
        for slab_id in [s for s in self._maps if s not in live]:
            self.forget(slab_id)

    def clear(self) -> None:
        for slab_id in list(self._maps):
            self.forget(slab_id)

    def __len__(self) -> int:
        return len(self._maps)
