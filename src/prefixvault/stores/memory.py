"""An in-process store: a dict behind a lock, optionally LRU-bounded.

Meant for tests and single-process experiments; nothing here is shared between processes.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import ClassVar

from prefixvault.stores.base import Buffer, Store, StoreError, StoreStats, check_key, copy_into
from prefixvault.units import parse_size


def _join(parts: Sequence[Buffer]) -> bytes:
    """Concatenate parts given as any contiguous buffers (numpy arrays included)."""
    return b"".join(parts)


class MemoryStore(Store):
    """Dict store; ``named`` gives one shared instance per name within the process."""

    _registry: ClassVar[dict[str, MemoryStore]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, capacity: int | None = None, name: str = "") -> None:
        if capacity is not None and capacity < 0:
            raise StoreError(f"memory store capacity must be >= 0, got {capacity}")
        self.uri = f"memory://{name}"
        self.capacity = capacity
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._evictions = 0
        self._lock = threading.Lock()
        _STORES.add(self)

    @classmethod
    def named(cls, name: str = "", capacity: str | int | None = None, **params: str) -> MemoryStore:
        """The process-wide store called ``name`` (a fresh one when ``name`` is empty)."""
        if params:
            raise StoreError(f"unknown memory store parameter(s): {', '.join(sorted(params))}")
        cap: int | None
        try:
            cap = parse_size(capacity) if isinstance(capacity, str) else capacity
        except ValueError as exc:
            raise StoreError(f"bad memory store capacity: {exc}") from None
        if not name:
            return cls(cap)
        with cls._registry_lock:
            store = cls._registry.get(name)
            if store is None:
                store = cls._registry[name] = cls(cap, name)
            elif cap is not None and cap != store.capacity:
                with store._lock:
                    store.capacity = cap
                    store._evict_to(cap)
            return store

    # -- internals (hold self._lock) -------------------------------------------------

    def _evict_to(self, limit: int) -> None:
        while self._data and self._bytes > limit:
            _, old = self._data.popitem(last=False)
            self._bytes -= len(old)
            self._evictions += 1

    def _set(self, key: str, data: bytes) -> bool:
        if self.capacity is not None and len(data) > self.capacity:
            return False
        old = self._data.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        if self.capacity is not None:
            self._evict_to(self.capacity - len(data))
        self._data[key] = data
        self._bytes += len(data)
        return True

    def _lookup(self, key: str) -> bytes | None:
        data = self._data.get(key)
        if data is not None:
            self._data.move_to_end(key)
        return data

    # -- Store -------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        prepared = [(check_key(key), _join(parts)) for key, parts in items]
        with self._lock:
            done = [self._set(key, data) for key, data in prepared]
            for key in reversed(dict.fromkeys(k for k, _ in prepared)):
                if key in self._data:  # the first key given ends up the most recent
                    self._data.move_to_end(key)
            return done

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        check_key(key)
        blob = _join([data])
        with self._lock:
            if key in self._data:
                return False
            return self._set(key, blob)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        out: list[int | None] = []
        for key, buf in zip(keys, buffers, strict=True):
            check_key(key)
            with self._lock:
                data = self._lookup(key)
            if data is None:
                out.append(None)
                continue
            out.append(copy_into(data, buf))
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        for key in keys:
            check_key(key)
        with self._lock:
            return [self._lookup(key) for key in keys]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        with self._lock:
            return [key in self._data for key in keys]

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        for key in keys:
            check_key(key)
        if touch is not None and len(touch) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(touch)} touch marks")
        found = [False] * len(keys)
        with self._lock:
            data = self._data
            for i in range(len(keys) - 1, -1, -1):  # backwards: the first key ends up the most recent
                if keys[i] in data:
                    found[i] = True
                    if touch is None or touch[i]:
                        data.move_to_end(keys[i])
            return found

    def delete_many(self, keys: Sequence[str]) -> int:
        for key in keys:
            check_key(key)
        removed = 0
        with self._lock:
            for key in keys:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                    removed += 1
        return removed

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            found = [(k, len(v)) for k, v in self._data.items() if k.startswith(prefix)]
        return iter(sorted(found))

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(len(self._data), self._bytes, self.capacity, self._evictions)


# -- fork ------------------------------------------------------------------------------------
# A child forked while another thread held a store's lock would wait on it forever: the
# forking thread takes every lock first (the dict is never seen half-changed), and the child
# starts with fresh ones.

_STORES: weakref.WeakSet[MemoryStore] = weakref.WeakSet()
_HELD: list[MemoryStore] = []


def _before_fork() -> None:
    MemoryStore._registry_lock.acquire()
    _HELD[:] = sorted(list(_STORES), key=id)
    for store in _HELD:
        store._lock.acquire()


def _after_fork_in_parent() -> None:
    for store in _HELD:
        store._lock.release()
    _HELD.clear()
    MemoryStore._registry_lock.release()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._lock = threading.Lock()
    _HELD.clear()
    MemoryStore._registry_lock = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
