"""The store contract: the only thing the vault protocol asks of a store.

Stores move opaque bytes under string keys. They know nothing of models, layouts or
boundaries; integrity is checked one layer up by the object codec. What a store must
guarantee is atomic visibility: a reader sees an object whole (old or new bytes) or not
at all, never a mix, even if a writer dies mid-put. One store cannot keep it for an
overwrite of unchanged size, which Mooncake writes in place (``stores.mooncake``): the
vault reads an object that fails verification once more before it removes or replaces it.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from prefixvault.errors import StoreError as StoreError
from prefixvault.errors import StoreUnavailable as StoreUnavailable

#: Anything exposing a contiguous byte buffer (bytes, bytearray, memoryview, numpy array).
Buffer: TypeAlias = bytes | bytearray | memoryview

#: Writes one object's bytes into the memory given, exactly the object's size (``put_filled``).
Fill: TypeAlias = Callable[[memoryview], None]
#: Moves object i's bytes (``src``) into the caller's buffer (``dst``) its own way (``get_taken``).
Take: TypeAlias = Callable[[int, memoryview, memoryview], None]

#: A key is ASCII, 1..250 characters, made of letters, digits and ``/._:-=``.
MAX_KEY_LEN = 250


_KEY = re.compile(rf"[A-Za-z0-9/._:=-]{{1,{MAX_KEY_LEN}}}")


def check_key(key: str) -> str:
    """Reject keys a store could not hold faithfully."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(
            f"invalid store key {_cut(str(key))!r}: use 1..{MAX_KEY_LEN} chars of [A-Za-z0-9/._:-=]")
    return key


def check_distinct(keys: Sequence[str]) -> None:
    """Refuse a batch that names a key twice where each key must be settled once."""
    if len(set(keys)) != len(keys):
        raise ValueError("put_if_absent_many: keys must be distinct")


#: The key class of recurrent states (see ``key_class``).
STATE_CLASS = "s"


def key_class(key: str) -> str:
    """The third ``/``-separated segment of a key: the kind of object it names.

    The vault writes ``namespace/layout/class/...`` (``b`` KV blocks, ``s`` recurrent states,
    ``r`` records). A store that budgets a class on its own (the local store's ``states=``)
    reads it here and knows nothing else of the key; any other key is of class ``""``."""
    parts = key.split("/", 3)
    return parts[2] if len(parts) > 3 else ""


def namespace_of(key: str) -> str:
    """A key's namespace: the text before its first ``/`` ("" for a key without one).

    The vault writes every key as ``namespace/layout/...`` (``keys.KeySpace``); a store that
    bounds each namespace's space (the local store's ``namespace_share=``) reads it here. A
    ``cache_salt`` does not show in a key (it is hashed into it): salts are not told apart,
    unless the engines keep each tenant's keys under a namespace of its own (``tenant_namespaces``)."""
    head, sep, _ = key.partition("/")
    return head if sep else ""


def redact(uri: str) -> str:
    """``uri`` fit for a message, a log line or a label: a password in it becomes ``***``.

    Tolerates anything (a malformed URI is redacted as text: whatever sits between ``:`` and
    ``@`` in the authority part goes)."""
    head, sep, rest = uri.partition("://")
    if not sep:
        return _cut(uri)
    authority, slash, tail = rest.partition("/")
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        authority = f"{user}{':***' if colon else ''}@{host}"
    return _cut(f"{head}://{authority}{slash}{tail}")


#: Longest user-given text a message echoes back (a 5,000-character path is cut, not printed).
SHOWN_CHARS = 200


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}...({len(text)} chars)"


def copy_into(data: Buffer, buf: memoryview) -> int:
    """Copy an object into a caller's buffer as ``get_into`` promises; return its size.

    An object larger than the buffer is not copied at all: the caller sees the size and
    treats the object as invalid.
    """
    dst = buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B")
    n = len(data)
    if n <= dst.nbytes:
        dst[:n] = data
    return n


@dataclass(frozen=True)
class StoreStats:
    objects: int
    bytes: int
    capacity: int | None  # None: unbounded
    evictions: int = 0
    #: Where the store counts states on their own (the local store): the bytes its states
    #: take, and the most they may take (``states=``; None: no budget of their own).
    state_bytes: int | None = None
    state_budget: int | None = None
    #: Where the store bounds each namespace's space (the local store's ``namespace_share=``):
    #: the most one namespace may take (None: no bound).
    namespace_budget: int | None = None


class Medium(StrEnum):
    """Where a store keeps its bytes: what a hit read from it costs, roughly."""

    MEMORY = "memory"  # this machine's memory (a process, or tmpfs)
    DISK = "disk"  # a file system on disk
    NETWORK = "network"  # another machine's memory or disk (Redis, Mooncake)


