"""Verified bytes a scheduler read for a load, handed to its engine's one worker.

A load vLLM runs before the step's forward (a synchronous load, ``(n, False)``) lets the
request's first chunk run in the step that restores it; but vLLM has no way back from a
synchronous load that fails on a hybrid model (0.32-0.34). So the scheduler side answers a
restore synchronously only when it already holds every object the load needs, read from the
store and verified on its lookup lane, and handed to the worker that will write them before it
answers: then the worker's part is a copy of bytes in hand into blocks vLLM allocated, which a
store cannot fail. Everywhere else (several ranks, other executors) loads stay asynchronous.

What is handed over is each object as stored (header, checksum or MAC included), by its store
key, and the worker verifies it again by the rules of every read before a byte reaches the
cache (``Vault.open_sealed``): bytes changed in a mailbox file are refused like bytes changed
in the store. A mailbox file's index is plain JSON (keys and sizes), never code.

The worker is in the scheduler's process (vLLM's in-process executor: ``MemoryMailbox``) or,
with vLLM's multiprocessing executor at one rank (vLLM CPU's servers always), a child of it
(``SharedMailbox``: a private directory in shared memory the scheduler writes each load's
objects into, one file per load, which the worker reads and removes). ``Mailboxes`` is the one
way in: a worker ``serve``s its engine's mailbox, a scheduler ``find``s it, and a stopping
scheduler ``close``s it.

Invariant: a mailbox is served only by a worker whose cache tensors are registered and
usable, for an engine of one rank, and only to the scheduler of its own process or of its
parent process; the worker withdraws it when it stops being usable. An engine id two workers
serve to one scheduler's process (engines built from one ``KVTransferConfig``) is served by
neither: their schedulers could not tell whose it is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Protocol

log = logging.getLogger("vllm.prefixvault")

#: The objects of one load as stored (header included), by store key: verified again by the
#: worker that writes them.
Objects = Mapping[str, memoryview]


class Mailbox(Protocol):
    """Where a scheduler hands a worker the objects of its synchronous loads."""

    def put(self, req_id: str, objects: Objects, step: int) -> int:
        """Hand over a request's objects for the load of ``step``; the token that load names
        them by (never 0). Raises ``OSError`` if they could not be handed over."""

    def take(self, req_id: str, token: int, step: int) -> Objects | None:
        """The objects handed over under ``token``, once; None if they are not here."""

    def drop(self, req_id: str) -> None:
        """Let go of what was handed over for a request (vLLM did not allocate its load)."""

    def withdraw(self) -> None:
        """The worker serving it takes no more (it stopped, or its caches are unusable)."""

    def __len__(self) -> int: ...


class MemoryMailbox:
    """One engine's mailbox in memory, for a worker in the scheduler's process: the scheduler
    puts a request's objects, the worker takes them in the step that loads them. A request
    has at most one entry (a newer put replaces it)."""

    def __init__(self, engine_id: str = "") -> None:
        self.engine_id = engine_id
        self.pid = os.getpid()  # a forked child has no worker taking from it
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        # req_id -> (token, step, objects), under _lock
        self._items: dict[str, tuple[int, int, Objects]] = {}
        self._withdrawn = False  # its worker takes no more: a put is refused

    def put(self, req_id: str, objects: Objects, step: int) -> int:
        """Hand over a request's objects for the load of ``step``; the token that load names
        them by (never 0). Raises ``OSError`` once withdrawn (no worker would take them)."""
        with self._lock:
            if self._withdrawn:
                raise OSError(errno.ENODEV, "the worker withdrew its mailbox")
            token = next(self._tokens)
            self._items[req_id] = (token, step, objects)
        return token

    def take(self, req_id: str, token: int, step: int) -> Objects | None:
        """The objects put under ``token``, once; None if they are not here. Entries put for
        a step before ``step`` are let go of (steps run in order: nothing will take them)."""
        with self._lock:
            for rid in [r for r, (_, s, _) in self._items.items() if s < step]:
                del self._items[rid]
            item = self._items.get(req_id)
            if item is None or item[0] != token:
                return None
            del self._items[req_id]
        return item[2]

    def drop(self, req_id: str) -> None:
        with self._lock:
            self._items.pop(req_id, None)

    def withdraw(self) -> None:
        with self._lock:
            self._withdrawn = True
            self._items.clear()
        Mailboxes.withdraw_memory(self)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# -- a worker in a child process of the scheduler's (vLLM's multiprocessing executor) ---------

#: Where the mailboxes of workers in other processes are: shared memory where there is one.
SHARED_ROOT = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
_WORKER = "worker"  # the file naming the serving worker's pid
_REFUSED = "refused"  # two workers served this engine id to one scheduler process: neither does
_HEADER = struct.Struct("<Q")
#: Buffers one ``writev`` takes at most (POSIX's IOV_MAX on Linux).
_IOV_MAX = 1024


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; 0 where unknown).
    Containers sharing /dev/shm (``--ipc=host``) each have their own: a process id means
    something only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _prefix() -> str:
    """The start of every mailbox name of this user in this PID namespace. (Not the
    ``prefixvault-handoff-`` of releases before the namespace was in the name: a worker of such
    a release, started beside this one's engines, would read the namespace as a process id.)"""
    return f"prefixvault-mailbox-{os.getuid()}-{pid_namespace()}-"


def shared_dir(scheduler_pid: int, engine_id: str, root: Path | None = None) -> Path:
    """A mailbox's directory, named by its user, its PID namespace, its scheduler's process and
    its engine id."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return (root or SHARED_ROOT) / f"{_prefix()}{scheduler_pid}-{digest}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's, or no pid here: not ours to judge
        return True
    return True


def _parent(pid: int) -> int | None:
    """The parent of a live process (None where ``/proc`` does not say: not known)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _worker_pid(path: Path) -> int | None:
    try:
        return int((path / _WORKER).read_text())
    except (OSError, ValueError):
        return None


def _private(path: Path) -> bool:
    """A directory of ours alone (never one another user made, nor a link to one)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.getuid() \
        and st.st_mode & 0o077 == 0


class SharedMailbox:
    """One engine's mailbox between processes: a file per load, named by its step, token and
    request, written whole (then renamed) before the scheduler's step returns, so the worker
    finds it complete when that step's metadata reaches it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokens = itertools.count(1)

    @staticmethod
    def _req(req_id: str) -> str:
        return hashlib.sha256(req_id.encode()).hexdigest()[:24]

    def put(self, req_id: str, objects: Objects, step: int) -> int:
        """Write a request's objects for the load of ``step``; the token that load names them
        by (never 0). Raises ``OSError`` if they could not be written (nothing is left). The
        file: the index's length (8 bytes), the index (JSON: ``[[key, size], ...]``), then the
        objects in its order."""
        token = next(self._tokens)
        keys = list(objects)
        header = json.dumps([[k, memoryview(objects[k]).nbytes] for k in keys]).encode()
        name = f"{step}-{token}-{self._req(req_id)}"
        tmp = self.path / f".{name}"
        try:
            _write_all(tmp, [_HEADER.pack(len(header)), header, *(objects[k] for k in keys)])
            os.rename(tmp, self.path / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return token

    def _entries(self) -> list[tuple[int, int, str, str]]:
        """(step, token, request digest, file name) of every file written (or being written:
        a leading dot) in the mailbox."""
        out = []
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                parts = name.lstrip(".").split("-")
                if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
                    out.append((int(parts[0]), int(parts[1]), parts[2], name))
        return out

    def take(self, req_id: str, token: int, step: int) -> Objects | None:
        """The objects written under ``token``, once; None if they are not here or their file
        cannot be read (the worker then reads the store; every object is verified either way).
        Files written for a step before ``step`` are removed (nothing will take them)."""
        want, found = self._req(req_id), None
        for s, t, r, name in self._entries():
            if t == token and r == want and not name.startswith("."):
                found = name
            elif s < step:
                with contextlib.suppress(OSError):
                    os.unlink(self.path / name)
        if found is None:
            return None
        path = self.path / found
        try:
            with open(path, "rb") as f:
                data = _mapped(f.fileno())
            objects = _parse(data)
        except Exception as e:  # whatever is wrong with it, the worker reads the store instead
            log.warning("prefixvault: the objects handed over for request %s could not be read: %s",
                        req_id, e)
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return objects

    def drop(self, req_id: str) -> None:
        want = self._req(req_id)
        for _, _, r, name in self._entries():
            if r == want:
                with contextlib.suppress(OSError):
                    os.unlink(self.path / name)

    def withdraw(self) -> None:
        """Its directory goes, with what is in it (left as it is if another worker's refusal
        marks it: the id stays served by neither)."""
        if (self.path / _REFUSED).exists():
            with contextlib.suppress(OSError):
                (self.path / _WORKER).unlink()
            return
        if _worker_pid(self.path) == os.getpid():
            shutil.rmtree(self.path, ignore_errors=True)

    def __len__(self) -> int:
        return len(self._entries())


def _write_all(path: Path, parts: list[bytes | memoryview]) -> None:
    """A new file of ``parts``, in as few system calls as the kernel allows (a write per part
    would let the scheduler's thread lose the interpreter lock once per object, in its step)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        at = 0  # views before it are written whole
        while at < len(views):
            n = os.writev(fd, views[at : at + _IOV_MAX])
            if n == 0:
                raise OSError(errno.EIO, f"{path}: nothing written")
            while at < len(views) and n >= len(views[at]):
                n -= len(views[at])
                at += 1
            if n:  # a short write, within one buffer: the rest of it next
                views[at] = views[at][n:]
    finally:
        os.close(fd)


def _mapped(fd: int) -> memoryview:
    """A mailbox file's bytes, mapped rather than read: the engine's thread takes them in its
    step, and a read copies every byte once more into memory that is new to the process (its
    first touch several times dearer than the copy). Its pages are mapped at once (populated)
    and private: copy-on-write, so nothing written through a view reaches the file (writable,
    as torch wants the arrays it wraps); the mapping lives as long as a view of it (the file,
    unlinked next, with it). Nothing writes or cuts the file once it is renamed into place:
    only this process's user can (the directory is private), and that user could as well write
    the engine's memory. (A file cut short under its mapping would fault on access, where a
    read would fail cleanly: only that user could cut it, and nothing of ours does.)"""
    size = os.fstat(fd).st_size
    if size == 0:
        raise ValueError("0 bytes: no index")
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE))


def _parse(data: memoryview) -> dict[str, memoryview]:
    """A mailbox file's objects by key; ``ValueError`` unless its index is a JSON list of
    distinct ``[key, size]`` pairs whose sizes add up to the rest of the file exactly."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{len(data)} bytes: no index")
    (n,) = _HEADER.unpack_from(data)
    at = _HEADER.size + n
    if at > len(data):
        raise ValueError(f"an index of {n} bytes in a file of {len(data)}")
    index = json.loads(bytes(data[_HEADER.size : at]))
    objects: dict[str, memoryview] = {}
    if not isinstance(index, list):
        raise ValueError("not an index of objects")
    for item in index:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and type(item[1]) is int and item[1] >= 0 and item[0] not in objects):
            raise ValueError("not an index of objects")
        key, size = item
        objects[key] = data[at : at + size]
        at += size
    if at != len(data):
        raise ValueError(f"{len(data)} bytes, the index names {at}")
    return objects


