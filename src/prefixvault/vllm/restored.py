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

``DivergentHits`` is what the scheduler side does with it: whether vLLM is told the connector
completes divergent hits, what each hit vLLM offers is (``Offer``), and which requests are
asked again for vLLM's agreed hit (while any is, divergent hits are not offered).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any

from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.vllm.compat import per_group_hits, watch_handouts


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


class Offer(StrEnum):
    """What vLLM offers a request as its local hit (``DivergentHits.classify``)."""

    AGREED = "agreed"  # every cache group holds it, a state included
    ON_RESTORED_KV = "on restored KV"  # divergent: no state there; every KV block below it a load wrote
    ON_COMPUTED_KV = "on computed KV"  # divergent, and some KV block below it this engine computed


class DivergentHits:
    """Divergent hybrid hits (``supports_divergent_local_hybrid_hits``): vLLM may offer a
    request the full-attention groups' local hit where no state was kept at it. A load from
    there brings the state at its own boundary and the KV past the local hit, which is every
    object a resume needs when the other groups are full attention (a sliding window's blocks
    before the local hit might not be in the engine's cache: then vLLM is not told the
    connector can, ``completes``). It is completed only on KV a load wrote (above)."""

    def __init__(self, layout: CacheLayout, completes: bool) -> None:
        self.block_size = layout.block_size
        self.attn_groups = [i for i, g in enumerate(layout.groups) if not g.is_state]
        self.completes = completes and any(g.is_state for g in layout.groups) and all(
            g.kind is GroupKind.FULL_ATTENTION for g in layout.groups if not g.is_state)
        self._restored = RestoredBlocks()
        self._cache_manager: Any = None
        # Requests asked again for vLLM's agreed hit: while any waits, divergent hits are not offered.
        self._want_agreed: set[str] = set()

    @property
    def offered(self) -> bool:
        """What the connector tells vLLM now (``supports_divergent_local_hybrid_hits``)."""
        return self.completes and self._restored.watching and not self._want_agreed

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's cache manager: which blocks a hit names, and the pool whose hand-outs end a
        block's restored bytes."""
        if self.completes:
            self._cache_manager = kv_cache_manager
            self._restored.watch(kv_cache_manager.block_pool)

    def classify(self, request: Any, offered: int) -> tuple[Offer, int]:
        """What vLLM's offer ``offered`` is, and the hit every cache group holds up to it: a hit
        every group holds (with the connector unbound, vLLM offers only those), or a divergent
        hit (a state group holds less), on KV that loads wrote or on KV this engine computed."""
        if not (self.completes and offered and self._cache_manager is not None):
            return Offer.AGREED, offered
        blocks, hits = per_group_hits(self._cache_manager, request, offered)
        agreed = min(hits)
        if agreed >= offered:
            return Offer.AGREED, offered
        # With vLLM's fine-grained matching (a hash unit finer than the block) its own hit may
        # end inside a block, past the offer: vLLM offers it rounded down to a block boundary,
        # and every group holds it. Agreed, then (an answer not past it vLLM drops).
        if min(per_group_hits(self._cache_manager, request, int(request.num_tokens) - 1)[1]) >= offered:
            return Offer.AGREED, offered
        n = offered // self.block_size
        restored = all(len(blocks[g]) >= n and self._restored.all_loaded(g, blocks[g][:n])
                       for g in self.attn_groups)
        return (Offer.ON_RESTORED_KV if restored else Offer.ON_COMPUTED_KV), agreed

    def loading(self, block_ids: Sequence[Sequence[int]], local: int, tokens: int) -> None:
        """A load from ``local`` to ``tokens`` writes these blocks (just handed out for it):
        their bytes will be the store's."""
        if self.completes:
            bs = self.block_size
            for g in self.attn_groups:
                self._restored.loaded(g, block_ids[g][local // bs : tokens // bs])

    def want_agreed(self, req_id: str) -> None:
        """The request is asked again for vLLM's agreed hit."""
        self._want_agreed.add(req_id)

    def answered(self, req_id: str) -> None:
        """The request is asked again no more (answered, finished, or an error of ours)."""
        self._want_agreed.discard(req_id)
