"""A circuit breaker around a serving engine's store: one failure policy for every store.

A store that is down or stalled costs each call up to its timeout. Calls come from inside
engine steps, so without a breaker a dead Redis costs every lookup, load and save a full
timeout, step after step. The breaker counts calls that fail for want of the store
(``StoreUnavailable``: unreachable, timed out, a Mooncake call still stuck):

- **closed**: calls go through; ``failures`` of them in a row open it.
- **open**: every call fails at once with ``BreakerOpen`` (a miss or a skipped save for the
  caller) for ``open_s`` seconds.
- **half-open**: then one call, the probe, goes through; success closes the breaker, failure
  opens it again for twice as long (up to ``max_open_s``).

A store that could not be opened at start is simply an open breaker whose probe opens it: the
engine starts and serves cold, and picks the store up when it is back. Errors that are not
about availability (a key too long, a value refused) pass through and change nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar
from urllib.parse import urlsplit

from prefixvault.errors import BreakerOpen as BreakerOpen
from prefixvault.stores.base import (
    Buffer,
    Fill,
    Medium,
    Store,
    StoreError,
    StoreStats,
    StoreUnavailable,
    Take,
    medium_of_path,
    redact,
)

log = logging.getLogger("vllm.prefixvault")
T = TypeVar("T")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3  # consecutive unavailable calls that open the breaker
    open_s: float = 5.0  # first wait before a probe
    max_open_s: float = 60.0  # the wait doubles after each failed probe, up to this


class CircuitBreaker:
    """The state machine alone (thread-safe; the clock can be given for tests)."""

    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic,
                 name: str = "store") -> None:
        self.policy = policy
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()  # held for a state change only, never across a store call
        _BREAKERS.add(self)
        self.state = BreakerState.CLOSED
        self._failures = 0  # consecutive, while closed
        self._wait = policy.open_s
        self._until = 0.0  # while open: when the next probe may go
        self._probing = False  # half-open: the probe is in flight
        self.last_error = ""
        self.opened = 0  # times it opened (for metrics)
        self.refused = 0  # calls failed fast

    def trip(self, error: str) -> None:
        """Open now, quietly: a store that could not be opened at start (its opener says so)."""
        with self._lock:
            self.opened += 1
            self.state = BreakerState.OPEN
            self.last_error = error
            self._until = self._clock() + self._wait

    def allow(self) -> bool | None:
        """Whether a call may go to the store now: None (no), False (yes, the breaker is
        closed) or True (yes, as the probe). Pass the answer to ``success``/``failure``/
        ``neutral``: out of half-open, only the probe's outcome counts (a call let through
        while closed may finish late)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return False
            if self.state is BreakerState.OPEN and self._clock() >= self._until:
                self.state = BreakerState.HALF_OPEN
            if self.state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            self.refused += 1
            return None

    def success(self, probe: bool = False) -> None:
        with self._lock:
            if self.state is not BreakerState.CLOSED and not probe:
                return  # a late answer of a call made while closed: the probe decides
            if self.state is not BreakerState.CLOSED:
                log.warning("prefixvault: %s is back; calling it again", self.name)
            self.state = BreakerState.CLOSED
            self._failures = 0
            self._wait = self.policy.open_s
            self._probing = False

    def neutral(self, probe: bool = False) -> None:
        """A call that failed for a reason of its own: if it was the probe, a probe may go again."""
        with self._lock:
            if probe:
                self._probing = False

    def failure(self, error: str, probe: bool = False) -> None:
        with self._lock:
            self.last_error = error
            if self.state is not BreakerState.CLOSED and not probe:
                return  # a late failure of a call made while closed: the outage is already known
            if self.state is BreakerState.HALF_OPEN:
                self._wait = min(self._wait * 2, self.policy.max_open_s)
                self._open(error)
                return
            self._failures += 1
            if self.state is BreakerState.CLOSED and self._failures >= self.policy.failures:
                self._open(error)

    def _open(self, error: str) -> None:
        if self.state is BreakerState.CLOSED:  # an outage begins (a failed probe only extends it)
            self.opened += 1
            log.warning("prefixvault: %s unavailable (%s); not calling it for %.0f s, serving without it",
                        self.name, error, self._wait)
        elif self.state is BreakerState.HALF_OPEN:
            log.warning("prefixvault: %s still unavailable (%s); next try in %.0f s", self.name, error,
                        self._wait)
        self.state = BreakerState.OPEN
        self.last_error = error
        self._until = self._clock() + self._wait
        self._probing = False

    def next_probe_in(self) -> float:
        with self._lock:
            return max(0.0, self._until - self._clock()) if self.state is BreakerState.OPEN else 0.0


