"""Admission: which candidate boundaries each policy stores, and how ``reuse`` learns."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixvault.admission import SHARING_WINDOW, Admission, Kind, Policy, ReuseTracker

K = Kind
C = K.CHECKPOINT
ALL = [K.STEP_END, K.PROMPT_END | K.STEP_END | C, K.JUNCTION | K.STEP_END | C, K.OUTPUT,
       K.OUTPUT | K.SEQUENCE_END, K.PROMPT_END | K.SEQUENCE_END | K.STEP_END, C]


@pytest.mark.parametrize(("policy", "expected"), [
    ("steps", [True, True, True, True, True, True, True]),
    ("checkpoints", [False, True, True, False, False, False, True]),
    ("marconi", [False, False, True, False, True, True, False]),
    ("reuse", [False, False, True, False, True, True, False]),  # no evidence yet: admits sequence ends
])
def test_what_each_policy_admits(policy: str, expected: list[bool]) -> None:
    a = Admission.parse(policy)
    assert [a.admits(k, 4096, 0) for k in ALL] == expected


def test_interval_admits_checkpoints_and_one_step_end_per_interval() -> None:
    a = Admission.parse("interval:1000")
    assert a.policy is Policy.INTERVAL and a.interval == 1000
    assert a.admits(K.CHECKPOINT, 300, 200)
    assert not a.admits(K.STEP_END, 900, 100)
    assert a.admits(K.STEP_END, 1100, 900)
    assert a.admits(K.OUTPUT, 2000, 1100)


@pytest.mark.parametrize("bad", ["", "interval:0", "interval:x", "lru", "STEPS"])
def test_bad_policies_are_refused_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError, match=r"steps, interval:N, checkpoints, marconi, reuse|positive"):
        Admission.parse(bad)


def test_reuse_stops_storing_sequence_ends_when_nothing_is_shared() -> None:
    a = Admission.parse("reuse")
    for _ in range(SHARING_WINDOW):
        a.arrived(False)
    decisions = [a.admits(K.SEQUENCE_END, 4096, 0) for _ in range(4 * a.probe_every)]
    assert sum(decisions) == 4  # a probe in every probe_every
    assert a.admits(K.JUNCTION, 2048, 0)  # a junction is sharing seen: always


def test_reuse_without_lookups_admits_as_marconi() -> None:
    """A producer that only saves never sees a restore: it cannot learn, so it does not."""
    a = Admission(Policy.REUSE, observes=False)
    for i in range(200):
        a.arrived(False)
        assert a.admits(K.SEQUENCE_END, 4096, 0)
        a.admitted(i.to_bytes(4, "big"), K.SEQUENCE_END)
    assert not a.admits(K.STEP_END, 4096, 0)


def test_reuse_stops_storing_sequence_ends_nobody_restores() -> None:
    a = Admission.parse("reuse")
    for _ in range(SHARING_WINDOW):
        a.arrived(True)
    kept = 0
    for i in range(200):
        if a.admits(K.SEQUENCE_END, 4096, 0):
            kept += 1
            a.admitted(i.to_bytes(4, "big"), K.SEQUENCE_END)
    assert a.tracker.rate(K.SEQUENCE_END) < a.min_rate
    assert kept < a.tracker.horizon + 200 // a.probe_every + 2


def test_reuse_keeps_storing_sequence_ends_that_are_restored() -> None:
    a = Admission.parse("reuse")
    for i in range(300):
        a.arrived(True)
        assert a.admits(K.SEQUENCE_END, 4096, 0)
        key = i.to_bytes(4, "big")
        a.admitted(key, K.SEQUENCE_END)
        if i % 3:  # two in three are restored, a few admissions later
            a.restored(key)
    assert a.tracker.rate(K.SEQUENCE_END) > 0.5


def test_a_tracker_settles_each_admission_once() -> None:
    t = ReuseTracker(horizon=2, decay=1.0)
    t.admitted(b"a", K.SEQUENCE_END)
    t.restored(b"a")
    t.restored(b"a")  # already settled
    t.admitted(b"b", K.SEQUENCE_END)
    t.admitted(b"c", K.SEQUENCE_END)
    t.admitted(b"d", K.SEQUENCE_END)  # b settles unreused (two admissions went by)
    assert t.rate(K.SEQUENCE_END) == 0.5
    t.admitted(b"x", K.JUNCTION)  # junctions are not learned
    assert t.rate(K.JUNCTION) == 1.0
    t.restored(b"b")  # restored after it settled: a reuse after all
    assert t.rate(K.SEQUENCE_END) == 1.0
    t.restored(b"b")
    assert t.rate(K.SEQUENCE_END) == 1.0


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=200))
def test_the_reuse_rate_is_a_share(events: list[tuple[bool, int]]) -> None:
    t = ReuseTracker(horizon=5)
    for restore, n in events:
        key = n.to_bytes(2, "big")
        if restore:
            t.restored(key)
        else:
            t.admitted(key, K.SEQUENCE_END)
        assert 0.0 <= t.rate(K.SEQUENCE_END) <= 1.0
        assert len(t._open) <= 5
