"""The save staging ring: reservations never overlap while held, the budget is never
exceeded, and every byte is reusable once everything is released (property tests)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.staging import Reservation, StagingRing

ops = st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)), max_size=80)


@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(1, 64), steps=ops, in_order=st.booleans())
def test_reservations_never_overlap_and_all_bytes_come_back(
    capacity: int, steps: list[tuple[bool, int, int]], in_order: bool
) -> None:
    ring = StagingRing(capacity)
    live: list[Reservation] = []
    for reserve, n, pick in steps:
        if reserve or not live:
            r = ring.reserve(n)
            if r is None:
                continue
            assert r.nbytes == n and r.offset >= 0 and r.offset + n <= capacity
            for other in live:
                assert r.offset + n <= other.offset or other.offset + other.nbytes <= r.offset, "overlap"
            live.append(r)
        else:
            r = live.pop(0 if in_order else pick % len(live))
            ring.release(r)
        held = sum(x.nbytes for x in live)
        assert held <= ring.in_use <= capacity
    for r in live:
        ring.release(r)
    assert ring.in_use == 0
    assert ring.reserve(capacity) is not None  # the whole buffer is one gap again


def test_a_full_ring_refuses_and_frees_in_order() -> None:
    ring = StagingRing(100)
    a, b = ring.reserve(60), ring.reserve(30)
    assert a is not None and b is not None
    assert ring.reserve(20) is None  # 10 bytes left at the end, none before a
    ring.release(b)  # newer one first: its bytes wait for a
    assert ring.reserve(20) is None
    ring.release(a)
    c = ring.reserve(100)
    assert c is not None and c.offset == 0


def test_wrapping_reuses_the_start_once_it_is_free() -> None:
    ring = StagingRing(100)
    a, b = ring.reserve(40), ring.reserve(40)
    assert a is not None and b is not None
    ring.release(a)
    c = ring.reserve(30)  # 20 left at the end: wraps to the start
    assert c is not None and c.offset == 0
    assert ring.in_use == 40 + 30 + 20  # the skipped end counts until b is released
    ring.release(b)
    assert ring.in_use == 30
    d = ring.reserve(70)
    assert d is not None and d.offset == 30


def test_bytes_written_into_a_reservation_stay_until_released() -> None:
    ring = StagingRing(1 << 12)
    held = []
    rng = random.Random(0)
    for i in range(200):
        r = ring.reserve(rng.randint(1, 300))
        if r is None:
            ring.release(held.pop(0)[0])
            continue
        r.view[:] = bytes([i % 251]) * r.nbytes
        held.append((r, i % 251))
        for r2, v in held:
            assert bytes(r2.view) == bytes([v]) * r2.nbytes
        if len(held) > 8:
            ring.release(held.pop(0)[0])
