"""The lane: one thread, a bounded queue, batches, deadlines, errors sorted into the store's
and ours, and a close that says whether it drained. Real threads; no store (the jobs are
plain values, the store's errors are the store's own exception types)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.guard import Guard
from prefixvault.lane import Failure, Lane
from prefixvault.stores.base import StoreUnavailable
from prefixvault.stores.breaker import BreakerOpen


class Owner:
    """Records every job's outcome; ``gate`` holds the batch being run."""

    def __init__(self, raise_for: dict[int, BaseException] | None = None) -> None:
        self.batches: list[list[int]] = []
        self.ran: Counter[int] = Counter()
        self.failed: dict[int, Failure] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()
        self.raise_for = raise_for or {}
        self.lock = threading.Lock()

    def run(self, batch: list[int]) -> None:
        self.running.set()
        self.gate.wait(10)
        with self.lock:
            self.batches.append(list(batch))
        for job in batch:
            if job in self.raise_for:
                raise self.raise_for[job]
        with self.lock:
            self.ran.update(batch)

    def fail(self, jobs: list[int], reason: Failure, error: BaseException | None) -> None:
        with self.lock:
            for job in jobs:
                assert job not in self.failed, f"job {job} failed twice"
                self.failed[job] = reason


def lane(owner: Owner, capacity: int = 100, guard: Guard | None = None) -> Lane[int]:
    return Lane("test", owner.run, owner.fail, capacity=capacity, guard=guard or Guard())


def test_jobs_queued_while_a_batch_runs_go_together_in_the_next_batch() -> None:
    owner = Owner()
    ln = lane(owner)
    owner.gate.clear()
    ln.put(1)
    assert owner.running.wait(5)
    for job in range(2, 7):
        ln.put(job)
    owner.gate.set()
    assert ln.close(5, drop_queued=False)
    assert owner.batches == [[1], [2, 3, 4, 5, 6]]
    assert ln.counters.snapshot() == {"jobs": 6, "batches": 2}


def test_a_full_lane_refuses_at_once_and_counts_it() -> None:
    owner = Owner()
    ln = lane(owner, capacity=2)
    owner.gate.clear()
    assert ln.put(1) is None
    assert owner.running.wait(5)
    assert ln.put(2) is None  # one running, one queued: full
    assert ln.put(3) is Failure.FULL
    owner.gate.set()
    assert ln.close(5, drop_queued=False)
    assert sorted(owner.ran) == [1, 2] and ln.counters.failed == {"full": 1}
    assert ln.put(4) is Failure.CLOSED


def test_a_job_past_its_deadline_while_queued_never_runs_and_a_running_one_is_overdue() -> None:
    owner = Owner()
    ln = lane(owner)
    owner.gate.clear()
    ln.put(1, timeout=0.05)
    assert owner.running.wait(5)
    ln.put(2, timeout=0.05)
    ln.put(3)
    time.sleep(0.1)
    assert sorted(ln.overdue()) == [1, 2]  # running past it, and queued past it
    owner.gate.set()
    assert ln.close(5, drop_queued=False)
    assert owner.failed == {2: Failure.TIMEOUT}
    assert sorted(owner.ran) == [1, 3]


@pytest.mark.parametrize(("error", "reason", "ours"), [
    (StoreUnavailable("down"), Failure.STORE_ERROR, False),
    (BreakerOpen("open"), Failure.BREAKER_OPEN, False),
    (KeyError("a bug"), Failure.INTERNAL_ERROR, True),
])
def test_a_batch_that_raises_fails_every_job_by_whose_error_it_was(
        error: BaseException, reason: Failure, ours: bool, caplog: pytest.LogCaptureFixture) -> None:
    owner = Owner(raise_for={2: error})
    guard = Guard()
    ln = lane(owner, guard=guard)
    owner.gate.clear()
    ln.put(1)
    assert owner.running.wait(5)
    ln.put(2)
    ln.put(3)
    with caplog.at_level(logging.DEBUG, logger="vllm.prefixvault"):
        owner.gate.set()
        assert ln.close(5, drop_queued=False)
    assert owner.ran == Counter({1: 1})
    assert owner.failed == {2: reason, 3: reason}
    assert guard.errors["test"] == (1 if ours else 0)
    assert ("Traceback" in caplog.text) is ours  # our bug is logged with its traceback, once


