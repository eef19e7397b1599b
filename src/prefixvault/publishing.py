"""Publishing: the record of a boundary is written last, only when every object of every rank
is acknowledged (``RankAck``, the answer of a rank's save: ``saving``) or seen in the store
(invariant 1).

A record lists its segment of the hash chain and points at the earlier record it extends, so
record bytes and publish work grow with what a step computed, not with the prompt. Records are
put if absent, never overwritten; the layout object is touched after them, so it is never
older than a record that needs it. A tail boundary's record is listed in the tail index of the
block boundary before it (``tails``), once it is stored: a tail is found only once published.
Records and tail indexes are encrypted with the key of the prefix's tenant (its cache salt).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixvault.boundary import Refusal
from prefixvault.codec import IntegrityError, ObjectKind
from prefixvault.counters import Counters
from prefixvault.keys import KeySpace
from prefixvault.layout import CacheLayout
from prefixvault.objects import ObjectNames
from prefixvault.read_twice import read_opened
from prefixvault.records import BoundaryRecord
from prefixvault.stored_layout import StoredLayout
from prefixvault.stores.base import Store
from prefixvault.tails import TailIndex
from prefixvault.tenancy import NamespaceKey, TenantKeys


@dataclass(frozen=True)
class RankAck:
    """A rank's answer for one boundary: all of its objects are stored (ok) or not."""

    rank: int
    tokens: int
    boundary_hash: bytes
    ok: bool
    reason: Refusal | None = None