#: File systems whose files live in memory.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def medium_of_path(path: str) -> Medium:
    """Whether a directory's files live in memory (tmpfs, as /dev/shm) or on disk: the file
    system of the deepest mount point above it (``/proc/self/mounts``; disk if unknown)."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = f.read()
    except OSError:
        return Medium.DISK
    deepest, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(deepest):
            deepest, kind = point, fields[2]
    return Medium.MEMORY if kind in MEMORY_FILE_SYSTEMS else Medium.DISK


class Store(abc.ABC):
    """Batch key/value store with atomic per-object visibility.

    Every batch call is one round trip for remote stores. Results are positional: item i of
    the result answers item i of the request.
    """

    uri: str
    #: Whether each batch call crosses a network (Redis, Mooncake): a round trip then costs
    #: more than checking more keys in it, and the vault trades the one for the other.
    remote: bool = False
    #: Whether ``touch_and_get`` is one round trip (Redis and Valkey: one pipeline; Mooncake: two
    #: calls at once): a lookup that will read its hit's objects reads them in its first round
    #: trip where it can.
    pipelines: bool = False

    @property
    def medium(self) -> Medium:
        """Where its bytes sit, as an engine's metrics name a hit's source: across a network,
        else in memory (a local store on tmpfs, such as /dev/shm, says ``DISK`` otherwise)."""
        return Medium.NETWORK if self.remote else Medium.MEMORY

    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """Store each object as the concatenation of its parts (header + payload, say).

        Returns, for each item, True once the object is visible to every process that
        shares the store, False if it could not be stored (full, error, or empty where a
        store cannot hold empty objects: the vault never writes one). An existing object
        under the same key is replaced atomically (but for Mooncake's overwrite of unchanged
        size: see the module's docstring).
        """

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Store ``data`` only if ``key`` holds nothing; True if this call stored it.

        Of many concurrent callers (threads or processes) exactly one gets True.
        """

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """``put_if_absent`` for each (key, data), in one round trip where the store can;
        True for each key this call stored. Keys must be distinct. Not atomic as a whole: each
        key is settled on its own, as by ``put_if_absent``."""
        check_distinct([k for k, _ in items])
        return [self.put_if_absent(k, data) for k, data in items]

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Copy each object into the caller's buffer (zero extra copies where possible).

        Returns, per key, None if missing, else the object's size. If the size exceeds the
        buffer, nothing is copied for that key (the caller treats it as invalid).
        """

    def put_filled(self, items: Sequence[tuple[str, int, Fill]]) -> list[bool]:
        """``put_many`` of objects of the sizes given, whose bytes each ``fill`` writes itself
        (an encryption that is also the copy). A store that can hand out the memory an object
        will live in calls ``fill`` on it: one pass over the bytes; this default fills fresh
        memory and puts that."""
        out: list[tuple[str, Sequence[Buffer]]] = []
        for key, size, fill in items:
            buf = memoryview(bytearray(size))
            fill(buf)
            out.append((key, [buf]))
        return self.put_many(out)

    def get_taken(self, keys: Sequence[str], buffers: Sequence[memoryview], take: Take) -> list[int | None]:
        """``get_into`` where the caller moves each object's bytes into its buffer:
        ``take(i, src, dst)`` (a decryption that is also the copy), with ``src`` the object
        (its size) and ``dst`` buffer i. A store that can lend its own memory passes that as
        ``src``: one pass over the bytes; this default copies first and passes the buffer as
        both (in place). ``take`` must not raise, and may be called again for one key (a read
        that raced with a write is done again): its last call counts. Not called for a
        missing object, nor for one larger than its buffer."""
        sizes = self.get_into(keys, buffers)
        for i, size in enumerate(sizes):
            if size is not None and size <= len(buffers[i]):
                take(i, buffers[i][:size], buffers[i])
        return sizes

    @abc.abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return each object's bytes, or None if missing."""

    @abc.abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key currently holds an object."""

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        """``exists_many``, and the keys that exist and are marked in ``touch`` (every key by
        default) count as just used for the store's eviction: a hit keeps what it uses alive.

        Order: keys used together (touched in one call, or put in one ``put_many``) rank in
        the order given, where the store can: of two of them, the later is evicted first. The
        vault lists a prefix's objects from its first block on, so its tail goes before its
        head and no bytes stay behind a boundary that can no longer restore. Stores whose
        existence check already counts as a use (Mooncake grants a lease) keep this default."""
        return self.exists_many(keys)

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        """``touch_many(keys, touch)`` and ``get_many(reads)`` in one round trip where the store
        can (Redis and Valkey: one pipeline; Mooncake: two calls at once): a lookup checks what
        it needs and reads what it must read before it can name more, in one wait. ``sizes``:
        each read's expected size, 0 where unknown, for a store that sizes its buffers before it
        reads (Mooncake); an object of another size is still read whole. This default makes the
        two calls, and reads no key that the first found missing."""
        found = self.touch_many(keys, touch)
        gone = {k for k, ok in zip(keys, found, strict=True) if not ok}
        wanted = [k for k in reads if k not in gone]
        got = dict(zip(wanted, self.get_many(wanted), strict=True)) if wanted else {}
        return found, [got.get(k) for k in reads]

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove the keys that exist; return how many were removed."""

    @abc.abstractmethod
    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Yield (key, size) of every object whose key starts with ``prefix``."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Objects, bytes and capacity right now."""

    def staging_buffer(self, nbytes: int) -> memoryview | None:
        """Memory that ``get_into`` can fill with no copy (registered with a transfer engine),
        valid until the store's next call; None where any memory is as good."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the store's data stays."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
