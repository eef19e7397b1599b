"""The seed scenario's arithmetic: a producer's schedule and the hit a consumer must get.

Computed from vLLM's scheduling rules, independently of the connector, so that tests can
check the connector's external hit against it. In ``mamba_cache_mode="align"`` every
prefill step that does not finish the prompt ends on a block boundary, and the step that
reaches the prompt checkpoint (the last block boundary before the prompt's last token) is
split there.
"""

from __future__ import annotations

from collections.abc import Iterable


def checkpoint(prompt_tokens: int, block_size: int) -> int:
    """vLLM's prompt checkpoint: the last block boundary that leaves a token to compute."""
    return (prompt_tokens - 1) // block_size * block_size


def schedule(prompt_tokens: int, max_batched: int, block_size: int) -> list[int]:
    """Token counts at which the prompt's prefill steps end (one request running alone): a step
    that is not the last ends on the last block boundary it reaches, or at its budget where a
    budget smaller than a block reaches none (a step end inside a block); the step that reaches
    the prompt checkpoint is split there."""
    c = checkpoint(prompt_tokens, block_size)
    ends, pos = [], 0
    while pos < prompt_tokens:
        end = min(pos + max_batched, prompt_tokens)
        if end < prompt_tokens and end // block_size * block_size > pos:
            end = end // block_size * block_size
        if pos < c < end:
            end = c
        ends.append(end)
        pos = end
    return ends


def captured(prompt_tokens: int, max_batched: int, block_size: int, policy: str = "steps") -> list[int]:
    """Boundaries whose exact state a producer keeps under a capture policy: every step end
    (the prompt's exact end included, a tail boundary where it is inside a block) for
    ``steps``; the prompt checkpoint for ``checkpoints``; the sequence end, the prompt's exact
    end (where a longer prompt resumes), for ``marconi`` and ``reuse``."""
    if policy == "checkpoints":
        return [checkpoint(prompt_tokens, block_size)]
    if policy in ("marconi", "reuse"):
        return [prompt_tokens]
    return schedule(prompt_tokens, max_batched, block_size)


def expected_hit(available: Iterable[int], consumer_tokens: int, common_prefix: int, block_size: int) -> int:
    """The longest available boundary inside the shared prefix that leaves a token to compute."""
    limit = min(common_prefix, consumer_tokens - 1)
    return max((b for b in available if 0 < b <= limit), default=0)


def restores_exactly(hit: int, consumer_tokens: int, max_batched: int, block_size: int) -> bool:
    """Whether a restore at ``hit`` is bit-identical to a cold run, not just equivalent.

    A cold run's numbers depend on where its prefill steps end. Restoring at a boundary
    where the cold consumer's own step also ends gives the same computation; elsewhere the
    restored state is still the exact state at ``hit``, but later steps are split
    differently and floating-point sums may differ in the last bits.
    """
    return hit == 0 or hit in schedule(consumer_tokens, max_batched, block_size)
