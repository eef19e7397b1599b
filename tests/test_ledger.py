"""Saves in flight (``SavesInFlight``): pure bookkeeping, checked without threads or a store."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.vllm.ledger import SavesInFlight
from prefixvault.vllm.metadata import SavesSettled


def test_a_save_holds_its_boundaries_until_every_rank_settled_it() -> None:
    ledger = SavesInFlight(ranks=2)
    ledger.add("1:a", [b"x", b"y"], now=0.0, request="a", parent=16)
    ledger.add("1:b", [b"y"], now=0.0)  # a held save: no request to send back
    assert ledger.names_any([b"q", b"y"]) and ledger.hashes == Counter({b"y": 2, b"x": 1})
    assert ledger.settle(SavesSettled(Counter({"1:a": 1}), Counter({"1:a": 1}))) == [("a", 16)]
    assert ledger.names_any([b"x"])  # one rank of two
    assert ledger.settle(SavesSettled(Counter({"1:a": 1, "1:b": 2}), Counter())) == []
    assert not ledger.names_any([b"x", b"y"]) and not ledger.hashes and len(ledger) == 0


def test_a_save_whose_report_was_lost_stops_holding_lookups() -> None:
    ledger = SavesInFlight(ranks=1)
    ledger.add("1:a", [b"x"], now=0.0)
    ledger.add("2:a", [b"x"], now=50.0)
    assert ledger.forget_older_than(70.0, age=60.0) == 1
    assert ledger.hashes == Counter({b"x": 1})


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.lists(st.sampled_from([b"a", b"b", b"c"]), max_size=3),
              st.booleans()),
    st.tuples(st.just("settle"), st.integers(0, 5), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("forget"), st.integers(0, 40)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_hashes_are_exactly_the_boundaries_of_the_saves_in_flight(plan: list[tuple[object, ...]]) -> None:
    ledger = SavesInFlight(ranks=2)
    live: dict[str, tuple[list[bytes], int, float, str, int]] = {}
    for t, op in enumerate(plan):
        if op[0] == "add":
            _, n, boundaries, owned = op
            sid = f"s{n}"
            assert isinstance(boundaries, list) and isinstance(owned, bool)
            ledger.add(sid, boundaries, float(t), "r" if owned else "", 8 if owned else -1)
            live[sid] = (boundaries, 2, float(t), "r" if owned else "", 8 if owned else -1)
        elif op[0] == "settle":
            _, n, ranks, failed = op
            sid = f"s{n}"
            assert isinstance(ranks, int)
            got = ledger.settle(SavesSettled(Counter({sid: ranks}), Counter({sid: 1} if failed else {})))
            entry = live.get(sid)
            assert got == ([("r", 8)] if failed and entry is not None and entry[3] else [])
            if entry is not None:
                if entry[1] > ranks:
                    live[sid] = (entry[0], entry[1] - ranks, *entry[2:])
                else:
                    del live[sid]
        else:
            age = float(op[1])
            for sid in [s for s, e in live.items() if len(plan) - e[2] > age]:
                del live[sid]
            ledger.forget_older_than(float(len(plan)), age)
        want = Counter(h for e in live.values() for h in e[0])
        assert ledger.hashes == want and len(ledger) == len(live)
