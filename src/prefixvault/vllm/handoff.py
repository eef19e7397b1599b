"""Verified bytes a scheduler read for a load, handed to the worker of its own process.

A load vLLM runs before the step's forward (a synchronous load, ``(n, False)``) lets the
request's first chunk run in the step that restores it; but vLLM has no way back from a
synchronous load that fails on a hybrid model (0.32-0.34). So the scheduler side answers a
restore synchronously only when it already holds every object the load needs, read from the
store and verified on its lookup lane, and a worker in its own process will write them: then
the worker's part is a copy of bytes in hand into blocks vLLM allocated, which a store cannot
fail. Everywhere else (several ranks, a worker in another process) loads stay asynchronous.

Invariant: a ``Handoff`` is served only by a worker whose cache tensors are registered and
usable, for an engine of one rank; the worker withdraws it when it stops being usable.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping

from prefixvault.vault import ObjectRef

#: Verified payloads of one load, by object.
Payloads = Mapping[ObjectRef, memoryview]


class Handoff:
    """One engine's mailbox: the scheduler puts a request's payloads, the worker takes them in
    the step that loads them. A request has at most one entry (a newer put replaces it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        # req_id -> (token, step, payloads), under _lock
        self._items: dict[str, tuple[int, int, Payloads]] = {}

    def put(self, req_id: str, payloads: Payloads, step: int) -> int:
        """Hand over a request's payloads for the load of ``step``; the token that load names
        them by (never 0)."""
        with self._lock:
            token = next(self._tokens)
            self._items[req_id] = (token, step, payloads)
        return token

    def take(self, req_id: str, token: int, step: int) -> Payloads | None:
        """The payloads put under ``token``, once; None if they are not here. Entries put for
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

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# Engines of this process whose worker takes handoffs, by vLLM's engine id (the same on both
# sides of one engine).
_served: dict[str, Handoff] = {}
_served_lock = threading.Lock()


def serve(engine_id: str) -> Handoff:
    """A worker of this process takes this engine's handoffs from now on."""
    with _served_lock:
        return _served.setdefault(engine_id, Handoff())


def withdraw(engine_id: str) -> None:
    """The engine's worker takes handoffs no more (it stopped, or its caches are unusable)."""
    with _served_lock:
        _served.pop(engine_id, None)


def served(engine_id: str | None) -> Handoff | None:
    """The engine's handoff if a worker of this process takes it, else None."""
    if engine_id is None:
        return None
    with _served_lock:
        return _served.get(engine_id)
