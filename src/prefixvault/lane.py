"""A lane: the one way store work runs in the background, beside an engine's steps.

Every store round trip of the connector (lookups, verification samples, saves, loads) runs on a
lane, never in the engine's step, and so does every call into a store client that must be
bounded by a deadline (the Mooncake store's) (over a local store the step may wait a bounded time for a
lookup or load to finish: ``restore_in_step``). A lane is one daemon thread with a bounded queue:

- ``put`` queues a job with an optional deadline, or refuses it at once (queue full, lane
  closed): the caller's job is then failed with ``FULL`` or ``CLOSED``, never waited for.
- The thread takes every job queued by then as one batch (one store round trip for all of
  them: a slow store is paid per batch, not per job). Jobs whose deadline passed while queued
  are failed with ``TIMEOUT`` and never run; ``overdue`` lists running jobs past theirs.
- The owner's ``run(batch)`` resolves every job of the batch, or raises: the lane then
  fails the whole batch with the error's reason (``fail`` skips jobs ``run`` resolved), sorted
  by ``report``, the one rule every path of ours sorts errors by: a ``StoreError`` is the
  store's failure (a warning; quiet for an open breaker, which said so when it opened);
  anything else is a bug of ours, counted by the ``Guard`` and logged once per type with its
  traceback: a bug never looks like a flaky store on a dashboard. That includes a
  ``BaseException`` that is not an ``Exception`` (a store client's ``SystemExit``, a
  ``GeneratorExit`` escaping a C extension): the lane's thread outlives every error, since a
  dead lane would leave every later job waiting out its deadline.
- ``close(timeout)`` drops the jobs not started (or lets them run, ``drop_queued=False``) and
  waits for the rest up to ``timeout``; it returns whether the thread is idle. If not, a job is
  still inside a store call, and the store must stay open under it.

A daemon thread, not a ``ThreadPoolExecutor``: an interpreter exiting must not wait for a store
call that never returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from prefixvault.counters import Counters
from prefixvault.errors import BreakerOpen, StoreError
from prefixvault.guard import Guard

log = logging.getLogger("vllm.prefixvault")
J = TypeVar("J")


class Failure(StrEnum):
    """Why a lane failed a job (what its owner then does: a miss, a recompute, a save dropped)."""

    STORE_ERROR = "store_error"  # the store failed the batch
    BREAKER_OPEN = "breaker_open"  # the store was not called: it failed too often lately
    INTERNAL_ERROR = "internal_error"  # a bug of ours (logged with its traceback)
    TIMEOUT = "timeout"  # its deadline passed before it ran
    FULL = "full"  # the queue was full: refused at once
    CLOSED = "closed"  # the lane was closing: refused, or dropped before it ran


def failure_of(exc: BaseException) -> Failure:
    """Sort an error: the store's (an open breaker apart), or ours."""
    if isinstance(exc, BreakerOpen):
        return Failure.BREAKER_OPEN
    if isinstance(exc, StoreError):
        return Failure.STORE_ERROR
    return Failure.INTERNAL_ERROR


def report(guard: Guard, where: str, exc: BaseException, doing: str = "") -> Failure:
    """The one rule every path sorts an error by: the store's failure is a warning saying
    what failed (``doing``, else ``where``; an open breaker's quietly: it was said once when it
    opened); anything else is a bug of ours, counted by the guard under ``where`` and logged
    once per type with its traceback, never as the store's. Returns the error's ``Failure``."""
    reason = failure_of(exc)
    if reason is Failure.INTERNAL_ERROR:
        guard.failed(where, exc)
    else:
        log.log(logging.DEBUG if reason is Failure.BREAKER_OPEN else logging.WARNING,
                "prefixvault: %s failed: %s", doing or where, exc)
    return reason


@dataclass
class LaneCounters(Counters):
    """What a lane did, for metrics."""

    jobs: int = 0  # jobs run (in a batch that returned or raised)
    batches: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # jobs failed by the lane, by ``Failure``


@dataclass
class _Queued(Generic[J]):
    job: J
    deadline: float | None  # time.monotonic() by which it must have run; None: no deadline


