"""Blocks of an engine's cache whose bytes a load wrote from the store, and nothing since.

A divergent hybrid hit (``supports_divergent_local_hybrid_hits``) resumes on KV the engine
holds and a state the store holds. The state was computed over its producer's KV; KV this
engine computed itself for the same tokens may differ from that in the last bits (where its
steps ended, which rows shared a batch), and a resume on the mix matches no run. Measured:
a conversation's turn 2 on the engine that computed turn 1's answer parted from cold by 3.6
in logprobs. The mix is exact only where every local block was written by a load, so that
is what the scheduler side checks before it completes such a hit.

The set follows vLLM's block pool (``compat.watch_handouts``): a block handed out, or whose
cache entry moves to another (a copy-on-write), is forgotten at that moment, before the engine
can write it. A block vLLM frees unwritten (a failed load) is cached under no hash, so no hit
can name it until it is handed out again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prefixvault.vllm.compat import watch_handouts


class RestoredBlocks:
    def __init__(self) -> None:
        self._ids: dict[int, set[int]] = {}  # cache group -> block ids
        self.watching = False

    def watch(self, block_pool: Any) -> None:
        """Forget every block vLLM's pool hands out or moves a cache entry off, as it does so."""
        watch_handouts(block_pool, self.forget)
        self.watching = True

    def loaded(self, group: int, block_ids: Iterable[int]) -> None:
        """A load writes these blocks of ``group`` from the store (they were just handed out)."""
        self._ids.setdefault(group, set()).update(b for b in block_ids if b)

    def forget(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for held in self._ids.values():
            held.difference_update(ids)

    def all_loaded(self, group: int, block_ids: Sequence[int]) -> bool:
        """Whether a load wrote every one of these blocks of ``group``, and nothing since."""
        held = self._ids.get(group, set())
        return all(b in held for b in block_ids)

    def __len__(self) -> int:
        return sum(len(held) for held in self._ids.values())
