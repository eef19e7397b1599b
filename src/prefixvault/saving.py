"""Saves: one rank stores its objects of the boundaries a step may publish, and says per
boundary whether all of them are stored (``publishing.RankAck``, the answers records are
published from: invariant 1).

One existence check and one batched put per call, whatever the number of prefixes: objects
already stored are not written again (a state, or an object the deny-list names, is read and
verified first), and bytes the deny-list names are never stored. Each object is encrypted with
the key of the tenant its ref names (``ObjectRef.salt``, ``tenancy``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixvault.boundary import Refusal, SavePlan
from prefixvault.codec import (
    HEADER_SIZE,
    IntegrityError,
    ObjectHeader,
    ObjectKind,
    decode,
    encode,
    encode_into,
)
from prefixvault.counters import Counters
from prefixvault.denysync import DenySync
from prefixvault.layout import CacheLayout
from prefixvault.objects import ObjectNames, ObjectRef, chain_order
from prefixvault.publishing import RankAck
from prefixvault.read_twice import read_opened
from prefixvault.stores.base import Buffer, Fill, Store
from prefixvault.tenancy import NamespaceKey, TenantKeys


@dataclass(eq=False)
class Saver:
    """Stores the objects of save plans, rank by rank, in ``store``."""

    store: Store
    layout: CacheLayout
    names: ObjectNames
    tenants: TenantKeys  # the key of each ref's tenant
    counters: Counters  # put_*, and what was refused (``rejected``)
    deny: DenySync

    def save_many(
        self,
        rank: int,
        saves: Sequence[tuple[Sequence[bytes], Sequence[SavePlan]]],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None = None,
        salts: Sequence[str | None] | None = None,
    ) -> list[list[RankAck]]:
        """Store this rank's objects for every plan of several prefixes, (hashes, plans) each:
        one existence check and one batch put for all their objects (the same key is the same
        bytes, whichever prefix names it); the acks of each, in order.

        ``read(ref, engine_block_id)`` returns the payload bytes of one object, gathered
        from the engine's cache; ``read_into`` (optional) gathers them into memory given,
        which lets a store that lends registered memory put objects with no copy. ``salts``: each
        prefix's cache salt (its tenant), None for all: the namespace's key."""
        wanted: dict[str, tuple[ObjectRef, int]] = {}
        per_save: list[list[list[str]]] = []
        for j, (hashes, plans) in enumerate(saves):
            objects, per_plan = self.names.objects_of(rank, hashes, plans, salts[j] if salts else None)
            for ref, block_id in objects:
                wanted.setdefault(ref.key, (ref, block_id))
            per_save.append(per_plan)
        ok_keys = self._put_missing(list(wanted.values()), read, read_into)
        out: list[list[RankAck]] = []
        for (hashes, plans), per_plan in zip(saves, per_save, strict=True):
            acks = []
            for plan, keys in zip(plans, per_plan, strict=True):
                good = all(k in ok_keys for k in keys)
                n = -(-plan.tokens // self.layout.block_size)  # (a tail boundary: its tail hash, last)
                acks.append(RankAck(rank, plan.tokens, hashes[n - 1], good,
                                    None if good else Refusal.STORE_ERROR))
            out.append(acks)
        return out

    def _put_missing(
        self,
        items: list[tuple[ObjectRef, int]],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None,
    ) -> set[str]:
        """Put the objects of ``items`` the store lacks; the keys stored now (found or put)."""
        items = sorted(items, key=lambda item: chain_order(item[0]))  # the store ranks them so
        self.deny.refresh()
        blocks = [ref.key for ref, _ in items]
        present = {k for k, e in zip(blocks, self.store.exists_many(blocks), strict=True) if e}
        present -= self._recheck_present([ref for ref, _ in items if ref.key in present])
        self.counters.add(put_skipped=len(present))
        todo = [(ref, bid) for ref, bid in items if ref.key not in present]
        headers = [self.names.expected_header(ref) for ref, _ in todo]
        lent = None
        if read_into is not None and todo:
            lent = self.store.staging_buffer(sum(HEADER_SIZE + h.length for h in headers))
        batch: list[tuple[str, Sequence[Buffer]]] = []
        filled: list[tuple[str, int, Fill]] = []  # encrypted straight into the store's memory
        sent: list[tuple[ObjectRef, ObjectHeader]] = []
        off = 0
        for (ref, block_id), header in zip(todo, headers, strict=True):
            size = HEADER_SIZE + header.length
            key = self.tenants.get(ref.salt)
            if lent is not None and read_into is not None:  # build the object in place
                into = lent[off + HEADER_SIZE : off + size]
                read_into(ref, block_id, into)
                payload: Buffer = into
                denied = self.deny.denied(ref.key, header, payload)
                if not denied:
                    encode_into(header, payload, lent[off : off + size], key)
                parts: Sequence[Buffer] = [lent[off : off + size]]
                off += size
            else:
                payload = read(ref, block_id)
                denied = self.deny.denied(ref.key, header, payload)
                parts = encode(header, payload) if key is None else []
            if denied:  # this engine computed the bytes proved wrong again: no record follows
                self.counters.add(put_denied=1)
                self.counters.add(put_failed=1)
                self.counters.tally("rejected", "denied", 1)
                continue
            if parts:
                batch.append((ref.key, parts))
            else:
                filled.append((ref.key, size, self._encrypting(header, payload, key)))
            sent.append((ref, header))
        # (one of the two at most: objects are encrypted by ``filled`` only where none is built in place)
        results = self.store.put_filled(filled) if filled else self.store.put_many(batch) if batch else []
        ok = set(present)
        for (ref, header), stored in zip(sent, results, strict=True):
            if stored:
                ok.add(ref.key)
                self.counters.add(put_keys=1)
                self.counters.add(put_bytes=HEADER_SIZE + header.length)
            else:
                self.counters.add(put_failed=1)
        return ok

    @staticmethod
    def _encrypting(header: ObjectHeader, payload: Buffer, key: NamespaceKey | None) -> Fill:
        """What writes ``payload``'s encrypted object into the memory a store gives."""

        def fill(dst: memoryview) -> None:
            encode_into(header, payload, dst, key)

        return fill

    def _recheck_present(self, refs: list[ObjectRef]) -> set[str]:
        """Of objects a save found present, the keys it must write again (removed here): a
        state, or any object of a key the deny-list names, is read and verified before the
        put is skipped (one that fails is read once more: only a second failure makes it
        written again). A state is what a boundary alone relies on, and one found present is
        rare (another producer saved the same boundary), so reading it costs less than the
        write it saves; KV blocks are shared by many prefixes and found present on most
        saves, so they are left to the load that needs them (which removes a bad one, and
        the next save writes it again)."""
        suspect = {r.key: r for r in refs if r.kind is ObjectKind.STATE or self.deny.listed(r.key)}
        if not suspect:
            return set()

        def denied(key: str, blob: bytes) -> bool:
            ref = suspect[key]
            header = self.names.expected_header(ref)
            _, payload = decode(blob, header, self.tenants.get(ref.salt))
            return self.deny.denied(key, header, payload)

        bad: list[str] = []
        gone: set[str] = set()
        # (what does not verify is read once more: a torn read proves nothing; ``read_twice``)
        for key, verdict in zip(suspect, read_opened(self.store, list(suspect), denied), strict=True):
            if verdict is None:
                gone.add(key)  # evicted since the existence check
            elif isinstance(verdict, IntegrityError) or verdict:
                reason = verdict.reason if isinstance(verdict, IntegrityError) else "denied"
                self.counters.tally("rejected", reason, 1)
                bad.append(key)
        if bad:
            self.store.delete_many(bad)
        return gone | set(bad)