class Lane(Generic[J]):
    """One background thread running ``run(batch)`` on batches of queued jobs (see the module)."""

    def __init__(
        self, name: str, run: Callable[[list[J]], None],
        fail: Callable[[list[J], Failure, BaseException | None], None], *, capacity: int,
        guard: Guard, on_start: Callable[[], None] | None = None,
    ) -> None:
        """``capacity``: jobs queued or running at most. ``fail(jobs, reason, error)``
        resolves jobs the lane could not run (it must not raise; if it does, the error is the
        guard's). ``on_start`` runs first on the thread."""
        if capacity < 1:
            raise ValueError(f"lane {name}: capacity must be at least 1, not {capacity}")
        self.name = name
        self.capacity = capacity
        self.guard = guard
        self.counters = LaneCounters()
        self._run = run
        self._fail = fail
        self._on_start = on_start
        self._cond = threading.Condition()
        # Invariant (under _cond): a job is in exactly one of _queue, _running, or resolved
        # by its owner; the thread exists iff ``_started``.
        self._queue: deque[_Queued[J]] = deque()
        self._running: list[_Queued[J]] = []
        self._closed = False
        self._started = False

    # -- the owner's side -------------------------------------------------------------------------

    def put(self, job: J, timeout: float | None = None) -> Failure | None:
        """Queue ``job`` (to run within ``timeout`` s, if given). Returns None, or why it was
        refused (``FULL``, ``CLOSED``): the caller then resolves it itself, at once."""
        with self._cond:
            full = len(self._queue) + len(self._running) >= self.capacity
            refused = Failure.CLOSED if self._closed else Failure.FULL if full else None
            if refused is None:
                deadline = None if timeout is None else time.monotonic() + timeout
                self._queue.append(_Queued(job, deadline))
                if not self._started:
                    self._started = True
                    threading.Thread(target=self._loop, name=f"prefixvault-{self.name}", daemon=True).start()
                self._cond.notify_all()
        if refused is not None:
            self.counters.tally("failed", refused)
        return refused

    def overdue(self, now: float | None = None) -> list[J]:
        """Jobs queued or running past their deadline (running ones cannot be stopped: their
        owner decides what their late answer is worth)."""
        now = time.monotonic() if now is None else now
        with self._cond:
            return [q.job for q in (*self._running, *self._queue)
                    if q.deadline is not None and q.deadline < now]

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        with self._cond:
            return bool(self._queue or self._running)

    def close(self, timeout: float, drop_queued: bool = True) -> bool:
        """Refuse new jobs; fail the queued ones (``CLOSED``) or, with ``drop_queued=False``,
        let them run; wait up to ``timeout`` s for the thread to go idle (jobs still queued then
        are failed). Whether it did: if not, a job is still running, inside a store call."""
        with self._cond:
            self._closed = True
            dropped = self._take_queue() if drop_queued else []
            self._cond.notify_all()
        self._give_up(dropped, Failure.CLOSED, None)
        with self._cond:
            idle = self._cond.wait_for(lambda: not self._queue and not self._running, timeout=timeout)
            left = self._take_queue()
            running = len(self._running)
        self._give_up(left, Failure.CLOSED, None)
        if dropped or left:
            log.info("prefixvault: %s lane closing: %d jobs dropped before they ran", self.name,
                     len(dropped) + len(left))
        if not idle and running:
            log.warning("prefixvault: %s lane closing: a batch of %d jobs still running after %.1f s is "
                        "abandoned", self.name, running, timeout)
        return idle or not running

    # -- the lane's thread ------------------------------------------------------------------------

    def _take_queue(self) -> list[J]:
        jobs = [q.job for q in self._queue]
        self._queue.clear()
        return jobs

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as e:  # the jobs still run; their owner names devices explicitly
                self.guard.failed(f"{self.name} lane start", e)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return  # closed, and nothing left
                now = time.monotonic()
                batch = [q for q in self._queue if q.deadline is None or q.deadline >= now]
                late = [q for q in self._queue if q.deadline is not None and q.deadline < now]
                self._queue.clear()
                self._running = [*late, *batch]  # busy until the late ones are given up too
            self._give_up([q.job for q in late], Failure.TIMEOUT, None)
            if batch:
                self._run_batch([q.job for q in batch])
            with self._cond:
                self._running = []
                self._cond.notify_all()

    def _run_batch(self, jobs: list[J]) -> None:
        self.counters.add(jobs=len(jobs), batches=1)
        try:
            self._run(jobs)
        except BaseException as e:  # (not only ``Exception``: see the module)
            self._give_up(jobs, report(self.guard, self.name, e, f"{self.name} of {len(jobs)} jobs"), e)

    def _give_up(self, jobs: Sequence[J], reason: Failure, error: BaseException | None) -> None:
        if not jobs:
            return
        self.counters.tally("failed", reason, len(jobs))
        try:
            self._fail(list(jobs), reason, error)
        except BaseException as e:  # an owner's bug; its jobs are lost to it, never to the engine
            self.guard.failed(f"{self.name} lane", e)
