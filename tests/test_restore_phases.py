"""A request's restore (``vllm/request.py``): its phases, their transitions, and the bytes read
ahead that only the answered phases hold. Pure: no vault, no vLLM."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.vllm import request as rq
from prefixvault.vllm.in_step import ReadAhead, ReadAheadBudget
from prefixvault.vllm.request import Restore, WrongPhase

#: Every transition, with what it needs; each is tried in every phase.
MOVES = ("look_up", "lands", "wait_for_save", "answer", "answer_ahead", "hand_over", "take_back",
         "let_go", "ask_agreed", "allocated", "load", "restart", "give_up", "finish")


def _land(future: Future[Any], budget: ReadAheadBudget) -> None:
    """The lookup lane answers, with bytes read ahead (counted in the budget), if not yet."""
    if not future.done():
        assert budget.take(100)
        future.set_result(([], None, ReadAhead(objects={}, nbytes=100, budget=budget)))


def _move(r: Restore, move: str, budget: ReadAheadBudget, futures: list[Future[Any]] | None = None) -> None:
    if move == "look_up":
        future: Future[Any] = Future()
        r.look_up(future, local=0, now=0.0)
        if futures is not None:
            futures.append(future)
    elif move == "lands":
        if futures:
            _land(futures[-1], budget)
    elif move == "wait_for_save":
        r.wait_for_save()
    elif move == "answer":
        r.answer(32)
    elif move == "answer_ahead":
        assert budget.take(100)
        ahead = ReadAhead(objects={}, nbytes=100, budget=budget)
        try:
            r.answer(32, ahead)
        except WrongPhase:
            ahead.release()  # (the caller's, when no phase took it)
            raise
    elif move == "hand_over":
        r.hand_over(token=1, start=0)
    elif move == "take_back":
        r.take_back()
    elif move == "let_go":
        r.keep_read_ahead(False)
    elif move == "ask_agreed":
        r.ask_agreed(16)
    elif move == "allocated":
        r.allocated()
    elif move == "load":
        r.load()
    elif move == "restart":
        r.restart()
    elif move == "give_up":
        r.give_up()
    elif move == "finish":
        r.finish()


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(MOVES), max_size=30))
def test_bytes_read_ahead_are_held_only_by_an_answered_restore(moves: list[str]) -> None:
    """Whatever vLLM asks in whatever order, the bytes a restore holds are exactly those of its
    phase's ``ReadAhead``: every transition out of the answered phases lets go of them."""
    budget = ReadAheadBudget(1 << 20)
    r = Restore()
    for move in moves:
        before = type(r.phase)
        try:
            _move(r, move, budget)
        except WrongPhase:
            assert type(r.phase) is before  # a refused transition changes nothing
        ahead = r.read_ahead
        assert budget.held == (ahead.nbytes if ahead is not None else 0), (move, r)
        assert ahead is None or isinstance(r.phase, rq.Answered | rq.HandedOver)
    r.finish()
    assert budget.held == 0 and isinstance(r.phase, rq.Computed)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(MOVES), max_size=30))
def test_bytes_a_lookup_reads_ahead_come_back_whenever_it_lands(moves: list[str]) -> None:
    """A lookup that lands after its request moved on (it finished, was aborted, or its lookup
    timed out and was answered as a miss) still gives its bytes back: no interleaving of the
    lane's answers with vLLM's calls leaks any of the read-ahead budget."""
    budget = ReadAheadBudget(1 << 20)
    r = Restore()
    futures: list[Future[Any]] = []
    for move in moves:
        before = type(r.phase)
        try:
            _move(r, move, budget, futures)
        except WrongPhase:
            assert type(r.phase) is before
        ahead = r.read_ahead
        assert budget.held >= (ahead.nbytes if ahead is not None else 0)
    r.finish()
    for future in futures:  # every lookup lands at last
        _land(future, budget)
    assert budget.held == 0, (moves, r)