def producer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(eq=False)
class Publisher:
    """Writes the records of boundaries whose objects every rank has stored."""

    store: Store
    layout: CacheLayout
    keys: KeySpace
    names: ObjectNames
    tenants: TenantKeys  # the key of each prefix's tenant
    counters: Counters  # records_*, and boundaries refused (``refused``)
    stored_layout: StoredLayout

    def publish_many(
        self, publishes: Sequence[tuple[Sequence[bytes], Iterable[RankAck], int]],
        seeds: Sequence[bytes | None] | None = None, salts: Sequence[str | None] | None = None,
    ) -> list[dict[int, Refusal | None]]:
        """Publish several prefixes at once, (hashes, acks, parent) each, in the round trips of
        one: one existence check for all of them, then one conditional put of all their records
        (a slow store is paid per batch, not per save). A record names the one before it, so
        each prefix's records are built in order, and a save may continue one an earlier save
        of the batch publishes (the same request's previous step): that parent is put first. A
        record two prefixes both publish is put once (the first built).

        A rank without an ok ack for a boundary is checked in the store, so ranks that cannot
        exchange acknowledgements each publish after their own puts: the last to finish sees
        every object. If a ``parent`` record is gone, the blocks before it are checked in the
        store instead. Per prefix and boundary: None if its record exists now, else why not.

        ``hashes`` name each prefix (``keys.prefix_hashes``: a tail boundary's last hash is its
        tail hash; one prefix publishes at most one tail boundary, its longest). ``seeds``: each
        prefix's chain seed, which names the tail index of a tail in the first block (a tail
        there without one is refused, ``not_aligned``). A ``parent`` is block-aligned. ``salts``:
        each prefix's cache salt, its tenant (None for all: the namespace's key)."""
        bs = self.layout.block_size
        world = set(range(self.layout.world_size))
        outs: list[dict[int, Refusal | None]] = []
        plans: list[tuple[Sequence[bytes], list[int], int, dict[int, list[str]]]] = []
        keys: list[str] = []
        for j, (hashes, acks, parent) in enumerate(publishes):
            salt = salts[j] if salts is not None else None
            acked: dict[int, set[int]] = {}
            failed: set[int] = set()
            if parent % bs:
                raise ValueError(f"parent {parent} is not block-aligned")
            for a in acks:
                n = -(-a.tokens // bs)
                if not 0 < n <= len(hashes) or a.boundary_hash != hashes[n - 1]:
                    raise ValueError(f"ack for boundary {a.tokens} does not match the prefix given")
                acked.setdefault(a.tokens, set())
                if a.ok:
                    acked[a.tokens].add(a.rank)
                else:
                    failed.add(a.tokens)
            outs.append({b: Refusal.STORE_ERROR for b in failed})
            todo = sorted(b for b in acked if b not in failed and b > parent)
            checks: dict[int, list[str]] = {}
            if todo:
                if parent:
                    keys.append(self.names.space(salt).record(hashes[parent // bs - 1]))
                for b in todo:
                    missing_ranks = sorted(world - acked[b])
                    if missing_ranks:
                        checks[b] = [r.key for r in self.names.needed(hashes, b, missing_ranks, parent, salt)]
                        keys.extend(checks[b])
            plans.append((hashes, todo, parent, checks))
        # One round trip: every parent record, and every object of a rank that did not ack.
        unique = list(dict.fromkeys(keys))
        present = dict(zip(unique, self.store.exists_many(unique), strict=True)) if unique else {}
        records: dict[str, bytes] = {}  # put in this order: a parent before the records naming it
        # (index parent, past, name, key, its keys)
        tails: list[tuple[bytes, int, bytes, NamespaceKey | None, KeySpace]] = []
        for i, ((hashes, todo, parent, checks), out) in enumerate(zip(plans, outs, strict=True)):
            if not todo:
                continue
            salt = salts[i] if salts is not None else None
            key, space = self.tenants.get(salt), self.names.space(salt)
            parent_key = space.record(hashes[parent // bs - 1]) if parent else ""
            # A parent published by an earlier save of this batch (the same request's previous
            # step) is as good as one already stored.
            if parent and not (present[parent_key] or parent_key in records):
                # The parent's record is gone: publish from the first block if the blocks it
                # covered are all still stored (one more round trip, only on this path).
                early = sorted({r.key for r in self.names.needed(hashes, todo[0], since=0, salt=salt)
                                if r.kind is ObjectKind.BLOCK and r.tokens <= parent})
                if early and not all(self.store.exists_many(early)):
                    for b in todo:
                        out[b] = Refusal.MISSING_OBJECT
                        self.counters.tally("refused", Refusal.MISSING_OBJECT, 1)
                    continue
                parent = 0
            for b in todo:
                if not all(present[k] for k in checks.get(b, ())):
                    out[b] = Refusal.MISSING_RANK
                    self.counters.tally("refused", Refusal.MISSING_RANK, 1)
                    continue
                index = (hashes[b // bs - 1] if b >= bs else seeds[i] if seeds is not None else None) \
                    if b % bs else None
                if b % bs and index is None:
                    out[b] = Refusal.NOT_ALIGNED
                    self.counters.tally("refused", Refusal.NOT_ALIGNED, 1)
                    continue
                name, blob = self._record(hashes, b, parent, key, space)
                if name in records:  # another prefix of this batch publishes the same boundary
                    self.counters.add(records_existing=1)
                else:
                    records[name] = blob
                out[b] = None
                if index is not None:
                    tails.append((index, b % bs, hashes[-(-b // bs) - 1], key, space))
                else:
                    parent = b  # (a tail boundary is never a parent)
        if records:
            stored = self.store.put_if_absent_many(list(records.items()))
            self.counters.add(records_published=sum(stored))
            self.counters.add(records_existing=len(stored) - sum(stored))
            self.stored_layout.keep()  # after the records: never older than a record that needs it
        if tails:
            self._index_tails(tails)
        return outs

    def _index_tails(self, tails: Sequence[tuple[bytes, int, bytes, NamespaceKey | None, KeySpace]]) -> None:
        """List each published tail in its block boundary's index (one read and one write for
        all of them, and a second read of those that do not verify): read, merge, replace. An
        index that does not verify when read once more is replaced (a read that raced another
        publisher's replacement may be torn on a store that overwrites in place:
        ``stores.mooncake``; replacing that index would drop its tails). (An index is its
        tenant's: the parent hash that names it is keyed by the tenant's key.)"""
        by_key: dict[str, tuple[bytes, NamespaceKey | None, list[tuple[int, bytes]]]] = {}
        for parent, past, name, key, space in tails:
            by_key.setdefault(space.tail_index(parent), (parent, key, []))[2].append((past, name))
        keys = list(by_key)
        fp, bs = self.keys.fingerprint, self.layout.block_size
        indexes = read_opened(self.store, keys, lambda k, blob: TailIndex.decode(blob, fp, by_key[k][0], bs,
                                                                                 by_key[k][1]))
        updated: list[tuple[str, list[bytes]]] = []
        for k, found in zip(keys, indexes, strict=True):
            parent, key, added = by_key[k]
            if isinstance(found, IntegrityError):
                self.counters.tally("rejected", f"tail index {found.reason}", 1)
            index = found if isinstance(found, TailIndex) else TailIndex(parent, ())
            new = index
            for past, name in added:
                new = new.with_tail(past, name)
            if new != index:
                updated.append((k, [new.encode(self.keys.fingerprint, key)]))
        if updated:
            self.store.put_many(updated)

    def _record(self, hashes: Sequence[bytes], tokens: int, parent: int,
                key: NamespaceKey | None, space: KeySpace) -> tuple[str, bytes]:
        """The key and stored bytes of the record of boundary ``tokens`` extending ``parent``."""
        bs = self.layout.block_size
        n = -(-tokens // bs)
        record = BoundaryRecord(tokens, tuple(hashes[parent // bs : n]), self.layout.world_size, bs,
                                producer_id(), parent=parent,
                                parent_hash=hashes[parent // bs - 1] if parent else b"")
        return space.record(hashes[n - 1]), record.encode(self.keys.fingerprint, key)

    def refuse(self, reason: Refusal, count: int = 1) -> None:
        """Count boundaries the boundary rule refused (for metrics)."""
        self.counters.tally("refused", reason, count)
