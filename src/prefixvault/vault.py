"""The vault protocol: save objects, publish records, look up hits and load verified bytes.

Publish: every rank stores its objects and acknowledges; the coordinator writes the
boundary record last, only when every rank acknowledged every object (invariant 1).
Lookup: records first, then an existence check of every object the chosen record needs,
in two batched round trips whatever the prompt length (invariant 2).
Load: every object is checked against the header the reader expects and its checksum
before its payload is handed out; bad objects are counted and removed (invariant 3).
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prefixvault.boundary import Refusal, SavePlan, choose_hit, max_resume_tokens, needed_blocks
from prefixvault.codec import HEADER_SIZE, IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.keys import ExtraKeys, KeySpace, chain_hashes
from prefixvault.layout import CacheLayout
from prefixvault.records import BoundaryRecord
from prefixvault.stores.base import Buffer, Store


@dataclass(frozen=True)
class ObjectRef:
    """One object a boundary needs: a KV block or a state, of one group on one rank."""

    key: str
    kind: ObjectKind
    group: int
    rank: int
    key_hash: bytes
    tokens: int  # block end (BLOCK) or boundary (STATE)
    block_index: int  # index of the KV block, or of the boundary's last block for a state


@dataclass(frozen=True)
class RankAck:
    """A rank's answer for one boundary: all of its objects are stored (ok) or not."""

    rank: int
    tokens: int
    boundary_hash: bytes
    ok: bool
    reason: Refusal | None = None


@dataclass
class VaultCounters:
    """What the vault did; adapters export these as engine metrics."""

    put_keys: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    put_skipped: int = 0  # already in the store
    get_keys: int = 0
    get_bytes: int = 0
    get_failed: int = 0
    records_published: int = 0
    records_existing: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    lookups: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True)
class Loaded:
    """Verified payloads of a load, and what failed (missing or rejected), by ref."""

    payloads: dict[ObjectRef, memoryview]
    failed: dict[ObjectRef, str]

    @property
    def ok(self) -> bool:
        return not self.failed


