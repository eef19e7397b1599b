"""A fixed budget of host memory for saves in flight, handed out as a ring.

A save copies its objects out of the engine's blocks inside the step (the blocks may be reused
by the next one) and stores them later, on a save thread. The copies wait here: one buffer,
allocated and pre-faulted once (first touch of fresh pages costs far more than the copy), cut
into consecutive reservations. Reservations are released in about the order they were made
(one save thread, in order), so free space is the gap between the newest and the oldest
reservation still held; one released out of order frees its bytes once all older ones are
released. When the gap is too small the caller is told so, and drops the save: staging
never grows and never makes the step wait.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Reservation:
    """``nbytes`` at ``offset`` of the ring's buffer, held until released."""

    offset: int
    nbytes: int
    view: memoryview
    released: bool = field(default=False, repr=False)


class StagingRing:
    """Reservations of contiguous bytes in one pre-faulted buffer of ``capacity`` bytes.

    Invariant (under ``_lock``): the live reservations, oldest first, lie in the buffer in
    ring order starting at ``_tail`` and ending at ``_head``; none overlaps another; bytes
    between ``_head`` and ``_tail`` (going forward, wrapping) are free. ``_used`` counts the
    bytes of live reservations plus any gap skipped at the end of the buffer by a wrap.
    """

    def __init__(self, capacity: int, buffer: np.ndarray | None = None) -> None:
        """``buffer``: memory to hand out (e.g. pinned, for device copies); else allocated."""
        if capacity <= 0:
            raise ValueError("staging capacity must be positive")
        self.capacity = capacity
        self._buf = np.empty(capacity, np.uint8) if buffer is None else buffer.reshape(-1)[:capacity]
        if self._buf.dtype != np.uint8 or self._buf.nbytes != capacity:
            raise ValueError(f"staging buffer must be {capacity} uint8 bytes")
        self._buf.fill(0)  # pre-fault: the step must never pay for first touch
        self._lock = threading.Lock()
        self._live: deque[Reservation] = deque()
        self._head = 0  # where the next reservation starts (unless it wraps)
        self._tail = 0  # start of the oldest live reservation (== _head when none)
        self._used = 0

    @property
    def in_use(self) -> int:
        """Bytes held by reservations (and the skipped end of the buffer, while wrapped)."""
        with self._lock:
            return self._used

    def reserve(self, nbytes: int) -> Reservation | None:
        """``nbytes`` contiguous bytes, or None if the ring has no such gap now."""
        if nbytes <= 0 or nbytes > self.capacity:
            return None
        with self._lock:
            if not self._live:
                self._head = self._tail = 0
                self._used = 0
            start = self._fit(nbytes)
            if start is None:
                return None
            if start < self._head:  # wrapped: the end of the buffer is skipped until released
                self._used += self.capacity - self._head
            self._head = start + nbytes
            self._used += nbytes
            r = Reservation(start, nbytes, self._buf[start : start + nbytes].data)
            self._live.append(r)
            return r

    def _fit(self, nbytes: int) -> int | None:
        if not self._live:
            return 0
        if self._head > self._tail:  # live bytes are [tail, head): free after head, then before tail
            if self.capacity - self._head >= nbytes:
                return self._head
            return 0 if nbytes <= self._tail else None
        # wrapped: live bytes are [tail, end) + [0, head): free is [head, tail)
        return self._head if self._tail - self._head >= nbytes else None

    def release(self, r: Reservation) -> None:
        """Give a reservation back; its bytes are reusable once every older one is back too."""
        with self._lock:
            if r.released:
                return
            r.released = True
            while self._live and self._live[0].released:
                old = self._live.popleft()
                self._used -= old.nbytes
                nxt = self._live[0].offset if self._live else self._head
                if nxt < old.offset:  # the next one wrapped to the start: the skipped end is free
                    self._used -= self.capacity - (old.offset + old.nbytes)
                self._tail = nxt


class SlotPool:
    """``count`` slots of ``slot_bytes`` each, in one pre-faulted buffer, taken and given back
    in any order.

    What it holds: the state of each decoding request at its last output boundary, kept until
    the request finishes (a ring would be pinned by the longest-running request). Every slot
    has the same size (one boundary's states), so freeing never fragments.

    Invariant (under ``_lock``): ``_free`` holds every slot index not taken, each once.
    """

    def __init__(self, slot_bytes: int, count: int, buffer: np.ndarray | None = None) -> None:
        """``buffer``: memory to hand out (pinned, for a device's copies to run beside the
        engine); else allocated."""
        if slot_bytes <= 0 or count <= 0:
            raise ValueError("a slot pool needs a positive slot size and count")
        self.slot_bytes = slot_bytes
        self.count = count
        need = slot_bytes * count
        self._buf = np.empty(need, np.uint8) if buffer is None else buffer.reshape(-1)[:need]
        if self._buf.dtype != np.uint8 or self._buf.size != need:
            raise ValueError(f"slot buffer must be {need} uint8 bytes")
        self._buf.fill(0)  # pre-fault: a hold is copied inside the engine's step
        self._free = list(range(count - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def taken(self) -> int:
        with self._lock:
            return self.count - len(self._free)

    def take(self) -> int | None:
        """A free slot's index, or None when every slot is taken."""
        with self._lock:
            return self._free.pop() if self._free else None

    def view(self, slot: int) -> memoryview:
        return self._buf[slot * self.slot_bytes : (slot + 1) * self.slot_bytes].data

    def give(self, slot: int) -> None:
        with self._lock:
            if not 0 <= slot < self.count or slot in self._free:
                raise ValueError(f"slot {slot} is not taken")
            self._free.append(slot)
