"""Which boundaries one request's step offers to save: the scheduler's decision, as a pure function.

The scheduler gathers what a step shows (``StepView``: the chunk, what the request has saved
and admitted before, the states vLLM offered and the state the step leaves at its end) and
asks ``plan_step``; the boundary rule (``plan_saves``) then decides which of the candidates
can publish. No threads, no store, no vLLM object: every branch is unit-testable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixvault.admission import Kind
from prefixvault.boundary import StateCapture, StepChunk

#: ``admits(kinds, tokens, last)``: whether the admission policy stores a candidate boundary.
Admits = Callable[[Kind, int, int], bool]
#: ``kinds(tokens)``: what a boundary of the request is (checkpoint, sequence end, junction).
Kinds = Callable[[int], Kind]


@dataclass(frozen=True)
class StepView:
    """What one request's step shows the planner."""

    block_size: int
    prompt_len: int
    start: int  # tokens computed before this step
    chunk: StepChunk
    known: int  # tokens whose ids are known (the prompt, and generated tokens read so far)
    saved: int  # highest boundary already handed to the workers
    last_capture: int  # the request's last boundary admitted before this step
    hold_last: bool  # output_boundaries: last (output boundaries held until the request ends)
    has_state: bool  # the model has state groups (a boundary needs an exact state)
    offered: tuple[StateCapture, ...] = ()  # states vLLM's layers offered this step
    at_end: tuple[StateCapture, ...] = ()  # the states this step leaves at its end, if any
    saved_tail: int = 0  # highest tail boundary (inside a block) already handed to the workers


@dataclass(frozen=True)
class StepPlan:
    end: int  # the step's end, as far as token ids are known
    captures: tuple[StateCapture, ...]  # the states admitted this step
    candidates: frozenset[int]  # boundaries to save now (or to hold, with ``hold``)
    hold: bool  # the candidates are the request's output boundary, held until it finishes
    held_end: int  # the prompt's end, held beside a save (0: none)
    last_capture: int  # the request's last admitted boundary after this step


def plan_step(view: StepView, admits: Admits, kinds: Kinds) -> StepPlan:
    """The candidates of one step. A step ending on an output boundary (``hold_last``) holds
    it, replacing the request's earlier hold; a chunk that also computes prompt tokens (a
    preempted request computed again) publishes its prompt boundaries only. With states, the
    admission policy picks among the states offered and the one the step leaves at its end."""
    bs, prompt_len, start = view.block_size, view.prompt_len, view.start
    end = min(view.chunk.end, view.known)
    hold = view.hold_last and end > prompt_len and start >= prompt_len
    limit = end if start >= prompt_len or not view.hold_last else min(end, prompt_len)
    last = view.last_capture
    if view.has_state:
        captures = [c for c in view.offered
                    if admits(kinds(c.tokens) | Kind.CHECKPOINT, c.tokens, view.last_capture)]
        step_kind = Kind.STEP_END if end <= prompt_len else Kind.OUTPUT
        if hold:  # stored only if it is the last: the sequence end
            step_kind |= Kind.SEQUENCE_END
        # a step end inside a block is a tail boundary: taken inside the prompt only
        at_boundary = end % bs == 0 or end <= prompt_len
        if view.at_end and at_boundary and admits(kinds(end) | step_kind, end, view.last_capture):
            captures += view.at_end
            last = end
        candidates = {c.tokens for c in captures}
    else:
        captures, candidates = [], set(range((start // bs + 1) * bs, end + 1, bs))
    # Tail boundaries (inside a block) only where a state exists, and inside the prompt.
    candidates = {t for t in candidates if t > view.saved and t <= limit
                  and (t % bs == 0 or (view.has_state and view.saved_tail < t <= prompt_len))}
    if hold:
        candidates &= {end}
    # With output boundaries held, the prompt's last block boundary is a sequence end only if
    # no output boundary follows: a boundary the policy admits for that alone (marconi, reuse)
    # is held too, and an output boundary replaces it.
    held_end = 0
    seq_end = prompt_len  # (a model with state resumes at the prompt's exact end)
    if view.hold_last and not hold and view.has_state and seq_end in candidates:
        why = Kind.CHECKPOINT if any(c.tokens == seq_end for c in view.offered) else Kind(0)
        if view.at_end and end == seq_end:
            why |= Kind.STEP_END
        if not admits((kinds(seq_end) & ~Kind.SEQUENCE_END) | why, seq_end, view.last_capture):
            candidates.discard(seq_end)
            held_end = seq_end
    return StepPlan(end, tuple(captures), frozenset(candidates), hold, held_end, last)