class BreakerStore(Store):
    """Every call of a store through a ``CircuitBreaker``; opens the store on the first
    probe if it could not be opened at start."""

    def __init__(self, uri: str, opener: Callable[[str], Store], store: Store | None = None,
                 first_error: StoreError | None = None, policy: BreakerPolicy = BreakerPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.uri = redact(uri)  # what it shows; ``_open_uri`` keeps the password to open with
        self._open_uri = uri
        self._opener = opener
        self._store = store
        self.breaker = CircuitBreaker(policy, clock, f"store {self.uri}")
        # Known before the store opens: whatever the URI names, other than a local directory
        # or process memory, is across a network.
        self.remote = store.remote if store is not None else urlsplit(uri).scheme not in ("local", "memory")
        self.pipelines = store.pipelines if store is not None \
            else urlsplit(uri).scheme.startswith(("redis", "mooncake"))
        if store is None:
            self.breaker.trip(str(first_error or "not opened"))

    @property
    def medium(self) -> Medium:
        if self._store is not None:
            return self._store.medium
        parts = urlsplit(self._open_uri)  # (not opened yet: what its URI names)
        if parts.scheme == "local":
            return medium_of_path(parts.path) if parts.path else Medium.DISK
        return Medium.MEMORY if parts.scheme == "memory" else Medium.NETWORK

    def _call(self, fn: Callable[[Store], T]) -> T:
        probe = self.breaker.allow()
        if probe is None:
            raise BreakerOpen(f"store {self.uri} not called (breaker open, next probe in "
                              f"{self.breaker.next_probe_in():.1f} s): {self.breaker.last_error}")
        try:
            if self._store is None:
                self._store = self._opener(self._open_uri)
            out = fn(self._store)
        except StoreUnavailable as exc:
            self.breaker.failure(str(exc), probe)
            raise
        except StoreError as exc:
            if self._store is None:  # it answers, but refuses us: still nothing to call
                self.breaker.failure(str(exc), probe)
                raise StoreUnavailable(f"store {self.uri} cannot be opened: {exc}") from None
            self.breaker.success(probe)  # it answered; the error is about the call, not the store
            raise
        except BaseException:
            self.breaker.neutral(probe)  # not about the store's availability: its state stays
            raise
        self.breaker.success(probe)
        return out

    @property
    def inner(self) -> Store | None:
        return self._store

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return self._call(lambda s: s.put_many(items))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self._call(lambda s: s.put_if_absent(key, data))

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        return self._call(lambda s: s.put_if_absent_many(items))

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._call(lambda s: s.get_into(keys, buffers))

    def put_filled(self, items: Sequence[tuple[str, int, Fill]]) -> list[bool]:
        return self._call(lambda s: s.put_filled(items))

    def get_taken(self, keys: Sequence[str], buffers: Sequence[memoryview], take: Take) -> list[int | None]:
        return self._call(lambda s: s.get_taken(keys, buffers, take))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call(lambda s: s.get_many(keys))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda s: s.exists_many(keys))

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        return self._call(lambda s: s.touch_many(keys, touch))

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        return self._call(lambda s: s.touch_and_get(keys, touch, reads, sizes))

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._call(lambda s: s.delete_many(keys))

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return iter(self._call(lambda s: list(s.scan(prefix))))

    def stats(self) -> StoreStats:
        return self._call(lambda s: s.stats())

    def staging_buffer(self, nbytes: int) -> memoryview | None:
        return self._store.staging_buffer(nbytes) if self._store is not None else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


# -- fork: a breaker's lock is held only for a state change, so the forking thread takes every
# breaker's lock first (no thread is mid-change at the fork) and the child starts with fresh ones.

_BREAKERS: weakref.WeakSet[CircuitBreaker] = weakref.WeakSet()
_FORK_HELD: list[CircuitBreaker] = []


def _before_fork() -> None:
    _FORK_HELD[:] = sorted(list(_BREAKERS), key=id)
    for breaker in _FORK_HELD:
        breaker._lock.acquire()


def _after_fork_in_parent() -> None:
    for breaker in _FORK_HELD:
        breaker._lock.release()
    _FORK_HELD.clear()


def _after_fork_in_child() -> None:
    for breaker in list(_BREAKERS):
        breaker._lock = threading.Lock()
    _FORK_HELD.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
