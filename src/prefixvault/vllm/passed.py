"""Boundaries whose KV an engine holds and, as far as the connector can tell, no state at.

vLLM keeps a hybrid request's state only at a few of its boundaries (its replay boundary, the
junction it found with an earlier request, a restored boundary the connector names), while it
keeps the KV of every full block. A later request sharing a prefix up to such a boundary is
then offered vLLM's full-attention hit there (a divergent hit), and an answer of 0 makes vLLM
compute from the shorter hit every group agrees on. The scheduler side asks such a request
again for that agreed hit where the store may serve it (``SchedulerSide._agreed_hit_wanted``);
this set is how it tells a divergent hit from one vLLM holds a state at. A wrong guess costs
time only: a request asked again one step later, or a stored boundary computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

#: Boundaries remembered (block chain hashes), the oldest forgotten first.
PASSED_BOUNDARIES = 1 << 16


class PassedBoundaries:
    def __init__(self, capacity: int = PASSED_BOUNDARIES) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def passed(self, hashes: Iterable[bytes]) -> None:
        """The engine now holds the KV up to each of these boundaries, and no state there."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def kept(self, hashes: Iterable[bytes]) -> None:
        """vLLM keeps a state at each of these boundaries (or holds one there after all)."""
        for h in hashes:
            self._hashes.pop(h, None)

    def __contains__(self, h: object) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._hashes)
