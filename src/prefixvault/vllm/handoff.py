"""Verified bytes a scheduler read for a load, handed to the worker of its own process.

A load vLLM runs before the step's forward (a synchronous load, ``(n, False)``) lets the
request's first chunk run in the step that restores it; but vLLM has no way back from a
synchronous load that fails on a hybrid model (0.32-0.34). So the scheduler side answers a
restore synchronously only when it already holds every object the load needs, read from the
store and verified on its lookup lane, and a worker in its own process will write them: then
the worker's part is a copy of bytes in hand into blocks vLLM allocated, which a store cannot
fail. Everywhere else (several ranks, a worker in another process) loads stay asynchronous.

Invariant: a ``Handoff`` is served only by a worker whose cache tensors are registered and
usable, for an engine of one rank, in the process that made it; the worker withdraws it when it
stops being usable. An engine id two workers of one process serve (engines built from one
``KVTransferConfig``) is served by neither: their schedulers could not tell whose it is.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping

from prefixvault.vault import ObjectRef

#: Verified payloads of one load, by object.
Payloads = Mapping[ObjectRef, memoryview]


class Handoff:
    """One engine's mailbox: the scheduler puts a request's payloads, the worker takes them in
    the step that loads them. A request has at most one entry (a newer put replaces it)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no worker taking from it
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
# sides of one engine); None: two workers named the same id, and neither is served.
_served: dict[str, Handoff | None] = {}
_served_lock = threading.Lock()


def serve(engine_id: str) -> Handoff | None:
    """A worker of this process takes this engine's handoffs from now on; None if another
    worker of this process serves the same engine id (then neither does)."""
    with _served_lock:
        if engine_id in _served:
            _served[engine_id] = None
            return None
        handoff = _served[engine_id] = Handoff()
        return handoff


def withdraw(engine_id: str, handoff: Handoff) -> None:
    """The worker serving ``handoff`` takes no more (it stopped, or its caches are unusable)."""
    with _served_lock:
        if _served.get(engine_id) is handoff:
            del _served[engine_id]


def served(engine_id: str | None) -> Handoff | None:
    """The engine's handoff if a worker of this process takes it, else None."""
    if engine_id is None:
        return None
    with _served_lock:
        handoff = _served.get(engine_id)
    return handoff if handoff is not None and handoff.pid == os.getpid() else None
