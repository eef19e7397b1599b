"""How the engine tests compare a completion with cold (``scenarios.engine``): these helpers decide
what "equal to cold" and "a near tie flipped" mean, so they are tested on their own."""

from __future__ import annotations

import math

from prefixvault.scenarios.engine import Completion, divergence, identical, last_error, max_logprob_diff


def completion(ids: list[int], logprobs: list[dict[int, float]]) -> Completion:
    return Completion(ids, logprobs, cached_tokens=0)


COLD = completion([5, 7, 9], [{5: -0.5, 6: -1.0}, {7: -0.70, 8: -0.72}, {9: -0.1, 1: -3.0}])


def test_same_completion_is_identical_and_does_not_part() -> None:
    same = completion(list(COLD.token_ids), [dict(x) for x in COLD.logprobs])
    assert identical(COLD, same)
    d = divergence(COLD, same)
    assert (d.at, d.drift, d.margin) == (3, 0.0, None)


def test_a_near_tie_flip_shows_its_margin_and_the_drift_up_to_it() -> None:
    flipped = completion([5, 8, 2], [{5: -0.49, 6: -1.02}, {8: -0.69, 7: -0.71}, {2: -0.2}])
    d = divergence(COLD, flipped)
    assert d.at == 1
    # positions 0 and 1 follow the same ids in both runs; position 2 follows other ids
    assert math.isclose(d.drift, 0.03)
    assert d.margin is not None and math.isclose(d.margin, 0.02)  # cold ranked b's pick 0.02 below
    assert not identical(COLD, flipped) and max_logprob_diff(COLD, flipped) >= 0.01


def test_a_pick_cold_did_not_rank_has_an_infinite_margin() -> None:
    far = completion([4, 7, 9], [{4: -0.1}, {7: -0.7}, {9: -0.1}])
    d = divergence(COLD, far)
    assert d.at == 0 and d.drift == 0.0 and d.margin == math.inf


def test_a_shorter_completion_parts_where_it_ends() -> None:
    short = completion([5, 7], [{5: -0.5}, {7: -0.9}])
    d = divergence(COLD, short)
    assert d.at == 2 and math.isclose(d.drift, 0.2) and d.margin == math.inf


def test_without_cold_logprobs_a_parting_has_an_infinite_margin() -> None:
    d = divergence(completion([5, 7, 9], []), completion([5, 8, 9], [{5: -0.5}, {8: -0.7}, {9: -0.1}]))
    assert d.at == 1 and d.drift == 0.0 and d.margin == math.inf


def test_an_engine_that_does_not_start_is_reported_by_its_last_exception() -> None:
    """``prefixvault repro`` shows the first line of the error: it names the engine's cause."""
    log = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
           "[rank0]:     raise ValueError(\n"
           "[rank0]: ValueError: Layer 0 (linear_attention) does not dispatch\n"
           "INFO 12-03 shutting down\n")
    assert last_error(log) == "ValueError: Layer 0 (linear_attention) does not dispatch"
    oom = "torch.OutOfMemoryError: CUDA out of memory"
    assert last_error(f"{oom}\n") == oom
    assert last_error("INFO: all fine\nnothing: here\n") == ""
