"""Saves in flight, as the scheduler knows them: planned, not yet reported settled by every rank.

A lookup whose prompt names a boundary of a save in flight is held until that save settles
(what the store is about to hold is not computed again); a save that settles unpublished sends
its request's next save back to that save's parent. Pure bookkeeping: no threads, no store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from prefixvault.vllm.metadata import SavesSettled

#: A save no worker reported settled (a report lost) stops holding lookups after this long.
SAVE_FORGET_S = 60.0


@dataclass(frozen=True)
class _Entry:
    boundaries: list[bytes]  # the boundary hashes it publishes
    left: int  # ranks still to report it
    since: float  # when it was planned (time.monotonic())
    request: str  # "" for a held save (its request is finished: nothing to send back)
    parent: int  # the parent boundary its request's next save goes back to if it fails


class SavesInFlight:
    """Invariant: ``hashes`` counts, for each boundary hash, the entries that name it; a hash
    whose count falls to 0 is removed (so ``h in hashes`` is exactly "a save of h is in flight").
    Written on the scheduler's thread only; the lookup lane only asks ``in``."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._entries: dict[str, _Entry] = {}
        self.hashes: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, sid: str, boundaries: Sequence[bytes], now: float, request: str = "",
            parent: int = -1) -> None:
        """A save handed to the workers (``save_id``), with the boundaries it publishes."""
        if sid in self._entries:
            self._forget(sid)
        self._entries[sid] = _Entry(list(boundaries), self.ranks, now, request, parent)
        self.hashes.update(boundaries)

    def names_any(self, hashes: Sequence[bytes]) -> bool:
        """Whether a save in flight publishes one of ``hashes``."""
        saving = self.hashes
        return bool(saving) and any(h in saving for h in hashes)

    def settle(self, report: SavesSettled) -> list[tuple[str, int]]:
        """Take the workers' report; returns (request, parent) of each save reported not
        published: its request's next save starts from that parent again."""
        failed = []
        for sid in report.failed:
            entry = self._entries.get(sid)
            if entry is not None and entry.request and entry.parent >= 0:
                failed.append((entry.request, entry.parent))
        for sid, ranks in report.ranks.items():
            entry = self._entries.get(sid)
            if entry is None:
                continue
            if entry.left > ranks:
                self._entries[sid] = _Entry(entry.boundaries, entry.left - ranks, entry.since, entry.request,
                                            entry.parent)
            else:
                self._forget(sid)
        return failed

    def forget_older_than(self, now: float, age: float = SAVE_FORGET_S) -> int:
        """Stop holding lookups for saves planned over ``age`` s ago (a report was lost)."""
        stale = [sid for sid, e in self._entries.items() if now - e.since > age]
        for sid in stale:
            self._forget(sid)
        return len(stale)

    def _forget(self, sid: str) -> None:
        entry = self._entries.pop(sid)
        self.hashes.subtract(entry.boundaries)
        for h in entry.boundaries:
            if h in self.hashes and self.hashes[h] <= 0:
                del self.hashes[h]