def _sweep(root: Path) -> None:
    """Remove this user's mailboxes whose scheduler's process is gone (an engine killed, or
    one whose id two workers served): nothing will write to or take from them. Only those of
    this PID namespace: another container's process ids are not this one's to judge."""
    prefix = _prefix()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            name = entry.name.lstrip(".")  # (one made aside by a worker that died before it was in place)
            pid = name[len(prefix):].split("-")[0] if name.startswith(prefix) else ""
            if pid.isdigit() and not _alive(int(pid)) and _private(Path(entry.path)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _serve_parent(engine_id: str, root: Path | None = None) -> SharedMailbox | None:
    """A worker in a child process of its scheduler's takes this engine's handoffs from now on;
    None if another live worker already serves the engine id to the same scheduler process
    (then neither does), or the directory cannot be made ours. The directory appears whole
    (made aside, with the worker's pid in it, then renamed into place)."""
    base = root or SHARED_ROOT
    _sweep(base)
    path = shared_dir(os.getppid(), engine_id, root)
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=base))  # (0700)
        (aside / _WORKER).write_text(str(os.getpid()))
    except OSError as e:
        log.warning("prefixvault: no mailbox for synchronous loads in %s (%s): loads stay asynchronous",
                    base, e)
        return None
    for _ in range(2):
        try:
            os.rename(aside, path)
            return SharedMailbox(path)
        except OSError:  # there already: another worker's, or a dead one's
            pass
        other = _worker_pid(path)
        if not _private(path):
            log.warning("prefixvault: %s is not this user's alone: loads stay asynchronous", path)
            break
        if (path / _REFUSED).exists() or (other is not None and other != os.getpid() and _alive(other)):
            with contextlib.suppress(OSError):
                (path / _REFUSED).touch()
            log.warning("prefixvault: two workers serve engine id %s to one process: neither takes "
                        "synchronous loads (give each engine a kv_transfer_config engine_id of its own)",
                        engine_id)
            break
        shutil.rmtree(path, ignore_errors=True)  # a worker's that died: nothing in it is taken
    shutil.rmtree(aside, ignore_errors=True)
    return None


