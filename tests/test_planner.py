"""The save planner as a pure function: each branch of one request's step, without threads,
vLLM objects or a store (the scheduler around it is tested in test_output_boundaries.py and
the contract suite)."""

from __future__ import annotations

from prefixvault.admission import Kind
from prefixvault.boundary import StateCapture, StepChunk
from prefixvault.vllm.planner import StepView, plan_step

BS = 16


def every(kinds: Kind, tokens: int, last: int) -> bool:
    return True


def plain(tokens: int) -> Kind:
    return Kind(0)


def view(start: int, end: int, prompt: int = 100, *, known: int | None = None, saved: int = 0, last: int = 0,
         hold_last: bool = False, state: bool = True, offered: tuple[int, ...] = (),
         at_end: bool = True) -> StepView:
    ends = (StateCapture(2, end, 7, 1),) if at_end else ()
    known = known if known is not None else max(end, prompt)
    return StepView(BS, prompt, start, StepChunk(start, end), known, saved, last, hold_last, state,
                    tuple(StateCapture(2, t, 5, 1) for t in offered), ends)


def test_attention_only_offers_every_block_boundary_of_the_chunk_past_what_is_saved() -> None:
    plan = plan_step(view(0, 64, state=False), every, plain)
    assert plan.candidates == {16, 32, 48, 64} and not plan.hold and not plan.captures
    assert plan_step(view(16, 64, saved=32, state=False), every, plain).candidates == {48, 64}


def test_with_state_only_admitted_states_are_candidates() -> None:
    plan = plan_step(view(0, 64, offered=(48,)), every, plain)
    assert plan.candidates == {48, 64} and plan.last_capture == 64
    assert [c.tokens for c in plan.captures] == [48, 64]

    def checkpoints_only(kinds: Kind, tokens: int, last: int) -> bool:
        return bool(kinds & Kind.CHECKPOINT)

    plan = plan_step(view(0, 64, offered=(48,)), checkpoints_only, plain)
    assert plan.candidates == {48} and plan.last_capture == 0  # the step's end was not admitted
    # a step ending inside a block, inside the prompt: a tail boundary; past the prompt: none
    assert plan_step(view(0, 60), every, plain).candidates == {60}
    assert plan_step(view(96, 108, prompt=100), every, plain).candidates == set()
    # (attention alone: block boundaries only)
    assert plan_step(view(0, 60, state=False), every, plain).candidates == {16, 32, 48}


def test_a_decode_step_on_an_output_boundary_is_held_and_only_its_end() -> None:
    plan = plan_step(view(127, 128, prompt=100, hold_last=True), every, plain)
    assert plan.hold and plan.candidates == {128}
    plan = plan_step(view(127, 128, prompt=100, hold_last=False), every, plain)
    assert not plan.hold and plan.candidates == {128}


def test_a_chunk_computing_prompt_and_output_tokens_publishes_prompt_boundaries_only() -> None:
    """A preempted request computed again: with output boundaries held, its chunk past the
    prompt is not saved from here."""
    plan = plan_step(view(0, 128, prompt=100, hold_last=True, offered=(96,)), every, plain)
    assert not plan.hold and plan.candidates == {96}


def test_unknown_token_ids_end_the_step_where_they_stop() -> None:
    plan = plan_step(view(96, 128, prompt=100, known=112, state=False), every, plain)
    assert plan.end == 112 and plan.candidates == {112}


def test_the_prompt_end_admitted_only_as_a_sequence_end_is_held_not_saved() -> None:
    """With output boundaries held, the prompt's exact end is a sequence end only if no output
    boundary follows: a policy admitting it for that alone holds it."""

    def sequence_ends(kinds: Kind, tokens: int, last: int) -> bool:
        return bool(kinds & Kind.SEQUENCE_END)

    def prompt_kinds(tokens: int) -> Kind:
        return Kind.SEQUENCE_END if tokens == 100 else Kind(0)

    plan = plan_step(view(96, 100, prompt=100, hold_last=True), sequence_ends, prompt_kinds)
    assert plan.held_end == 100 and plan.candidates == set() and not plan.hold
    # admitted for another reason too (every step end): saved now, nothing held
    plan = plan_step(view(96, 100, prompt=100, hold_last=True), every, prompt_kinds)
    assert plan.held_end == 0 and plan.candidates == {100}