def producer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Vault:
    """The protocol for one layout in one namespace of one store."""

    def __init__(self, store: Store, layout: CacheLayout, namespace: str = "default") -> None:
        self.store = store
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.keys = KeySpace(namespace, self.fingerprint)
        self.counters = VaultCounters()
        self._layout_saved = False

    # -- naming -----------------------------------------------------------------------------

    def hashes(
        self, token_ids: Sequence[int], extra: ExtraKeys | None = None, start: Sequence[bytes] = ()
    ) -> list[bytes]:
        return chain_hashes(token_ids, self.layout.block_size, extra, start)

    def needed(
        self, hashes: Sequence[bytes], tokens: int, ranks: Iterable[int] | None = None
    ) -> list[ObjectRef]:
        """Every object (all groups, the given ranks) needed to resume at ``tokens``."""
        bs = self.layout.block_size
        n = tokens // bs
        if tokens % bs or not 0 < n <= len(hashes):
            raise ValueError(f"boundary {tokens} is not a block boundary within {len(hashes)} blocks")
        refs: list[ObjectRef] = []
        for rank in range(self.layout.world_size) if ranks is None else ranks:
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:
                    refs.append(self._state_ref(gi, rank, hashes, n - 1))
                else:
                    blocks = needed_blocks(group, tokens, bs)
                    refs.extend(self._block_ref(gi, rank, hashes, i) for i in blocks)
        return refs

    def _block_ref(self, group: int, rank: int, hashes: Sequence[bytes], i: int) -> ObjectRef:
        bs = self.layout.block_size
        return ObjectRef(self.keys.block(group, rank, hashes[i]), ObjectKind.BLOCK, group, rank,
                         hashes[i], (i + 1) * bs, i)

    def _state_ref(self, group: int, rank: int, hashes: Sequence[bytes], i: int) -> ObjectRef:
        bs = self.layout.block_size
        return ObjectRef(self.keys.state(group, rank, hashes[i]), ObjectKind.STATE, group, rank,
                         hashes[i], (i + 1) * bs, i)

    def expected_header(self, ref: ObjectRef) -> ObjectHeader:
        """The header an object must carry to be used for ``ref``."""
        group = self.layout.groups[ref.group]
        shard = group.shards[ref.rank]
        shape, dtype = _payload_shape(shard)
        return ObjectHeader(ref.kind, self.fingerprint, ref.key_hash, ref.group, ref.rank,
                            ref.tokens, dtype, shape, group.nbytes(ref.rank))

    # -- save (one rank) ----------------------------------------------------------------------

    def save(
        self,
        rank: int,
        hashes: Sequence[bytes],
        plans: Sequence[SavePlan],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None = None,
    ) -> list[RankAck]:
        """Store this rank's objects for every plan; one ack per plan.

        ``read(ref, engine_block_id)`` returns the payload bytes of one object, gathered
        from the engine's cache; ``read_into`` (optional) gathers them into memory given,
        which lets a store that lends registered memory put objects with no copy. KV blocks
        already in the store are not written again.
        """
        wanted: dict[str, tuple[ObjectRef, int]] = {}
        per_plan: list[list[str]] = []
        for plan in plans:
            keys: list[str] = []
            n = plan.tokens // self.layout.block_size
            for gi, i, block_id in plan.blocks:
                ref = self._block_ref(gi, rank, hashes, i)
                wanted.setdefault(ref.key, (ref, block_id))
                keys.append(ref.key)
            for gi, block_id in plan.states:
                ref = self._state_ref(gi, rank, hashes, n - 1)
                wanted[ref.key] = (ref, block_id)
                keys.append(ref.key)
            per_plan.append(keys)
        ok_keys = self._put_missing(list(wanted.values()), read, read_into)
        acks = []
        for plan, keys in zip(plans, per_plan, strict=True):
            good = all(k in ok_keys for k in keys)
            n = plan.tokens // self.layout.block_size
            acks.append(RankAck(rank, plan.tokens, hashes[n - 1], good,
                                None if good else Refusal.STORE_ERROR))
        return acks

    def _put_missing(
        self,
        items: list[tuple[ObjectRef, int]],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None,
    ) -> set[str]:
        blocks = [ref.key for ref, _ in items]
        present = {k for k, e in zip(blocks, self.store.exists_many(blocks), strict=True) if e}
        self.counters.put_skipped += len(present)
        todo = [(ref, bid) for ref, bid in items if ref.key not in present]
        headers = [self.expected_header(ref) for ref, _ in todo]
        lent = None
        if read_into is not None and todo:
            lent = self.store.staging_buffer(sum(HEADER_SIZE + h.length for h in headers))
        batch: list[tuple[str, Sequence[Buffer]]] = []
        off = 0
        for (ref, block_id), header in zip(todo, headers, strict=True):
            if lent is not None and read_into is not None:  # build the object in place
                payload = lent[off + HEADER_SIZE : off + HEADER_SIZE + header.length]
                read_into(ref, block_id, payload)
                lent[off : off + HEADER_SIZE] = encode(header, payload)[0]
                batch.append((ref.key, [lent[off : off + HEADER_SIZE + header.length]]))
                off += HEADER_SIZE + header.length
            else:
                batch.append((ref.key, encode(header, read(ref, block_id))))
        results = self.store.put_many(batch) if batch else []
        ok = set(present)
        for (ref, _), header, stored in zip(todo, headers, results, strict=True):
            if stored:
                ok.add(ref.key)
                self.counters.put_keys += 1
                self.counters.put_bytes += HEADER_SIZE + header.length
            else:
                self.counters.put_failed += 1
        return ok

    # -- publish (coordinator) ------------------------------------------------------------------

    def publish(self, hashes: Sequence[bytes], tokens: int, acks: Iterable[RankAck]) -> Refusal | None:
        """Write the record of boundary ``tokens`` if every rank acknowledged it; else say why not."""
        n = tokens // self.layout.block_size
        acked = {a.rank for a in acks if a.ok and a.tokens == tokens and a.boundary_hash == hashes[n - 1]}
        if acked != set(range(self.layout.world_size)):
            self.counters.refused[Refusal.MISSING_RANK] += 1
            return Refusal.MISSING_RANK
        self._put_record(hashes, tokens)
        return None

    def publish_when_complete(self, hashes: Sequence[bytes], tokens: int) -> bool:
        """Write the record of ``tokens`` if every object of every rank is stored.

        For ranks that cannot exchange acknowledgements: each rank calls this after its own
        puts were acknowledged, and the last one to finish sees every object and publishes.
        """
        if self.layout.world_size > 1:
            keys = [r.key for r in self.needed(hashes, tokens)]
            if not all(self.store.exists_many(keys)):
                return False
        self._put_record(hashes, tokens)
        return True

    def _put_record(self, hashes: Sequence[bytes], tokens: int) -> None:
        n = tokens // self.layout.block_size
        self._save_layout()
        record = BoundaryRecord(tokens, tuple(hashes[:n]), self.layout.world_size, producer_id())
        if self.store.put_if_absent(self.keys.record(hashes[n - 1]), record.encode(self.fingerprint)):
            self.counters.records_published += 1
        else:
            self.counters.records_existing += 1

    def refuse(self, reason: Refusal, count: int = 1) -> None:
        """Count boundaries the boundary rule refused (for metrics)."""
        self.counters.refused[reason] += count

    def _save_layout(self) -> None:
        if not self._layout_saved:
            import json

            data = json.dumps(self.layout.to_json(), sort_keys=True).encode()
            header = ObjectHeader(ObjectKind.LAYOUT, self.fingerprint, self.fingerprint, length=len(data))
            self.store.put_if_absent(self.keys.layout(), b"".join(bytes(p) for p in encode(header, data)))
            self._layout_saved = True

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int = 0) -> int:
        """Tokens of the longest published, still complete boundary beyond ``min_tokens``; 0 if none."""
        self.counters.lookups += 1
        bs = self.layout.block_size
        limit = min(max_resume_tokens(prompt_tokens, bs), len(hashes) * bs)
        candidates = list(range(limit, min_tokens, -bs))
        if not candidates:
            return 0
        record_keys = [self.keys.record(hashes[b // bs - 1]) for b in candidates]
        published = [b for b, e in zip(candidates, self.store.exists_many(record_keys), strict=True) if e]
        if not published:
            return 0
        needs = {b: [r.key for r in self.needed(hashes, b)] for b in published}
        union = sorted({k for keys in needs.values() for k in keys})
        present = {k for k, e in zip(union, self.store.exists_many(union), strict=True) if e}
        hit = choose_hit(published, prompt_tokens, bs, lambda b: all(k in present for k in needs[b]))
        self.counters.hit_tokens += hit
        return hit

    # -- load --------------------------------------------------------------------------------------

    def load(self, refs: Sequence[ObjectRef], staging: np.ndarray | None = None) -> Loaded:
        """Fetch and verify objects; bad ones are counted, removed from the store and reported.

        Payloads may be views of memory the store lent: use them before the next call on the
        same store."""
        headers = [self.expected_header(r) for r in refs]
        sizes = [HEADER_SIZE + h.length for h in headers]
        total = sum(sizes)
        if staging is not None and staging.nbytes >= total:
            buf = staging.data.cast("B")
        else:  # memory the store can fill directly, where it has such memory
            buf = self.store.staging_buffer(total) or np.empty(total, dtype=np.uint8).data.cast("B")
        views, off = [], 0
        for s in sizes:
            views.append(buf[off : off + s])
            off += s
        got = self.store.get_into([r.key for r in refs], views)
        payloads: dict[ObjectRef, memoryview] = {}
        failed: dict[ObjectRef, str] = {}
        bad_keys: list[str] = []
        for ref, header, view, size in zip(refs, headers, views, got, strict=True):
            if size is None:
                failed[ref] = "missing"
                self.counters.get_failed += 1
                continue
            try:
                if size != len(view):
                    raise IntegrityError("length", f"object has {size} bytes, expected {len(view)}")
                _, payload = decode(view, header)
            except IntegrityError as e:
                failed[ref] = e.reason
                self.counters.rejected[e.reason] += 1
                self.counters.get_failed += 1
                bad_keys.append(ref.key)
                continue
            payloads[ref] = payload
            self.counters.get_keys += 1
            self.counters.get_bytes += size
        if bad_keys:
            self.store.delete_many(bad_keys)
        return Loaded(payloads, failed)


def _payload_shape(shard: Sequence[object]) -> tuple[tuple[int, ...], str]:
    """Header shape and dtype of a shard: the tensor's own if it is one tensor, else flat bytes."""
    from prefixvault.layout import TensorSpec

    specs = [s for s in shard if isinstance(s, TensorSpec)]
    if len(specs) == 1:
        return specs[0].shape, specs[0].dtype
    return (sum(s.nbytes for s in specs),), "uint8"
