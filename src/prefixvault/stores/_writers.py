"""Writer liveness for the local store.

A writing process holds an flock on a file of its own (``writers/<token>``) for as long as
it lives: liveness then survives pid reuse and pid namespaces, and the kernel releases it
on SIGKILL. Slots claimed by a writer whose flock is free go back to the free list.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from prefixvault.stores import _arena

WRITERS_DIR = "writers"


def _is_dir(path: Path) -> bool:
    """A real directory (a link to one is not: the store never follows links it did not make)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def owner_alive(writers: Path, owner: str) -> bool:
    """Whether the process behind ``owner`` still holds the flock on its owner file."""
    path = writers / owner
    fd = _arena.open_own_file(path)
    if fd is None:  # gone, or not an owner file at all (a directory, a link): no writer
        if os.path.lexists(path):
            _arena.remove_file(path)
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


class WriterToken:
    """This process's writer identity, made on its first write; a forked child makes its own
    (the parent's flock stays with the parent)."""

    def __init__(self, root: Path, mode: int = 0o600) -> None:
        self.writers = root / WRITERS_DIR
        self.mode = mode
        self.token: str | None = None
        self._fd: int | None = None
        self._pid = os.getpid()

    def get(self) -> str:
        if self.token is not None and self._pid == os.getpid():
            return self.token
        self.after_fork()
        dir_mode = 0o770 if self.mode & 0o060 else 0o700
        if not _is_dir(self.writers):
            if os.path.lexists(self.writers):  # damage: a file or a link where the directory goes
                _arena.remove_file(self.writers)
            self.writers.mkdir(mode=dir_mode, exist_ok=True)
            with contextlib.suppress(OSError):  # the umask may have taken bits; another may own it
                os.chmod(self.writers, dir_mode)
        while True:
            token = f"{os.getpid()}-{os.urandom(6).hex()}"
            tmp = self.writers / f"{token}.new"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
            os.fchmod(fd, self.mode)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.rename(tmp, self.writers / token)
            except FileNotFoundError:  # swept as stale between create and lock: try again
                os.close(fd)
                continue
            self.token, self._fd, self._pid = token, fd, os.getpid()
            return token

    def after_fork(self) -> None:
        """Forget the parent's identity in a forked child (its descriptor is closed here only)."""
        if self._pid != os.getpid():
            if self._fd is not None:
                os.close(self._fd)
            self.token = self._fd = None
            self._pid = os.getpid()

    def release(self) -> None:
        """Remove this process's owner file and let go of its flock."""
        if self.token is not None and self._fd is not None and self._pid == os.getpid():
            _arena.remove_file(self.writers / self.token)
            os.close(self._fd)
        self.token = self._fd = None

    def sweep(self) -> None:
        """Remove owner files of writers that are gone."""
        if not _is_dir(self.writers):
            return
        for entry in os.scandir(self.writers):
            if entry.name != self.token:
                owner_alive(self.writers, entry.name)
