"""A bounded host-memory set of objects recently loaded and verified: repeated loads of a shared
prefix are served from it, never from a remote store again.

A consumer engine restores a shared prefix (a system prompt, a few-shot preamble) for request
after request: vLLM's own prefix cache does not serve later requests from blocks a connector
loaded in hybrid align mode. Over a network store every restore would then be a round trip
and a copy of the whole prefix. The hot set keeps the verified payloads of the objects loaded
last, up to a byte budget (least recently used go first), keyed by the object's store key:
keys name content (chain hash, layout fingerprint, formats), so a key's bytes never change,
and a quarantine is still honoured (``Vault.load`` checks the deny-list on every hit, and
empties the set when the deny-list grows: a quarantine also removes its segment's KV blocks
from the store without listing them, and a copy kept here must not outlive them).

Off (budget 0) for local and in-process stores, where a load is a memcpy and a copy here would
only double memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HotSetStats:
    hits: int = 0  # objects served from the set
    hit_bytes: int = 0
    evicted: int = 0


class HotSet:
    """Invariant (under ``_lock``): ``_bytes`` is the sum of the payloads' lengths and never
    exceeds ``capacity`` after ``put`` returns; ``_items`` is in least recently used order."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"hot set capacity must not be negative, not {capacity}")
        self.capacity = capacity
        self.stats = HotSetStats()
        # bytearrays: a view of one is writable, as torch wants of what it reads from numpy
        # (nothing writes to them: a load only copies out of them)
        self._items: OrderedDict[str, bytearray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> bytearray | None:
        with self._lock:
            payload = self._items.get(key)
            if payload is None:
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_bytes += len(payload)
            return payload

    def put(self, key: str, payload: bytes | memoryview) -> None:
        """Keep a copy of ``payload`` (verified bytes) under ``key``; one larger than the whole
        budget is not kept."""
        n = len(payload)
        if n > self.capacity:
            return
        data = bytearray(payload)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._items and self._bytes + n > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)
                self.stats.evicted += 1
            self._items[key] = data
            self._bytes += n

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
