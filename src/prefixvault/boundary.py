"""The boundary rule, in one place: which boundaries may be published, and which hit to take.

A boundary b is a token count: a multiple of the block size, or (for layouts with state) a
*tail* boundary inside a block, where a chunk ended (a prompt's exact end) or the engine
offered a state. It is publishable when, for every cache group, what that group needs to
resume at b is really there:

- full attention: the KV blocks of every token before b, none of them the null block (for a
  tail boundary the last is the block b ends in, partly filled);
- sliding window: the KV blocks inside the window before b, none of them the null block;
- recurrent state: a state the engine reports it captured *exactly* at b, in a real
  (non-null) block, reported in the step being saved (a later step may have reused the block;
  a capture or a save whose step is unknown is refused), and b is where the request's chunk
  of that step ended.

The engine's reports are the source of truth. A position in a state block table is not
(engines fill positions they kept no state for with the null block), except through
``step_end_captures``, which states the one engine fact that makes a position evidence and
guards it. Nor is an offer for a
boundary strictly inside the step's chunk: a recurrent kernel leaves one state, at the end of
the chunk, and vLLM (0.32, align mode) offers a block as the state at the block's end even
when the chunk that last wrote it ended mid-block (docs/architecture.md, "Under load"). The
one exception is the second engine fact, ``StepChunk.checkpoint``: a layer that exports the
state at a prefill checkpoint from inside the chunk, where vLLM's own rule says it did
(``vllm/compat.py``, ``InternalCheckpoints``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from prefixvault.layout import CacheGroup, CacheLayout, GroupKind

#: vLLM's null block: a placeholder that holds no real cache.
NULL_BLOCK_ID = 0


class Refusal(StrEnum):
    """Why a boundary was not published (each is a metric label)."""

    NULL_BLOCK = "null_block"
    NOT_CAPTURED = "not_captured"
    INSIDE_CHUNK = "inside_chunk"
    STALE = "stale"
    NOT_ALIGNED = "not_aligned"
    NOT_COMPUTED = "not_computed"
    MISSING_RANK = "missing_rank"
    MISSING_OBJECT = "missing_object"  # the parent record and a block it covered are gone
    STORE_ERROR = "store_error"


@dataclass(frozen=True)
class StateCapture:
    """The engine says: group ``group``'s state after exactly ``tokens`` tokens is in ``block_id``.

    ``step`` is the engine step in which the capture was reported; the bytes may be read
    only in that step.
    """

    group: int
    tokens: int
    block_id: int
    step: int | None = None


@dataclass(frozen=True)
class StepChunk:
    """The engine computed tokens [start, end) of the request in the step being saved.

    A state is exact only at ``end``: that is where the step's recurrent update stopped; and at
    ``checkpoint``, a token count strictly inside the chunk at which the engine's layers wrote
    the state into a block of its own (vLLM's in-chunk prefill checkpoint), where the engine's
    rule says they did. None: the engine exported no state inside this chunk.
    """

    start: int
    end: int
    checkpoint: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint is not None and not self.start < self.checkpoint < self.end:
            raise ValueError(f"a checkpoint at {self.checkpoint} is not inside the chunk "
                             f"[{self.start}, {self.end})")


def step_end_captures(
    layout: CacheLayout, chunk: StepChunk, prompt_tokens: int,
    state_tables: Mapping[int, Sequence[int]], step: int,
) -> list[StateCapture]:
    """The engine fact behind step-end capture, with its guard.

    In align mode a recurrent kernel leaves, after a step, the state at the end of the
    request's chunk in the block at index ``(chunk.end - 1) // block_size`` of each state
    group's table (the block the chunk's last token is in: the runner's running column), until
    a later step of the request writes that block again. That is the state at a prompt
    boundary only when the chunk ended inside the prompt: a request resumed after preemption
    recomputes prompt + output tokens, and a chunk that ran past the prompt leaves a state
    that already holds output tokens. Anything else gives no capture (never a guess).
    """
    bs = layout.block_size
    end = chunk.end
    if not chunk.start < end <= prompt_tokens:
        return []
    out = []
    for gi, group in enumerate(layout.groups):
        if group.is_state:
            table = state_tables.get(gi, ())
            idx = (end - 1) // bs
            out.append(StateCapture(gi, end, table[idx] if idx < len(table) else NULL_BLOCK_ID, step))
    return out


@dataclass(frozen=True)
class SavePlan:
    """What to copy out of the engine to publish boundary ``tokens``."""

    tokens: int
    blocks: tuple[tuple[int, int, int], ...]  # (group, block index, engine block id)
    states: tuple[tuple[int, int], ...]  # (group, engine block id)


@dataclass(frozen=True)
class BoundaryDecision:
    publishable: tuple[SavePlan, ...]
    refused: tuple[tuple[int, Refusal], ...]


def needed_blocks(group: CacheGroup, boundary: int, block_size: int) -> range:
    """Indices of the KV blocks an attention group needs to resume at ``boundary``: every block
    it touches, the partly filled last one of a tail boundary included."""
    n = -(-boundary // block_size)
    if group.kind is GroupKind.FULL_ATTENTION:
        return range(n)
    if group.kind is GroupKind.SLIDING_WINDOW:
        assert group.window is not None
        # Tokens [boundary - window, boundary) may be attended from the next token on.
        first = max(0, boundary - group.window) // block_size
        return range(first, n)
    return range(0)


def full_blocks(group: CacheGroup, boundary: int, block_size: int) -> range:
    """Of ``needed_blocks``, the full ones: those a prefix shares with every longer one (a tail
    boundary's partly filled block is an object of its own, named by its tail hash)."""
    need = needed_blocks(group, boundary, block_size)
    return range(need.start, min(need.stop, boundary // block_size))


def max_resume_tokens(prompt_tokens: int, block_size: int) -> int:
    """The longest block-aligned prefix that still leaves one prompt token to compute."""
    if prompt_tokens <= 0:
        return 0
    return ((prompt_tokens - 1) // block_size) * block_size


def resume_limit(prompt_tokens: int) -> int:
    """The longest prefix of any length a request may resume from: one token short of its
    prompt, since the engine computes at least the last one (a state restored at a request's
    very end would have that token applied twice)."""
    return max(0, prompt_tokens - 1)


def plan_saves(
    layout: CacheLayout,
    computed_tokens: int,
    block_tables: Mapping[int, Sequence[int]],
    captures: Iterable[StateCapture],
    step: int | None = None,
    candidates: Iterable[int] | None = None,
    chunk: StepChunk | None = None,
    since: int = 0,
) -> BoundaryDecision:
    """Decide, from the engine's reports, which boundaries can be published now.

    ``block_tables`` maps each attention group to its block ids by block index;
    ``captures`` are the state reports; ``candidates`` are the boundaries to consider
    (default: every aligned boundary for attention-only layouts, every captured token
    count for layouts with state); ``chunk`` is what the request computed in ``step``
    (engines that report it get the chunk-end guard on every state); ``since`` is a boundary
    of the same prefix already handed to the store: KV blocks before it are the parent
    record's, so plans list (and check) only the blocks from ``since`` on, and candidates up
    to ``since`` are skipped. That keeps a step's plans as large as what the step computed,
    not as the prompt.
    """
    bs = layout.block_size
    state_groups = [i for i, g in enumerate(layout.groups) if g.is_state]
    by_boundary: dict[tuple[int, int], StateCapture] = {}
    for c in captures:
        if c.group not in state_groups:
            raise ValueError(f"capture for group {c.group}, which is not a state group")
        by_boundary[(c.group, c.tokens)] = c
    if candidates is None:
        aligned = range(bs, computed_tokens + 1, bs)
        candidates = {t for (_, t) in by_boundary} if state_groups else aligned
    publishable: list[SavePlan] = []
    refused: list[tuple[int, Refusal]] = []
    for b in sorted(t for t in set(candidates) if t > since):  # the others are already stored
        plan_or_refusal = _plan_one(layout, b, computed_tokens, block_tables, by_boundary, step, chunk,
                                    since // bs if since > 0 else 0)
        if isinstance(plan_or_refusal, SavePlan):
            publishable.append(plan_or_refusal)
        else:
            refused.append((b, plan_or_refusal))
    return BoundaryDecision(tuple(publishable), tuple(refused))


def _plan_one(
    layout: CacheLayout,
    b: int,
    computed_tokens: int,
    block_tables: Mapping[int, Sequence[int]],
    captures: Mapping[tuple[int, int], StateCapture],
    step: int | None,
    chunk: StepChunk | None,
    first_block: int,
) -> SavePlan | Refusal:
    bs = layout.block_size
    if b <= 0 or (b % bs and not layout.has_state):  # (attention alone resumes at any block end)
        return Refusal.NOT_ALIGNED
    if b > computed_tokens:
        return Refusal.NOT_COMPUTED
    blocks: list[tuple[int, int, int]] = []
    states: list[tuple[int, int]] = []
    for gi, group in enumerate(layout.groups):
        if group.is_state:
            cap = captures.get((gi, b))
            if cap is None:
                return Refusal.NOT_CAPTURED
            if chunk is not None and b != chunk.end and b != chunk.checkpoint:
                # Inside the chunk: the block may hold the state at another position.
                # Before it: written in an earlier step, which this step cannot vouch for.
                return Refusal.INSIDE_CHUNK if chunk.start < b < chunk.end else Refusal.STALE
            if cap.block_id == NULL_BLOCK_ID:
                return Refusal.NULL_BLOCK
            if step is None or cap.step != step:
                return Refusal.STALE  # fail closed: a capture of an unknown step is not evidence
            states.append((gi, cap.block_id))
            continue
        table = block_tables.get(gi, ())
        need = needed_blocks(group, b, bs)
        for i in range(max(need.start, first_block), need.stop):
            if i >= len(table):
                return Refusal.NOT_COMPUTED
            if table[i] == NULL_BLOCK_ID:
                return Refusal.NULL_BLOCK
            blocks.append((gi, i, table[i]))
    return SavePlan(b, tuple(blocks), tuple(states))


def choose_hit(
    published: Iterable[int], prompt_tokens: int, block_size: int, resumable: Callable[[int], bool]
) -> int:
    """The longest published boundary that can resume and leaves a token to compute; 0 if none.

    ``resumable(b)`` answers whether every object boundary b needs still exists.
    """
    limit = max_resume_tokens(prompt_tokens, block_size)
    for b in sorted(set(published), reverse=True):
        if 0 < b <= limit and b % block_size == 0 and resumable(b):
            return b
    return 0