def _served_by_child(engine_id: str, root: Path | None = None) -> SharedMailbox | None:
    """The engine's mailbox if a worker that is a live child of this process serves it."""
    path = shared_dir(os.getpid(), engine_id, root)
    if (path / _REFUSED).exists() or not _private(path):
        return None
    pid = _worker_pid(path)
    if pid is None or pid == os.getpid() or not _alive(pid):
        return None
    parent = _parent(pid)
    if parent is not None and parent != os.getpid():  # a stale mailbox, its pid reused
        return None
    # one writer per mailbox in this process: its tokens never repeat
    return Mailboxes.writer(path)


class Mailboxes:
    """The one way to an engine's mailbox: a worker serves it, its scheduler finds it.

    Invariant (module docstring): served only by a worker of one rank whose caches are usable,
    found only by the scheduler of the worker's own process or of its parent process."""

    # Engines of this process whose worker takes handoffs in memory, by vLLM's engine id (the
    # same on both sides of one engine); None: two workers named the same id, served by neither.
    _memory: ClassVar[dict[str, MemoryMailbox | None]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()
    # One writer per shared mailbox in this process: its tokens never repeat.
    _writers: ClassVar[dict[Path, SharedMailbox]] = {}

    @classmethod
    def serve(cls, engine_id: str, executor: str | None, root: Path | None = None) -> Mailbox | None:
        """The mailbox a worker of vLLM's ``executor`` takes its engine's synchronous loads
        from: in memory for the in-process executors, in shared memory for the multiprocessing
        one (its scheduler is its parent process); None for any other, or where another worker
        already serves the same engine id (then neither does)."""
        if executor == "mp":
            return _serve_parent(engine_id, root)
        if executor not in (None, "uni", "external_launcher"):
            return None
        with cls._lock:
            if engine_id in cls._memory:
                cls._memory[engine_id] = None
                return None
            mailbox = cls._memory[engine_id] = MemoryMailbox(engine_id)
            return mailbox

    @classmethod
    def find(cls, engine_id: str | None, root: Path | None = None) -> Mailbox | None:
        """The engine's mailbox, if a worker of this process or a live child of it serves it."""
        if engine_id is None:
            return None
        with cls._lock:
            own = cls._memory.get(engine_id)
        if own is not None and own.pid == os.getpid():
            return own
        return _served_by_child(engine_id, root)

    @classmethod
    def close(cls, engine_id: str | None, root: Path | None = None) -> None:
        """The scheduler's process stops: its engine's shared mailbox goes (also one two
        workers refused)."""
        if engine_id is not None:
            path = shared_dir(os.getpid(), engine_id, root)
            cls._writers.pop(path, None)
            if _private(path):
                shutil.rmtree(path, ignore_errors=True)

    @classmethod
    def withdraw_memory(cls, mailbox: MemoryMailbox) -> None:
        with cls._lock:
            if cls._memory.get(mailbox.engine_id) is mailbox:
                del cls._memory[mailbox.engine_id]

    @classmethod
    def writer(cls, path: Path) -> SharedMailbox:
        return cls._writers.setdefault(path, SharedMailbox(path))