def test_each_transition_checks_where_it_comes_from() -> None:
    r = Restore()
    with pytest.raises(WrongPhase):
        r.answer(16)  # not looked up
    with pytest.raises(WrongPhase):
        r.load()
    r.look_up(Future(), local=0, now=1.0)
    with pytest.raises(WrongPhase):
        r.look_up(Future(), local=0, now=2.0)  # one lookup at a time
    r.wait_for_save()
    assert isinstance(r.phase, rq.WaitingForSave) and r.phase.since == 1.0 and r.waited_for_save
    r.look_up(Future(), local=16, now=3.0)
    assert isinstance(r.phase, rq.LookingUp)
    r.answer(48)
    assert r.hit == 48 and not r.sync and r.loaded == 0
    r.load()
    assert isinstance(r.phase, rq.Loading) and r.loaded == 48 and r.loads == 1 and r.hit == 0
    with pytest.raises(WrongPhase):
        r.hand_over(token=1, start=0)
    r.restart()
    assert isinstance(r.phase, rq.New) and r.loaded == 0 and r.loads == 1


def test_a_hand_over_keeps_its_bytes_until_vllm_allocates_or_asks_again() -> None:
    budget = ReadAheadBudget(1000)
    assert budget.take(100)
    r = Restore()
    r.look_up(Future(), local=0, now=0.0)
    r.answer(32, ReadAhead(objects={}, nbytes=100, budget=budget))
    r.hand_over(token=7, start=16)
    assert r.sync and isinstance(r.phase, rq.HandedOver) and r.phase.token == 7 and budget.held == 100
    assert r.take_back() and not r.sync and budget.held == 100  # asked again: answered anew
    assert not r.take_back()
    r.hand_over(token=8, start=16)
    r.load()
    assert budget.held == 0 and r.loaded == 32


def test_asked_again_for_the_agreed_hit_the_bytes_stay() -> None:
    """A divergent offer asked again for vLLM's agreed hit is answered from the same lookup,
    bytes read ahead included (a synchronous load from the agreed hit)."""
    budget = ReadAheadBudget(1000)
    assert budget.take(10)
    r = Restore()
    r.look_up(Future(), local=0, now=0.0)
    ahead: Any = ReadAhead(objects={}, nbytes=10, budget=budget)
    r.answer(64, ahead)
    r.ask_agreed(32)
    assert isinstance(r.phase, rq.Answered) and r.phase.asked_agreed == 32 and r.read_ahead is ahead
    r.allocated()
    assert isinstance(r.phase, rq.Answered) and r.phase.asked_agreed == 0 and budget.held == 0


def test_what_a_restore_took_is_timed_from_its_lookup_to_its_reply_and_its_answer() -> None:
    """``asked_at`` when its first lookup is queued, ``replied_at`` when the lookup lane
    replies, ``answered_at`` when a step takes the answer (what a restore costs is measured
    from them, ``Restores._answered_after``); a restart clears all three."""
    r = Restore()
    future: Future[Any] = Future()
    r.look_up(future, local=0, now=5.0)
    assert (r.asked_at, r.replied_at, r.answered_at) == (5.0, None, None)
    future.set_result(([], None, None))
    assert r.replied_at is not None and r.answered_at is None
    replied = r.replied_at
    r.answer(32)
    assert r.answered_at is not None and r.answered_at >= replied
    r.allocated()
    r.load()
    r.restart()
    assert (r.asked_at, r.replied_at, r.answered_at) == (None, None, None)


def test_a_restore_is_charged_the_wait_for_the_step_that_takes_its_answer_up_to_a_busy_step() -> None:
    """Waiting for the step that takes an answer is the restore's cost; a longer wait is for
    the token budget, which a request computed instead would wait for as well."""
    from types import SimpleNamespace

    from prefixvault.costs import RestoreCosts
    from prefixvault.vllm.restores import Restores

    now = [100.0]
    costs = RestoreCosts(clock=lambda: now[0])
    for _ in range(10):  # 100 ms steps
        costs.step_planned(500, 500)
        now[0] += 0.1
    owner: Any = SimpleNamespace(costs=costs)
    r = Restore()
    r.replied_at, r.answered_at = 10.0, 10.06
    assert Restores._answered_after(owner, r, now=11.0) == 10.06  # taken by the next step
    r.answered_at = 10.5  # held back by the budget for steps more
    assert Restores._answered_after(owner, r, now=11.0) == pytest.approx(10.1)