class _Escaped(BaseException):
    """Not an ``Exception``: what a store client's C extension or ``sys.exit`` can raise."""


@pytest.mark.parametrize("error", [_Escaped("from a C extension"), SystemExit(3), GeneratorExit()])
def test_a_base_exception_fails_its_batch_as_ours_and_the_lane_runs_on(error: BaseException) -> None:
    owner = Owner(raise_for={1: error})
    guard = Guard()
    ln = lane(owner, guard=guard)
    ln.put(1)
    deadline = time.monotonic() + 5
    while 1 not in owner.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.failed == {1: Failure.INTERNAL_ERROR}
    ln.put(2)  # the thread is still there: the next job runs, no deadline waited out
    assert ln.close(5, drop_queued=False)
    assert owner.ran == Counter({2: 1})
    assert guard.errors["test"] == 1


def test_close_drops_what_has_not_started_and_abandons_a_stuck_job_within_its_timeout() -> None:
    owner = Owner()
    ln = lane(owner)
    owner.gate.clear()
    ln.put(1)
    assert owner.running.wait(5)
    ln.put(2)
    t0 = time.monotonic()
    assert ln.close(0.2) is False  # 1 is still inside its call
    assert time.monotonic() - t0 < 1
    assert owner.failed == {2: Failure.CLOSED}
    owner.gate.set()
    deadline = time.monotonic() + 5
    while ln.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.ran == Counter({1: 1})


def test_close_without_dropping_runs_the_queue_and_drops_what_is_left_at_its_timeout() -> None:
    owner = Owner()
    ln = lane(owner)
    owner.gate.clear()
    ln.put(1)
    assert owner.running.wait(5)
    ln.put(2)
    threading.Timer(0.1, owner.gate.set).start()
    assert ln.close(5, drop_queued=False)
    assert owner.ran == Counter({1: 1, 2: 1}) and not owner.failed


def test_an_owner_bug_in_fail_is_the_guards_never_the_lanes_thread() -> None:
    guard = Guard()

    def fail(jobs: list[int], reason: Failure, error: BaseException | None) -> None:
        raise RuntimeError("owner bug")

    def run(batch: list[int]) -> None:
        raise StoreUnavailable("down")

    ln: Lane[int] = Lane("test", run, fail, capacity=10, guard=guard)
    ln.put(1)
    ln.put(2)
    assert ln.close(5, drop_queued=False)
    assert guard.errors["test lane"] >= 1
    assert ln.put(3) is Failure.CLOSED


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.sampled_from([None, 0.0, 5.0])),
                min_size=1, max_size=30),
       st.booleans())
def test_every_job_is_resolved_exactly_once(plan: list[tuple[int, bool, float | None]], drop: bool) -> None:
    """Whatever the batches, errors, deadlines and close: each job put is run once or failed
    once (never both, never neither), and a refused one is the caller's."""
    errors = {i: StoreUnavailable("down") if kind == 1 else ValueError("bug")
              for i, (kind, _, _) in enumerate(plan) if kind in (1, 2)}
    owner = Owner(raise_for=errors)
    ln = lane(owner, capacity=8)
    refused = set()
    for i, (_, pause, timeout) in enumerate(plan):
        if ln.put(i, timeout=timeout) is not None:
            refused.add(i)
        if pause:
            time.sleep(0.001)
    assert ln.close(5, drop_queued=drop)
    ran = set(owner.ran)
    failed = set(owner.failed)
    assert all(n == 1 for n in owner.ran.values())
    assert not ran & failed
    assert ran | failed | refused == set(range(len(plan)))
    assert not (ran | failed) & refused
