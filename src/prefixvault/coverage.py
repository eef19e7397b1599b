"""What a store holds of one prompt's chain, and which boundaries it can resume at.

One answer to one question, "can boundary b resume, given the objects that are missing": a
lookup (``Vault``), ``prefixvault explain`` and the property test that holds ``audit`` to them
all ask it here, so they cannot silently disagree.

Boundary b (tokens, a multiple of the block size) can resume when, for every rank, every
attention group has each KV block ``needed_blocks(group, b)`` names (all blocks before b for
full attention, the window's for a sliding window), and every state group has its state at b
(index ``b // block_size - 1``). A record at b is a separate question, the caller's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixvault.boundary import full_blocks, needed_blocks
from prefixvault.layout import CacheLayout, GroupKind

#: (group, rank, index): one object; a state's index is its boundary's last block.
Slot = tuple[int, int, int]


@dataclass(frozen=True)
class Coverage:
    """Missing objects of one chain, per (group, rank): sorted block indices, or for a state
    group the indices of the boundaries whose state is missing. Only indices that were checked
    can be missing: what was not asked about is taken as present."""

    layout: CacheLayout
    missing: dict[tuple[int, int], list[int]]  # (group, rank) -> sorted indices; invariant: sorted, unique

    @classmethod
    def from_flags(cls, layout: CacheLayout,
                   checked: Iterable[tuple[int, int, Sequence[int], Sequence[bool]]]) -> Coverage:
        """From existence answers: (group, rank, indices asked, whether each exists)."""
        missing: dict[tuple[int, int], list[int]] = {}
        for gi, rank, idx, found in checked:
            holes = missing.setdefault((gi, rank), [])
            holes.extend(i for i, ok in zip(idx, found, strict=True) if not ok)
        return cls(layout, {k: sorted(set(v)) for k, v in missing.items()})

    def needs(self, group: int, boundary: int) -> range:
        """The indices of ``group`` that resuming at ``boundary`` needs (any rank)."""
        bs = self.layout.block_size
        if self.layout.groups[group].is_state:
            return range(boundary // bs - 1, boundary // bs)
        return needed_blocks(self.layout.groups[group], boundary, bs)

    def missing_at(self, boundary: int, limit: int | None = None,
                   kinds: frozenset[GroupKind] | None = None) -> list[Slot]:
        """The objects resuming at ``boundary`` needs that are missing (the first ``limit``,
        in group, rank, index order), of groups of ``kinds`` only if given."""
        out: list[Slot] = []
        for (gi, rank), holes in sorted(self.missing.items()):
            if kinds is not None and self.layout.groups[gi].kind not in kinds:
                continue
            need = self.needs(gi, boundary)
            lo, hi = bisect_left(holes, need.start), bisect_left(holes, need.stop)
            if limit is not None:  # (only what is returned is read: a walk over every boundary
                hi = min(hi, lo + limit - len(out))  # of a long prompt stays linear)
            out.extend((gi, rank, holes[j]) for j in range(lo, hi))
            if limit is not None and len(out) >= limit:
                return out
        return out

    def resumable(self, boundary: int) -> bool:
        """Whether every object resuming at ``boundary`` needs is there."""
        return not self.missing_at(boundary, 1)

    def full_blocks_present(self, boundary: int) -> bool:
        """Whether every full KV block resuming at ``boundary`` needs is there (for a tail
        boundary: all but its partly filled block, an object of its own the caller checks)."""
        bs = self.layout.block_size
        for (gi, _), holes in self.missing.items():
            group = self.layout.groups[gi]
            if group.is_state:
                continue
            need = full_blocks(group, boundary, bs)
            if bisect_left(holes, need.stop) > bisect_left(holes, need.start):
                return False
        return True

    def first_missing(self, boundary: int) -> Slot | None:
        """One object that keeps ``boundary`` from resuming, or None."""
        found = self.missing_at(boundary, 1)
        return found[0] if found else None
