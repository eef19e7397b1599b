"""What a restore costs against computing its tokens (``prefixvault.costs``): the estimates as
measured from steps, lookups and loads, and the judgments made from them."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from prefixvault.costs import EXPLORE_S, MAX_STEP_S, Judgment, RestoreCosts, full_step_s_per_token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def measured(compute_s_per_token: float = 1e-4, step_tokens: int = 1000, lookup_s: float = 0.02,
             steps: int = 30) -> tuple[RestoreCosts, Clock]:
    """Costs measured from ``steps`` prefill steps of ``step_tokens`` tokens and lookups of
    ``lookup_s``; exploring put off (the clock does not move past ``EXPLORE_S``)."""
    clock = Clock()
    costs = RestoreCosts(clock=clock)
    for _ in range(steps):
        costs.step_planned(step_tokens, step_tokens)
        clock.now += compute_s_per_token * step_tokens
    for _ in range(steps):
        costs.looked_up(lookup_s)
    return costs, clock


def test_nothing_is_judged_before_the_engine_is_measured() -> None:
    costs = RestoreCosts()
    assert costs.restore(10, 1 << 30, in_step=False) is Judgment.UNKNOWN
    assert costs.look_up(10, in_step=False) is Judgment.UNKNOWN
    assert costs.wait_for_lookups(0.005) == 0.005
    assert costs.estimates().figures() == {}


def test_estimates_come_from_prefill_steps_lookups_and_loads() -> None:
    costs, _ = measured(compute_s_per_token=1e-4, step_tokens=1000, lookup_s=0.02)
    est = costs.estimates()
    assert est.compute_s_per_token is not None and math.isclose(est.compute_s_per_token, 1e-4)
    assert est.step_s is not None and math.isclose(est.step_s, 0.1)
    assert est.lookup_s is not None and math.isclose(est.lookup_s, 0.02)
    assert est.transfer_s_per_byte is None
    costs.loaded(1 << 20, 0.02 + 0.001)  # 1 MiB in a millisecond past one round trip
    est = costs.estimates()
    assert est.transfer_s_per_byte is not None and math.isclose(est.transfer_s_per_byte, 0.001 / (1 << 20))
    assert costs.estimates().figures() == {"compute_us_per_token": 100, "step_us": 100000,
                                           "lookup_us": 20000, "load_bytes_per_s": 1000 << 20}


def test_decode_steps_and_idle_gaps_do_not_count_as_prefill() -> None:
    clock = Clock()
    costs = RestoreCosts(clock=clock)
    for _ in range(5):  # decode steps: 8 requests, one token each, 20 ms
        costs.step_planned(8, 0)
        clock.now += 0.02
    costs.step_planned(0, 0)  # the engine goes idle...
    clock.now += MAX_STEP_S + 1
    costs.step_planned(500, 500)  # ...and wakes up: the gap was no step
    assert costs.estimates().compute_s_per_token is None
    est = costs.estimates()
    assert est.step_s is not None and math.isclose(est.step_s, 0.02)
    clock.now += 0.05
    costs.step_planned(500, 500)
    est = costs.estimates()
    assert est.compute_s_per_token is not None and math.isclose(est.compute_s_per_token, 0.05 / 500)


def test_a_short_prefill_step_weighs_by_its_tokens() -> None:
    """Steps of 500 tokens in 50 ms and of 50 in 15 ms (most of it the step's fixed cost): a
    token costs their time over their tokens, ~0.12 ms, not the mean of their 0.1 and 0.3 ms a
    token (which would judge a computed request twice as slow as a full step runs it)."""
    clock = Clock()
    costs = RestoreCosts(clock=clock)
    for _ in range(40):
        for tokens, seconds in ((500, 0.05), (50, 0.015)):
            costs.step_planned(tokens, tokens)
            clock.now += seconds
    per_token = costs.estimates().compute_s_per_token
    assert per_token is not None and math.isclose(per_token, 0.065 / 550, rel_tol=0.1)


def test_a_restore_pays_where_computing_its_tokens_takes_longer() -> None:
    # 0.1 ms a token, 100 ms a step, 20 ms a lookup: a load beside the steps costs ~170 ms once
    # looked up (a load's round trip, a step and the half step its last costs), ~70 in the step
    costs, _ = measured()
    assert costs.restore(2000, 0, in_step=False) is Judgment.PAYS  # 200 ms of prefill
    assert costs.restore(1000, 0, in_step=False) is Judgment.NOT_WORTH_IT  # 100 ms
    assert costs.restore(1000, 0, in_step=True) is Judgment.PAYS  # no step waited: 20 ms
    costs.loaded(1 << 30, 0.02 + 1.0)  # 1 GiB/s
    assert costs.restore(2000, 1 << 30, in_step=False) is Judgment.NOT_WORTH_IT  # + 1 s of transfer
    assert costs.restore(20000, 1 << 30, in_step=False) is Judgment.PAYS  # 2 s of prefill


def test_a_request_that_cannot_pay_for_the_round_trips_is_not_looked_up() -> None:
    costs, _ = measured(lookup_s=0.02)  # a lookup, a load, a step and half a step: 190 ms
    assert costs.look_up(1500, in_step=False) is Judgment.NOT_WORTH_IT
    assert costs.look_up(2000, in_step=False) is Judgment.PAYS
    assert costs.look_up(500, in_step=True) is Judgment.NOT_WORTH_IT  # 90 ms
    assert costs.look_up(1000, in_step=True) is Judgment.PAYS


def test_a_request_whose_longest_hit_cannot_pay_for_its_bytes_is_not_looked_up() -> None:
    costs, _ = measured(lookup_s=0.02)  # in the step: 40 ms of round trips and half a 100 ms step
    costs.loaded(1 << 30, 0.02 + 1.0)  # 1 GiB/s
    assert costs.look_up(1000, in_step=True) is Judgment.PAYS  # 100 ms of prefill, no bytes
    assert costs.look_up(1000, in_step=True, nbytes=100 << 20) is Judgment.NOT_WORTH_IT  # + ~100 ms
    assert costs.look_up(5000, in_step=True, nbytes=100 << 20) is Judgment.PAYS


def test_a_restore_ends_at_the_junction_where_the_next_request_saves_more_than_this_one_pays() -> None:
    costs = RestoreCosts()
    assert not costs.stop_at_junction(100, 0, in_step=True)  # not measured: the whole hit
    costs, _ = measured(lookup_s=0.2)  # in the step: 400 ms of round trips and half a 100 ms step
    # the next request saves 450 ms less the prefill; this one pays the prefill and a step
    assert costs.stop_at_junction(1000, 0, in_step=True)  # 100 ms of prefill: saves 350, pays 200
    assert costs.look_up(1000, in_step=True) is Judgment.NOT_WORTH_IT
    # near the threshold no cut, though a request holding the junction would not look up
    assert not costs.stop_at_junction(2000, 0, in_step=True)  # saves 250, pays 300
    assert costs.look_up(2000, in_step=True) is Judgment.NOT_WORTH_IT
    assert not costs.stop_at_junction(5000, 0, in_step=True)  # 500 ms: restoring pays
    costs.judge = False  # restore_when: always
    assert not costs.stop_at_junction(1000, 0, in_step=True)


def test_always_restores_whatever_the_costs() -> None:
    costs, _ = measured(lookup_s=5.0)
    costs.judge = False
    assert costs.look_up(1, in_step=False) is Judgment.PAYS
    assert costs.restore(1, 1 << 40, in_step=False) is Judgment.PAYS


def test_a_judgment_against_restoring_is_put_aside_once_per_period_to_measure_again() -> None:
    costs, clock = measured(lookup_s=1.0)
    assert costs.look_up(10, in_step=False) is Judgment.NOT_WORTH_IT  # not before one period
    clock.now += EXPLORE_S
    assert costs.look_up(10, in_step=False) is Judgment.EXPLORE
    assert costs.look_up(10, in_step=False) is Judgment.NOT_WORTH_IT
    assert costs.restore(10, 0, in_step=False) is Judgment.EXPLORE  # (its own period)
    assert costs.restore(10, 0, in_step=False) is Judgment.NOT_WORTH_IT
    clock.now += EXPLORE_S
    assert costs.look_up(10, in_step=False) is Judgment.EXPLORE


def test_a_step_waits_for_lookups_only_where_a_restore_a_step_sooner_pays_it_back() -> None:
    fast, _ = measured(lookup_s=0.0002)  # 100 ms steps: 10 ms may be waited, 5 ms budget
    assert fast.wait_for_lookups(0.005) == 0.005
    slow, _ = measured(lookup_s=0.02)  # a round trip longer than the budget: no wait
    assert slow.wait_for_lookups(0.005) == 0.0
    short_steps, _ = measured(compute_s_per_token=1e-6, lookup_s=0.0002)  # 1 ms steps: 0.1 ms
    assert short_steps.wait_for_lookups(0.005) == 0.0


@given(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(0, 1 << 32), st.booleans(),
       st.floats(1e-7, 1e-2), st.floats(1e-5, 0.5))
def test_more_tokens_or_fewer_bytes_never_turn_a_restore_that_pays_into_one_that_does_not(
        tokens: int, more: int, nbytes: int, in_step: bool, compute: float, lookup: float) -> None:
    costs, _ = measured(compute_s_per_token=compute, lookup_s=lookup)
    costs.loaded(1 << 20, lookup + 0.001)
    if costs.restore(tokens, nbytes, in_step) is Judgment.PAYS:
        assert costs.restore(tokens + more, nbytes, in_step) is Judgment.PAYS
        assert costs.restore(tokens, nbytes // 2, in_step) is Judgment.PAYS
    if costs.look_up(tokens, in_step) is Judgment.PAYS:
        assert costs.look_up(tokens + more, in_step) is Judgment.PAYS


def test_computing_takes_longer_for_a_request_that_shares_the_steps_prefill() -> None:
    """Six requests prefilling together each get a sixth of a step's tokens: a token the store
    saves one of them is worth six of the engine's per-token time."""
    clock = Clock()
    alone = RestoreCosts(clock=clock)
    shared = RestoreCosts(clock=clock)
    for _ in range(30):
        alone.step_planned(512, 512, 1)
        shared.step_planned(512, 512, 6)
        clock.now += 0.05
    a, s = alone.estimates().compute_s_per_token, shared.estimates().compute_s_per_token
    assert a is not None and s is not None and math.isclose(s, 6 * a)
    for costs in (alone, shared):
        for _ in range(30):
            costs.looked_up(0.02)
    assert alone.restore(500, 0, in_step=False) is Judgment.NOT_WORTH_IT  # 49 ms of prefill, 95 of load
    assert shared.restore(500, 0, in_step=False) is Judgment.PAYS  # 293 ms


def test_what_restores_took_on_this_engine_replaces_the_prior() -> None:
    """Before any restore, its fixed cost is two round trips and (beside the steps) a step; once
    restores are measured, what they took from lookup to when they could be scheduled, less
    their transfer (in the step that asked: to a step taking the answer, the transfer still to
    come); half a step on top either way (``LAST_STEP_SHARE``)."""
    costs, _ = measured(compute_s_per_token=1e-4, lookup_s=0.02)  # 100 ms steps
    assert math.isclose(costs.estimates().restore_s(0, in_step=False), 0.19)
    assert costs.look_up(2000, in_step=False) is Judgment.PAYS  # 200 ms of prefill
    costs.loaded(1 << 20, 0.02 + 0.01)  # 10 ms a MiB past the round trip
    for _ in range(40):
        costs.restored(0.35 + 0.01, 1 << 20, in_step=False)  # each waited 350 ms more than its bytes
    est = costs.estimates()
    assert est.restore_s_beside is not None and math.isclose(est.restore_s_beside, 0.35, rel_tol=1e-3)
    assert est.restore_s_in_step is None
    assert math.isclose(est.restore_s(1 << 20, in_step=False), 0.41, rel_tol=1e-3)
    assert math.isclose(est.load_s(1 << 20, in_step=False), 0.39, rel_tol=1e-3)  # (the lookup answered)
    assert costs.look_up(2000, in_step=False) is Judgment.NOT_WORTH_IT
    assert costs.look_up(5000, in_step=False) is Judgment.PAYS
    assert costs.look_up(1000, in_step=True) is Judgment.PAYS  # in the step: not measured, the prior
    assert "restore_us" in est.figures() and "restore_in_step_us" not in est.figures()
    for _ in range(40):
        costs.restored(0.03, 1 << 20, in_step=True)  # answered in 30 ms; its load in the step to come
    est = costs.estimates()
    assert est.restore_s_in_step is not None and math.isclose(est.restore_s_in_step, 0.03, rel_tol=1e-3)
    assert math.isclose(est.restore_s(1 << 20, in_step=True), 0.09, rel_tol=1e-3)  # its transfer, half a step


def test_short_prefill_steps_cost_a_token_what_a_full_step_does_where_the_budget_is_known() -> None:
    """Steps that take 8 ms of fixed cost plus 40 µs a prefill token, measured only on
    restored requests' short chunks (200 tokens and 6 decodes, 16 ms) between decode steps (8
    ms): the tokens a request would compute instead fill whole steps of 512, which cost 28.48
    ms, so a token costs 55.6 µs, not the short steps' 78. Without the budget (or with no step
    free of prefill measured) the estimate stays the steps' time over their tokens. A budget
    far past the chunks measured is read at four times their tokens (``EXTRAPOLATE_AT_MOST``):
    on a GPU a step's time is flat for short chunks, and the line does not hold that far."""
    clock = Clock()
    budgeted = RestoreCosts(clock=clock, step_budget=512)
    blind = RestoreCosts(clock=clock)
    far = RestoreCosts(clock=clock, step_budget=8192)
    for _ in range(40):
        for tokens, prefill, seconds in ((6, 0, 0.008), (206, 200, 0.008 + 200 * 40e-6)):
            for costs in (budgeted, blind, far):
                costs.step_planned(tokens, prefill)
            clock.now += seconds
    full, ratio = budgeted.estimates().compute_s_per_token, blind.estimates().compute_s_per_token
    assert full is not None and math.isclose(full, (0.008 + 512 * 40e-6) / 512, rel_tol=1e-3)
    assert ratio is not None and math.isclose(ratio, 0.016 / 206, rel_tol=1e-3)
    capped = far.estimates().compute_s_per_token
    assert capped is not None and math.isclose(capped, (0.008 + 800 * 40e-6) / 800, rel_tol=1e-3)


@given(st.floats(1e-4, 10.0), st.integers(1, 8192), st.integers(0, 64),
       st.one_of(st.none(), st.floats(0.0, 20.0)), st.one_of(st.none(), st.integers(1, 8192)))
def test_a_full_steps_token_costs_between_the_step_over_its_budget_and_the_steps_ratio(
        prefill_s: float, prefill_tokens: int, decodes: int, fixed_s: float | None,
        budget: int | None) -> None:
    step_tokens = prefill_tokens + decodes
    per_token = full_step_s_per_token(prefill_s, step_tokens, prefill_tokens, fixed_s, budget)
    ratio = prefill_s / step_tokens
    assert per_token <= ratio
    if budget is None or fixed_s is None or prefill_tokens >= budget:
        assert per_token == ratio
    elif step_tokens <= budget:
        assert per_token >= prefill_s / budget * (1 - 1e-9)


def test_a_steps_synchronous_loads_are_a_restores_cost_not_its_prefill() -> None:
    """Every prefill step also writes a synchronous load (the engine restores every request):
    the 6 ms each spends writing 3 MiB leaves the prefill rate as it is without loads, and is
    what a synchronous load costs a restore in its step (2 µs a KiB), in place of the rate of
    loads beside the steps."""
    clock = Clock()
    costs = RestoreCosts(clock=clock)
    plain = RestoreCosts(clock=clock)
    for _ in range(40):
        for c in (costs, plain):
            c.step_planned(300, 300)
        clock.now += 0.03 + 0.006
        costs.loaded_in_step(3 << 20, 0.006)  # reported after the step, before the next is planned
        plain.step_planned(300, 300)
        costs.step_planned(300, 300)
        clock.now += 0.03
    loading, computing = costs.estimates().compute_s_per_token, plain.estimates().compute_s_per_token
    assert loading is not None and computing is not None and math.isclose(loading, 0.1 / 1000, rel_tol=1e-6)
    assert computing > loading  # the same steps, the loads counted as prefill
    costs.loaded(1 << 20, 0.5)  # loads beside the steps: a slower rate, theirs alone
    for _ in range(40):
        costs.restored(0.03, 3 << 20, in_step=True)
    est = costs.estimates()
    assert est.in_step_s_per_byte is not None and math.isclose(est.in_step_s_per_byte, 0.002 / (1 << 20))
    step = est.step_s
    assert step is not None
    assert math.isclose(est.restore_s(3 << 20, in_step=True), 0.03 + 0.5 * step + 0.006, rel_tol=1e-6)
    assert est.figures()["load_in_step_bytes_per_s"] == 500 << 20


def test_a_synchronous_load_not_written_still_costs_its_step_not_its_prefill() -> None:
    """A load that failed in the step (its objects gone, a read past its deadline) took the
    step's time all the same: that time is no prefill either, and no rate. A step the loads'
    time outlasts (reports of another step, under async scheduling) is no sample at all."""
    clock = Clock()
    costs = RestoreCosts(clock=clock)
    for _ in range(40):
        costs.step_planned(300, 300)
        clock.now += 0.03 + 0.02
        costs.loaded_in_step(0, 0.02)
    costs.step_planned(300, 300)
    est = costs.estimates()
    assert est.compute_s_per_token is not None and math.isclose(est.compute_s_per_token, 1e-4)
    assert est.in_step_s_per_byte is None
    outlasted = RestoreCosts(clock=clock)
    for _ in range(3):
        outlasted.step_planned(300, 300)
        clock.now += 0.03
        outlasted.loaded_in_step(1 << 20, 0.5)
    assert outlasted.estimates().compute_s_per_token is None
