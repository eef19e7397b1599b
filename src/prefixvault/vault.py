"""The vault protocol: save objects, publish records, look up hits and load verified bytes.

Publish: every rank stores its objects; a record is written last, only when every object of
every rank is acknowledged or seen in the store (invariant 1). A record lists its segment of
the hash chain and points at the earlier record it extends, so record bytes and publish work
grow with what a step computed, not with the prompt.
Lookup: records first, then an existence check of every object the published candidates
need, in two batched round trips whatever the prompt length, in time linear in the prompt
(invariant 2); on a network store, where the objects of every candidate are few, they are
checked beside the records, and a hit is answered after one round trip (its objects are
touched afterwards).
Load: every object is checked against the header the reader expects and its checksum
(its MAC, in a namespace with a secret) before its payload is handed out; bad objects are
counted and removed (invariant 3).
A record is the marker that a boundary's objects were all stored; a lookup reads a hit's
record only where the deny-list names it (a replayed copy of a quarantined record is refused,
removed, and the lookup answers from what is left): every object is verified where it is
loaded. Bytes proved wrong (``quarantine``) are listed in the namespace's deny-list
(``denylist``) and refused by loads, saves and lookups until they expire.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from prefixvault.boundary import Refusal, SavePlan, choose_hit, max_resume_tokens, needed_blocks
from prefixvault.codec import (
    HEADER_SIZE,
    PROVED_WRONG,
    IntegrityError,
    ObjectHeader,
    ObjectKind,
    content_digest,
    decode,
    encode,
)
from prefixvault.codec import VERSION as CODEC_VERSION
from prefixvault.counters import Counters
from prefixvault.coverage import Coverage
from prefixvault.denylist import DENY_REFRESH_S, DENY_TTL_S, DenyList
from prefixvault.hotset import HotSet
from prefixvault.keys import ExtraKeys, KeySpace, chain_hashes
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.records import RECORD_VERSION, BoundaryRecord
from prefixvault.stores.base import Buffer, Store, StoreError
from prefixvault.tenancy import NamespaceKey

#: How often a publishing vault reads its stored layout back to check it (seconds).
LAYOUT_VERIFY_S = 300.0
#: On a network store (``Store.remote``) a lookup checks the objects of every candidate
#: boundary beside the records (one round trip instead of two) when they are at most this many
#: keys: the extra keys a miss then checks cost less than a second round trip.
SPECULATIVE_KEYS = 512

#: A lookup whose hit's record does not verify answers again from what is left, at most this
#: many times (each bad record is removed first), then reports a miss.
RECORD_RETRIES = 3

#: Keys to touch after a lookup answered, and which of them (``Store.touch_many``'s arguments).
_Touch = tuple[list[str], list[bool]]


def _is_layout(blob: bytes, expected: bytes, key: NamespaceKey | None) -> bool:
    """Whether ``blob`` verifies and says what ``expected`` says (sealed copies differ in
    their nonce and tag, so their payloads are compared)."""
    try:
        header, payload = decode(blob, key=key)
        want_header, want = decode(expected, key=key)
    except IntegrityError:
        return False
    return header == want_header and payload == want


#: Keys a vault remembers having read, to count bytes read again (``reread_bytes``).
READS_SEEN = 1 << 16

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


class Miss(StrEnum):
    """Why a lookup restored less than the longest block-aligned prefix it could have."""

    SHORT_PROMPT = "short_prompt"  # no block-aligned prefix leaves a prompt token to compute
    LOCAL_HIT = "local_hit"  # the engine's own cache already holds the longest one
    NO_RECORD = "no_record"  # nothing published there (for this layout, namespace and salt)
    NO_STATE = "no_state"  # KV blocks are stored past the hit, but no exact state was kept there
    EVICTED = "evicted"  # published, but objects it needs are gone from the store
    STORE_ERROR = "store_error"  # the store failed during the lookup
    BREAKER_OPEN = "breaker_open"  # the store failed too often lately and was not called
    LOOKUP_TIMEOUT = "lookup_timeout"  # the lookup took longer than the connector's lookup_timeout
    INTERNAL_ERROR = "internal_error"  # an error of prefixvault's own (a bug: logged with its traceback)
    BUSY = "busy"  # the connector's lookup queue was full, or it was shutting down: not looked up


@dataclass(frozen=True)
class LookupResult:
    hit: int  # tokens of the boundary to restore, 0 if none
    longest: int  # the longest block-aligned prefix that leaves a token to compute
    miss: Miss | None  # why ``hit < longest``; None when it is not


@dataclass
class VaultCounters(Counters):
    """What the vault did; adapters export these as engine metrics (the lookup, load and
    save threads all count into one vault)."""

    put_keys: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    put_skipped: int = 0  # already in the store
    put_denied: int = 0  # bytes this producer computed are in the deny-list: not stored
    get_keys: int = 0
    get_bytes: int = 0
    get_failed: int = 0
    hot_keys: int = 0  # objects a load took from the hot set, not the store
    hot_bytes: int = 0
    reread_bytes: int = 0  # bytes read for objects this vault had read before (of the last READS_SEEN)
    records_published: int = 0
    layout_writes: int = 0
    records_existing: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    lookup_asks: int = 0  # prompts looked up in the store (the connector's ``lookups`` are requests)
    found_tokens: int = 0  # tokens those lookups found (the connector's ``hit_tokens`` are loaded)
    misses: Counter[str] = field(default_factory=Counter)  # lookups short of the longest prefix, by Miss


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


def chain_order(ref: ObjectRef) -> tuple[int, bool]:
    """Where an object sits in its prefix's chain: by block, a block's KV before the state at
    its end. Objects are handed to the store in this order, and a store ranks keys used
    together in the order given (the first kept longest), so a chain ages from its tail."""
    return ref.tokens, ref.kind is ObjectKind.STATE


class Vault:
    """The protocol for one layout in one namespace of one store.

    With ``key`` (the namespace's secret, derived) hashes are keyed and every object and
    record is sealed and must verify as sealed with it."""

    def __init__(self, store: Store, layout: CacheLayout, namespace: str = "default",
                 key: NamespaceKey | None = None, hot_bytes: int = 0) -> None:
        """``hot_bytes``: memory for objects recently loaded, served again without the store
        (``HotSet``; 0: none)."""
        if key is not None and key.namespace != namespace:
            raise ValueError(f"namespace key for {key.namespace!r} given to namespace {namespace!r}")
        self.store = store
        self.layout = layout
        # The formats objects and records are written in are part of the name of everything
        # stored: engines of two versions on one store use disjoint keys, never each other's.
        self.fingerprint = layout.fingerprint(formats=(CODEC_VERSION, RECORD_VERSION))
        self.keys = KeySpace(namespace, self.fingerprint, key.tag if key is not None else "")
        self.key = key
        self._hash_key = key.hash_key if key is not None else b""
        self.counters = VaultCounters()
        self._layout_verified: float | None = None  # monotonic time the stored layout was last read
        # Bytes proved wrong in this namespace and layout: only ever grows between reads of
        # the stored list (merged, never replaced), so a deleted list cannot undo a quarantine
        # this vault has seen.
        self.deny = DenyList()
        self._deny_read: float | None = None  # monotonic time the stored list was last read
        self._deny_blob: bytes | None = None  # the stored list as last read
        self.hot = HotSet(hot_bytes) if hot_bytes > 0 else None
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of the keys read last (READS_SEEN)

    # -- naming -----------------------------------------------------------------------------

    def hashes(
        self, token_ids: Sequence[int], extra: ExtraKeys | None = None, start: Sequence[bytes] = ()
    ) -> list[bytes]:
        return chain_hashes(token_ids, self.layout.block_size, extra, start, self._hash_key)

    def needed(
        self, hashes: Sequence[bytes], tokens: int, ranks: Iterable[int] | None = None, since: int = 0
    ) -> list[ObjectRef]:
        """Every object (all groups, the given ranks) needed to resume at ``tokens``; KV blocks
        only from boundary ``since`` on (those before it are covered elsewhere: a parent record,
        or the engine's own cache)."""
        bs = self.layout.block_size
        n = tokens // bs
        if tokens % bs or not 0 < n <= len(hashes):
            raise ValueError(f"boundary {tokens} is not a block boundary within {len(hashes)} blocks")
        first = since // bs if 0 < since < tokens else 0
        refs: list[ObjectRef] = []
        for rank in range(self.layout.world_size) if ranks is None else ranks:
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:
                    refs.append(self._state_ref(gi, rank, hashes, n - 1))
                else:
                    need = needed_blocks(group, tokens, bs)
                    refs.extend(self._block_ref(gi, rank, hashes, i)
                                for i in range(max(first, need.start), need.stop))
        return refs

    def _block_ref(self, group: int, rank: int, hashes: Sequence[bytes], i: int) -> ObjectRef:
        return self.block_ref(group, rank, hashes[i], i)

    def _state_ref(self, group: int, rank: int, hashes: Sequence[bytes], i: int) -> ObjectRef:
        return self.state_ref(group, rank, hashes[i], i)

    def block_ref(self, group: int, rank: int, block_hash: bytes, i: int) -> ObjectRef:
        """KV block ``i`` (named by its chain hash) of an attention group on ``rank``."""
        return ObjectRef(self.keys.block(group, rank, block_hash), ObjectKind.BLOCK, group, rank,
                         block_hash, (i + 1) * self.layout.block_size, i)

    def state_ref(self, group: int, rank: int, boundary_hash: bytes, i: int) -> ObjectRef:
        """The state of a state group on ``rank`` at the end of block ``i``."""
        return ObjectRef(self.keys.state(group, rank, boundary_hash), ObjectKind.STATE, group, rank,
                         boundary_hash, (i + 1) * self.layout.block_size, i)

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
        return self.save_many(rank, [(hashes, plans)], read, read_into)[0]

    def save_many(
        self,
        rank: int,
        saves: Sequence[tuple[Sequence[bytes], Sequence[SavePlan]]],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None = None,
    ) -> list[list[RankAck]]:
        """``save`` for several prefixes at once, (hashes, plans) each: one existence check
        and one batch put for all their objects (the same key is the same bytes, whichever
        prefix names it); the acks of each, in order."""
        wanted: dict[str, tuple[ObjectRef, int]] = {}
        per_save: list[list[list[str]]] = []
        for hashes, plans in saves:
            objects, per_plan = self.objects_of(rank, hashes, plans)
            for ref, block_id in objects:
                wanted.setdefault(ref.key, (ref, block_id))
            per_save.append(per_plan)
        ok_keys = self._put_missing(list(wanted.values()), read, read_into)
        out: list[list[RankAck]] = []
        for (hashes, plans), per_plan in zip(saves, per_save, strict=True):
            acks = []
            for plan, keys in zip(plans, per_plan, strict=True):
                good = all(k in ok_keys for k in keys)
                n = plan.tokens // self.layout.block_size
                acks.append(RankAck(rank, plan.tokens, hashes[n - 1], good,
                                    None if good else Refusal.STORE_ERROR))
            out.append(acks)
        return out

    def objects_of(
        self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan]
    ) -> tuple[list[tuple[ObjectRef, int]], list[list[str]]]:
        """The distinct objects ``plans`` store on ``rank``, each with the engine block it is
        read from, and each plan's object keys."""
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
        return list(wanted.values()), per_plan

    def _put_missing(
        self,
        items: list[tuple[ObjectRef, int]],
        read: Callable[[ObjectRef, int], Buffer],
        read_into: Callable[[ObjectRef, int, memoryview], None] | None,
    ) -> set[str]:
        items = sorted(items, key=lambda item: chain_order(item[0]))  # the store ranks them so
        self.refresh_deny()
        blocks = [ref.key for ref, _ in items]
        present = {k for k, e in zip(blocks, self.store.exists_many(blocks), strict=True) if e}
        present -= self._recheck_present([ref for ref, _ in items if ref.key in present])
        self.counters.add(put_skipped=len(present))
        todo = [(ref, bid) for ref, bid in items if ref.key not in present]
        headers = [self.expected_header(ref) for ref, _ in todo]
        lent = None
        if read_into is not None and todo:
            lent = self.store.staging_buffer(sum(HEADER_SIZE + h.length for h in headers))
        batch: list[tuple[str, Sequence[Buffer]]] = []
        sent: list[tuple[ObjectRef, ObjectHeader]] = []
        off = 0
        for (ref, block_id), header in zip(todo, headers, strict=True):
            if lent is not None and read_into is not None:  # build the object in place
                into = lent[off + HEADER_SIZE : off + HEADER_SIZE + header.length]
                read_into(ref, block_id, into)
                payload: Buffer = into
                parts: Sequence[Buffer] = [lent[off : off + HEADER_SIZE + header.length]]
                denied = self._is_denied(ref.key, header, payload)
                if not denied:
                    lent[off : off + HEADER_SIZE] = encode(header, payload, self.key)[0]
                off += HEADER_SIZE + header.length
            else:
                payload = read(ref, block_id)
                denied = self._is_denied(ref.key, header, payload)
                parts = encode(header, payload, self.key)
            if denied:  # this engine computed the bytes proved wrong again: no record follows
                self.counters.add(put_denied=1)
                self.counters.add(put_failed=1)
                self.counters.tally("rejected", "denied", 1)
                continue
            batch.append((ref.key, parts))
            sent.append((ref, header))
        results = self.store.put_many(batch) if batch else []
        ok = set(present)
        for (ref, header), stored in zip(sent, results, strict=True):
            if stored:
                ok.add(ref.key)
                self.counters.add(put_keys=1)
                self.counters.add(put_bytes=HEADER_SIZE + header.length)
            else:
                self.counters.add(put_failed=1)
        return ok

    def _recheck_present(self, refs: list[ObjectRef]) -> set[str]:
        """Of objects a save found present, the keys it must write again (removed here): a
        state, or any object of a key the deny-list names, is read and verified before the
        put is skipped. A state is what a boundary alone relies on, and one found present is
        rare (another producer saved the same boundary), so reading it costs less than the
        write it saves; KV blocks are shared by many prefixes and found present on most
        saves, so they are left to the load that needs them (which removes a bad one, and
        the next save writes it again)."""
        suspect = [r for r in refs if r.kind is ObjectKind.STATE or self._suffix(r.key) in self.deny]
        if not suspect:
            return set()
        bad: list[str] = []
        gone: set[str] = set()
        for ref, blob in zip(suspect, self.store.get_many([r.key for r in suspect]), strict=True):
            if blob is None:
                gone.add(ref.key)  # evicted since the existence check
                continue
            header = self.expected_header(ref)
            try:
                _, payload = decode(blob, header, self.key)
            except IntegrityError as e:
                self.counters.tally("rejected", e.reason, 1)
                bad.append(ref.key)
                continue
            if self._is_denied(ref.key, header, payload):
                self.counters.tally("rejected", "denied", 1)
                bad.append(ref.key)
        if bad:
            self.store.delete_many(bad)
        return gone | set(bad)

    # -- the deny-list ---------------------------------------------------------------------------

    def _suffix(self, key: str) -> str:
        """A key of this namespace and layout, as the deny-list names it."""
        return key[len(self.keys.prefix):]

    def deny_key(self) -> str:
        return self.keys.deny()

    def _is_denied(self, key: str, header: ObjectHeader, payload: Buffer) -> bool:
        """Whether these bytes for ``key`` were proved wrong (a digest only where the key is
        listed: an empty or unrelated list costs a dict lookup)."""
        suffix = self._suffix(key)
        return suffix in self.deny and self.deny.denied(suffix, content_digest(header, payload))

    def _deny_due(self) -> bool:
        return self._deny_read is None or time.monotonic() - self._deny_read >= DENY_REFRESH_S

    def refresh_deny(self, force: bool = False) -> None:
        """Read the stored deny-list when it is due (every ``DENY_REFRESH_S``)."""
        if force or self._deny_due():
            self._take_deny(self.store.get_many([self.deny_key()])[0])

    def _take_deny(self, blob: bytes | None) -> None:
        """Merge the stored list into this vault's; write the union back where the stored
        one lacks entries this vault holds (deleted, evicted, or lost to a racing writer)."""
        self._deny_read = time.monotonic()
        if blob is not None and blob == self._deny_blob:
            return  # unchanged since the last read (the common case): nothing to merge
        self._deny_blob = blob
        stored = DenyList()
        if blob is not None:
            try:
                stored = DenyList.decode(blob, self.fingerprint, self.key)
            except IntegrityError as e:  # forged, or of another key: ours replaces it
                self.counters.tally("rejected", f"deny-list {e.reason}", 1)
        self.deny.merge(stored)
        self.deny.prune()
        if len(self.deny) and DenyList(dict(stored.entries)).merge(self.deny):
            mine = self.deny.encode(self.fingerprint, self.key)
            with contextlib.suppress(StoreError):  # read-only: this vault still refuses what it holds
                if self.store.put_many([(self.deny_key(), [mine])])[0]:
                    self._deny_blob = mine

    def deny_objects(self, digests: Sequence[tuple[str, bytes]], ttl: float = DENY_TTL_S) -> None:
        """List (key, content digest) pairs as proved wrong, and store the list at once."""
        expires = time.time() + ttl
        for key, digest in digests:
            self.deny.add(self._suffix(key), digest, expires)
        self.refresh_deny(force=True)  # merges what is stored and writes the union back

    def quarantine(self, record_key: str) -> list[str]:
        """Take out a boundary proved wrong (``watch``): its record and the states at its
        boundary (every state group, every rank) are listed in the deny-list, then removed.
        Returns the keys removed. The KV blocks of its segment stay: a block is named by its
        tokens alone and shared by every prefix through it (a boundary published with no
        parent names every block from the first), so a wrong restore at one boundary proves
        nothing against them, and listing them would refuse the right bytes of every other
        boundary for as long as the entry lives. What a wrong restore implicates, and what the
        seed bug's class of errors gets wrong, is the state at the boundary."""
        prefix = self.keys.record_prefix()
        hexed = record_key[len(prefix):] if record_key.startswith(prefix) else ""
        try:
            boundary = bytes.fromhex(hexed)
        except ValueError:
            boundary = b""
        if len(boundary) != len(self.fingerprint):
            raise ValueError(f"{record_key[:200]!r} is not a record key of this namespace and layout")
        blob = self.store.get_many([record_key])[0]
        record: BoundaryRecord | None = None
        digests: list[tuple[str, bytes]] = []
        if blob is not None:
            try:
                header, body = decode(blob, key=self.key)
                record = BoundaryRecord.decode(blob, self.fingerprint, self.key)
                if record.boundary_hash != boundary or record.block_size != self.layout.block_size:
                    record = None
                else:
                    digests.append((record_key, content_digest(header, body)))
            except IntegrityError:
                record = None
        refs: list[ObjectRef] = []
        bs, ranks = self.layout.block_size, range(self.layout.world_size)
        states = [(gi, r) for gi, g in enumerate(self.layout.groups) if g.is_state for r in ranks]
        if record is not None:
            refs.extend(self.state_ref(gi, r, boundary, record.tokens // bs - 1) for gi, r in states)
        else:  # the boundary's token count is unknown: its states say it
            keys = [self.keys.state(gi, r, boundary) for gi, r in states]
            for (gi, r), found in zip(states, self.store.get_many(keys), strict=True):
                with contextlib.suppress(IntegrityError):
                    h = decode(found, key=self.key)[0] if found is not None else None
                    if h is not None and h.tokens > 0 and h.tokens % bs == 0:
                        refs.append(self.state_ref(gi, r, boundary, h.tokens // bs - 1))
        for ref, got in zip(refs, self.store.get_many([r.key for r in refs]), strict=True):
            if got is None:
                continue
            header = self.expected_header(ref)
            try:
                _, body = decode(got, header, self.key)
            except IntegrityError:
                continue  # refused by every load anyway; removed below
            digests.append((ref.key, content_digest(header, body)))
        if digests:
            self.deny_objects(digests)
        keys = list(dict.fromkeys([record_key, *(r.key for r in refs)]))
        self.store.delete_many(keys)
        return keys

    # -- publish ------------------------------------------------------------------------------

    def publish(
        self, hashes: Sequence[bytes], acks: Iterable[RankAck], parent: int = 0
    ) -> dict[int, Refusal | None]:
        """Write the records of the acknowledged boundaries that every rank has stored.

        ``acks`` are the answers of ``save`` (this rank's, or every rank's where a coordinator
        gathers them). A rank without an ok ack for a boundary is checked in the store, so
        ranks that cannot exchange acknowledgements each publish after their own puts: the
        last to finish sees every object. ``parent`` is an earlier boundary of the same prefix
        whose record covers the KV blocks the saves skipped (``plan_saves(since=parent)``);
        if that record is gone, the blocks before it are checked in the store instead.
        Returns, per boundary, None if its record exists now, else why not.
        """
        return self.publish_many([(hashes, acks, parent)])[0]

    def publish_many(
        self, publishes: Sequence[tuple[Sequence[bytes], Iterable[RankAck], int]]
    ) -> list[dict[int, Refusal | None]]:
        """``publish`` for several prefixes at once, (hashes, acks, parent) each, in the round
        trips of one: one existence check for all of them, then one conditional put of all
        their records (a slow store is paid per batch, not per save). A record names the one
        before it, so each prefix's records are built in order as ``publish`` builds them, and
        a save may continue one an earlier save of the batch publishes (the same request's
        previous step): that parent is put first. A record two prefixes both publish is put
        once (the first built)."""
        bs = self.layout.block_size
        world = set(range(self.layout.world_size))
        outs: list[dict[int, Refusal | None]] = []
        plans: list[tuple[Sequence[bytes], list[int], int, dict[int, list[str]]]] = []
        keys: list[str] = []
        for hashes, acks, parent in publishes:
            acked: dict[int, set[int]] = {}
            failed: set[int] = set()
            for a in acks:
                n = a.tokens // bs
                if a.tokens % bs or not 0 < n <= len(hashes) or a.boundary_hash != hashes[n - 1]:
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
                    keys.append(self.keys.record(hashes[parent // bs - 1]))
                for b in todo:
                    missing_ranks = sorted(world - acked[b])
                    if missing_ranks:
                        checks[b] = [r.key for r in self.needed(hashes, b, missing_ranks, since=parent)]
                        keys.extend(checks[b])
            plans.append((hashes, todo, parent, checks))
        # One round trip: every parent record, and every object of a rank that did not ack.
        unique = list(dict.fromkeys(keys))
        present = dict(zip(unique, self.store.exists_many(unique), strict=True)) if unique else {}
        records: dict[str, bytes] = {}  # put in this order: a parent before the records naming it
        for (hashes, todo, parent, checks), out in zip(plans, outs, strict=True):
            if not todo:
                continue
            parent_key = self.keys.record(hashes[parent // bs - 1]) if parent else ""
            # A parent published by an earlier save of this batch (the same request's previous
            # step) is as good as one already stored.
            if parent and not (present[parent_key] or parent_key in records):
                # The parent's record is gone: publish from the first block if the blocks it
                # covered are all still stored (one more round trip, only on this path).
                early = sorted({r.key for r in self.needed(hashes, todo[0], since=0)
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
                key, blob = self._record(hashes, b, parent)
                if key in records:  # another prefix of this batch publishes the same boundary
                    self.counters.add(records_existing=1)
                else:
                    records[key] = blob
                out[b] = None
                parent = b
        if records:
            stored = self.store.put_if_absent_many(list(records.items()))
            self.counters.add(records_published=sum(stored))
            self.counters.add(records_existing=len(stored) - sum(stored))
            self.keep_layout()  # after the records: never older than a record that needs it
        return outs

    def _record(self, hashes: Sequence[bytes], tokens: int, parent: int) -> tuple[str, bytes]:
        """The key and stored bytes of the record of boundary ``tokens`` extending ``parent``."""
        bs = self.layout.block_size
        n = tokens // bs
        record = BoundaryRecord(tokens, tuple(hashes[parent // bs : n]), self.layout.world_size,
                                producer_id(), parent=parent,
                                parent_hash=hashes[parent // bs - 1] if parent else b"")
        return self.keys.record(hashes[n - 1]), record.encode(self.fingerprint, self.key)

    def refuse(self, reason: Refusal, count: int = 1) -> None:
        """Count boundaries the boundary rule refused (for metrics)."""
        self.counters.tally("refused", reason, count)

    # -- the layout object ---------------------------------------------------------------------

    def layout_object(self) -> bytes:
        """The stored form of the layout: what audits read to check records without an engine."""
        data = json.dumps(self.layout.to_json(), sort_keys=True).encode()
        header = ObjectHeader(ObjectKind.LAYOUT, self.fingerprint, self.fingerprint, length=len(data))
        return b"".join(bytes(p) for p in encode(header, data, self.key))

    def keep_layout(self, present: bool | None = None) -> None:
        """Keep the layout object stored, valid, and as fresh as the records that need it.

        One round trip: a read that verifies it (the first time, then every
        ``LAYOUT_VERIFY_S``), else a touch; a missing or bad layout is written again. With
        ``present`` (already known from a lookup's touch) a present layout costs nothing.
        """
        key = self.keys.layout()
        now = time.monotonic()
        corrupt = False
        if self._layout_verified is None or now - self._layout_verified >= LAYOUT_VERIFY_S:
            blob = self.store.get_many([key])[0]
            corrupt = blob is not None and not _is_layout(blob, self.layout_object(), self.key)
            present = blob is not None
            self._layout_verified = now
        elif present is None:
            present = self.store.touch_many([key])[0]
        if corrupt:
            self.store.put_many([(key, [self.layout_object()])])
        elif not present:
            self.store.put_if_absent(key, self.layout_object())
        self.counters.add(layout_writes=corrupt or not present)

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int = 0) -> int:
        """Tokens of the longest published, still complete boundary beyond ``min_tokens``; 0 if none."""
        return self.lookup_explained(hashes, prompt_tokens, min_tokens).hit

    def lookup_explained(
        self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int = 0
    ) -> LookupResult:
        """The hit, and why it is shorter than the longest prefix when it is (counted by reason).

        Two round trips whatever the prompt length (records, then objects; one on a network
        store where the objects are few, ``_lookup_steps``), and work linear in the prompt:
        the objects of every published candidate are checked in one batch, and prefix counts
        of missing blocks answer each candidate in constant time. For layouts
        with state, each round trip also asks for the KV block and the state just past the
        longest published boundary (two keys), so that a miss says whether the prefix's KV
        was stored further while no exact state was kept there.
        """
        return self.lookup_many([(hashes, prompt_tokens, min_tokens)])[0]

    def lookup_many(self, asks: Sequence[tuple[Sequence[bytes], int, int]],
                    touch_later: list[_Touch] | None = None) -> list[LookupResult]:
        """``lookup_explained`` for several prompts, (hashes, prompt tokens, min tokens) each,
        in the round trips of one: each round trip touches the keys of every lookup still
        going, so lookups that arrive together over a slow store cost two round trips, not two
        each (one, where the objects of every candidate were checked beside the records).

        A lookup answered from that first round trip still touches what its hit uses, in a
        further call: made before this returns, or, with ``touch_later``, appended to it for
        the caller to make after it has used the answers (``touch``)."""
        later: list[_Touch] = []
        results = self._verified(asks, self._lookup_rounds(asks, later), later)
        if touch_later is not None:
            touch_later += later
        else:
            self.touch(later)
        return results

    def _lookup_rounds(self, asks: Sequence[tuple[Sequence[bytes], int, int]],
                       later: list[_Touch]) -> list[LookupResult]:
        """The lookups' round trips, all asks together (their hits not yet verified)."""
        steps = [self._lookup_steps(h, n, m, later) for h, n, m in asks]
        results: list[LookupResult | None] = [None] * len(steps)
        pending: dict[int, tuple[list[str], list[bool]]] = {}
        for i, step in enumerate(steps):
            try:
                pending[i] = next(step)
            except StopIteration as done:
                results[i] = done.value
        while pending:
            order = list(pending.items())
            flags = self.store.touch_many([k for _, (keys, _) in order for k in keys],
                                          [t for _, (_, touch) in order for t in touch])
            pending, pos = {}, 0
            for i, (keys, _) in order:
                got = flags[pos : pos + len(keys)]
                pos += len(keys)
                try:
                    pending[i] = steps[i].send(got)
                except StopIteration as done:
                    results[i] = done.value
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _verified(self, asks: Sequence[tuple[Sequence[bytes], int, int]], results: list[LookupResult],
                  later: list[_Touch]) -> list[LookupResult]:
        """Refuse hits whose record is a copy of one a quarantine proved wrong. Only records the
        deny-list names are read (one batched read; none at all in the common case): a record
        is only a marker that a boundary's objects were all stored, and every object is
        verified again where it is loaded, so junk at a record key costs a load that fails,
        never wrong bytes, while reading every hit's record would add a round trip to every
        lookup over a network store. A refused record is removed and counted
        (``rejected["record ..."]``), and that lookup answers again from what is left."""
        bs = self.layout.block_size
        if self._deny_read is None and any(r.hit for r in results):
            self.refresh_deny()  # once per vault; later reads follow the answers (``touch``)
        for attempt in range(RECORD_RETRIES + 1):
            hits = [i for i, r in enumerate(results) if r.hit]
            names = {i: self.keys.record(asks[i][0][results[i].hit // bs - 1]) for i in hits}
            listed = [i for i in hits if self._suffix(names[i]) in self.deny]
            if not listed:
                break
            unique = list(dict.fromkeys(names[i] for i in listed))
            blobs = dict(zip(unique, self.store.get_many(unique), strict=True))
            bad: dict[str, bool] = {}  # record key -> whether to remove it
            for i in listed:
                why = self._record_problem(names[i], blobs[names[i]], asks[i][0], results[i].hit)
                if why is not None:
                    bad[names[i]] = why != "gone"
                    if why != "gone":
                        self.counters.tally("rejected", f"record {why}", 1)
            if not bad:
                break
            if any(bad.values()):
                self.store.delete_many([k for k, remove in bad.items() if remove])
            redo = [i for i in listed if names[i] in bad]
            for i in redo:  # answered again: counted again
                self._uncount(results[i])
            if attempt == RECORD_RETRIES:
                for i in redo:
                    results[i] = self._result(0, results[i].longest, Miss.EVICTED)
                    self.counters.add(lookup_asks=1)
                break
            for i, r in zip(redo, self._lookup_rounds([asks[i] for i in redo], later), strict=True):
                results[i] = r
        return results

    def _record_problem(self, name: str, blob: bytes | None, hashes: Sequence[bytes], hit: int) -> str | None:
        """Why the record ``blob`` stored at ``name`` cannot publish boundary ``hit`` of
        ``hashes`` (None: it can)."""
        if blob is None:
            return "gone"  # removed since the existence check: evicted, or quarantined
        try:
            record = BoundaryRecord.decode(blob, self.fingerprint, self.key)
            if self._suffix(name) in self.deny:
                header, body = decode(blob, key=self.key)
                if self.deny.denied(self._suffix(name), content_digest(header, body)):
                    return "denied"
        except IntegrityError as e:
            return e.reason
        bs = self.layout.block_size
        if record.tokens != hit or record.boundary_hash != hashes[hit // bs - 1] or record.block_size != bs:
            return "identity"
        return None

    def _uncount(self, result: LookupResult) -> None:
        self.counters.add(lookup_asks=-1)
        self.counters.add(found_tokens=-result.hit)
        if result.miss is not None:
            self.counters.tally("misses", result.miss.value, -1)

    def touch(self, touches: Sequence[_Touch]) -> None:
        """Touch what lookups answered early use, all in one call (order kept); and, once the
        answers are out, read the deny-list when it is due (a lookup never waits for it)."""
        keys = [k for ks, _ in touches for k in ks]
        if keys:
            self.store.touch_many(keys, [t for _, ts in touches for t in ts])
        self.refresh_deny()

    def _lookup_steps(
        self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int, later: list[_Touch]
    ) -> Generator[tuple[list[str], list[bool]], list[bool], LookupResult]:
        """One lookup as the keys it checks, round trip by round trip (``lookup_many`` sends
        each answer back); returns its result.

        What it touches (keeps fresh for the store's eviction) and in which order: the
        layout, the records, then the KV blocks from the first on, so a chain ages from its
        tail. Of the states, only the one at the longest published boundary (the hit, unless
        an object of it is gone) is touched: a state the hit passes over ages (a
        conversation's earlier turns, once a later one is stored). Probes past the hit are
        only checked.

        On a network store, where every candidate's objects are at most ``SPECULATIVE_KEYS``
        keys, they are checked (not touched) in the first round trip, the answer comes from it,
        and the second round trip's touches go to ``later`` instead."""
        self.counters.add(lookup_asks=1)
        bs = self.layout.block_size
        limit = min(max_resume_tokens(prompt_tokens, bs), len(hashes) * bs)
        candidates = range(limit, min_tokens, -bs)
        if not candidates:
            return self._result(0, limit, Miss.LOCAL_HIT if limit else Miss.SHORT_PROMPT)
        hexes = [h.hex() for h in hashes[: limit // bs]]
        rprefix = self.keys.record_prefix()
        # Records from the shortest boundary on (the tail of a chain ages first).
        record_keys = [rprefix + hexes[b // bs - 1] for b in reversed(candidates)]
        probes = self._probes(hexes[0])  # past boundary 0: the first block
        # Every object of every candidate, when they are few (a superset of what the second
        # round trip would check: its probes included).
        every = self._wanted(candidates)
        checked = self.store.remote and sum(len(idx) for *_, idx in every) <= SPECULATIVE_KEYS
        speculative = [k for k in dict.fromkeys(prefix + hexes[i] for _, _, prefix, idx in every for i in idx)
                       if k not in probes] if checked else []
        first = [self.keys.layout(), *record_keys, *probes]
        exists = yield ([*first, *speculative], [True] * (1 + len(record_keys)) + [False] * (
            len(probes) + len(speculative)))
        known = dict(zip([*probes, *speculative], exists[len(first) - len(probes):], strict=True)) \
            if checked else {}
        exists = exists[: len(first)]
        published = [b for b, e in zip(reversed(candidates), exists[1 : 1 + len(candidates)], strict=True)
                     if e][::-1]
        if published and not exists[0]:
            self.keep_layout(present=False)  # evicted or removed: write it again (rare)
        if not published:
            return self._result(0, limit, self._past_hit(probes, exists[len(exists) - len(probes):]))
        top = published[0] // bs
        # Per (group, rank): the block (or state) indices to check.
        wanted = self._wanted(published)
        keys = [prefix + hexes[i] for _, _, prefix, idx in wanted for i in idx]
        # Sent in chain order (each index's blocks, then the state at its end), blocks touched.
        chain = np.concatenate([2 * np.asarray(idx, dtype=np.int64) + self.layout.groups[gi].is_state
                                for gi, _, _, idx in wanted]) if wanted else np.zeros(0, np.int64)
        order = np.argsort(chain, kind="stable")
        ranked = chain[order]
        probes = self._probes(hexes[top]) if top * bs < limit else []  # past the top published
        asked = [keys[j] for j in order.tolist()] + probes
        touched = ((ranked % 2 == 0) | (ranked == 2 * top - 1)).tolist() + [False] * len(probes)
        if checked and all(k in known for k in asked):
            sent = [known[k] for k in asked]
            later.append(([k for k, t in zip(asked, touched, strict=True) if t], [True] * sum(touched)))
        else:
            sent = yield (asked, touched)
        unsorted = np.empty(len(keys), dtype=bool)
        unsorted[order] = sent[: len(keys)]
        flags = unsorted.tolist()
        probed = sent[len(keys) :]
        answers: list[tuple[int, int, Sequence[int], Sequence[bool]]] = []
        pos = 0
        for gi, rank, _, idx in wanted:
            answers.append((gi, rank, idx, flags[pos : pos + len(idx)]))
            pos += len(idx)
        coverage = Coverage.from_flags(self.layout, answers)
        hit = choose_hit(published, prompt_tokens, bs, coverage.resumable)
        self.counters.add(found_tokens=hit)
        if hit == limit:
            return self._result(hit, limit, None)
        if hit < published[0]:  # the longest published boundary cannot resume any more
            return self._result(hit, limit, Miss.EVICTED)
        return self._result(hit, limit, self._past_hit(probes, probed))

    def _wanted(self, boundaries: Sequence[int]) -> list[tuple[int, int, str, range | list[int]]]:
        """Per (group, rank): its key prefix and the block (or state) indices that restoring
        any of ``boundaries`` (tokens, longest first) needs."""
        bs = self.layout.block_size
        top, low = boundaries[0] // bs, boundaries[-1] // bs
        wanted: list[tuple[int, int, str, range | list[int]]] = []
        for rank in range(self.layout.world_size):
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:  # (a range of boundaries gives a range: counted for free)
                    states = range(top - 1, low - 2, -1) if isinstance(boundaries, range) and \
                        boundaries.step == -bs else [b // bs - 1 for b in boundaries]
                    wanted.append((gi, rank, self.keys.state_prefix(gi, rank), states))
                else:
                    first = needed_blocks(group, low * bs, bs).start
                    wanted.append((gi, rank, self.keys.block_prefix(gi, rank), range(first, top)))
        return wanted

    def _probes(self, block_hex: str) -> list[str]:
        """For layouts with state: a KV block of a full-attention group, and the state at the
        end of that block (rank 0)."""
        attn = next((i for i, g in enumerate(self.layout.groups) if g.kind is GroupKind.FULL_ATTENTION), None)
        state = next((i for i, g in enumerate(self.layout.groups) if g.is_state), None)
        if attn is None or state is None:
            return []
        return [self.keys.block_prefix(attn, 0) + block_hex, self.keys.state_prefix(state, 0) + block_hex]

    @staticmethod
    def _past_hit(probes: list[str], found: Sequence[bool]) -> Miss:
        """The KV block past the hit is stored but no state at its end: a state is missing."""
        return Miss.NO_STATE if probes and found[0] and not found[1] else Miss.NO_RECORD

    def _result(self, hit: int, longest: int, miss: Miss | None) -> LookupResult:
        if miss is not None:
            self.counters.tally("misses", miss.value, 1)
        return LookupResult(hit, longest, miss)

    # -- load --------------------------------------------------------------------------------------

    def load(self, refs: Sequence[ObjectRef], staging: np.ndarray | None = None,
             borrow: bool = True) -> Loaded:
        """Fetch and verify objects; bad ones are counted, removed from the store and reported.

        With ``borrow``, payloads may be views of memory the store lent: use them before the
        next call on the same store (a load beside other calls on their own thread passes
        ``borrow=False``). With a hot set, objects in it are served from it (the deny-list
        still applies), and only the others are read, then kept in it."""
        refs = sorted(refs, key=chain_order)  # a read is a use: the store ranks them in this order
        hot = self._from_hot(refs) if self.hot is not None else {}
        if hot:
            refs = [r for r in refs if r not in hot]
            if not refs:
                return Loaded(hot, {})
        headers = [self.expected_header(r) for r in refs]
        sizes = [HEADER_SIZE + h.length for h in headers]
        total = sum(sizes)
        if staging is not None and staging.nbytes >= total:
            buf = staging.data.cast("B")
        else:  # memory the store can fill directly, where it has such memory
            lent = self.store.staging_buffer(total) if borrow else None
            buf = lent or np.empty(total, dtype=np.uint8).data.cast("B")
        views, off = [], 0
        for s in sizes:
            views.append(buf[off : off + s])
            off += s
        self.refresh_deny()
        got = self.store.get_into([r.key for r in refs], views)
        payloads: dict[ObjectRef, memoryview] = {}
        failed: dict[ObjectRef, str] = {}
        bad_keys: list[str] = []
        for ref, header, view, size in zip(refs, headers, views, got, strict=True):
            if size is None:
                failed[ref] = "missing"
                self.counters.add(get_failed=1)
                continue
            try:
                if size != len(view):
                    raise IntegrityError("length", f"object has {size} bytes, expected {len(view)}")
                _, payload = decode(view, header, self.key)
                if self._is_denied(ref.key, header, payload):  # a copy of bytes proved wrong
                    raise IntegrityError("denied", "bytes a quarantine proved wrong")
            except IntegrityError as e:
                failed[ref] = e.reason
                self.counters.tally("rejected", e.reason, 1)
                self.counters.add(get_failed=1)
                if e.reason in PROVED_WRONG:
                    bad_keys.append(ref.key)
                continue
            payloads[ref] = payload
            self.counters.add(get_keys=1)
            self.counters.add(get_bytes=size)
            if self._read_before(ref.key):
                self.counters.add(reread_bytes=size)
        if bad_keys:  # proved wrong only: bytes of another format or key are someone else's
            self.store.delete_many(bad_keys)
        if self.hot is not None:
            for ref, payload in payloads.items():
                self.hot.put(ref.key, payload)
        payloads.update(hot)
        return Loaded(payloads, failed)

    def _read_before(self, key: str) -> bool:
        """Whether ``key`` was among the last ``READS_SEEN`` keys this vault read (then it is
        again, as the most recent)."""
        h = hash(key)
        seen = h in self._seen
        self._seen[h] = None
        self._seen.move_to_end(h)
        if len(self._seen) > READS_SEEN:
            self._seen.popitem(last=False)
        return seen

    def _from_hot(self, refs: Sequence[ObjectRef]) -> dict[ObjectRef, memoryview]:
        """The objects of ``refs`` the hot set holds, unless the deny-list names their bytes."""
        assert self.hot is not None
        self.refresh_deny()
        out: dict[ObjectRef, memoryview] = {}
        for ref in refs:
            payload = self.hot.get(ref.key)
            if payload is None:
                continue
            if self._is_denied(ref.key, self.expected_header(ref), payload):
                self.hot.discard(ref.key)  # proved wrong since it was loaded: read (and refused) again
                continue
            out[ref] = memoryview(payload)
            self.counters.add(hot_keys=1, hot_bytes=len(payload))
        return out


def _payload_shape(shard: Sequence[object]) -> tuple[tuple[int, ...], str]:
    """Header shape and dtype of a shard: the tensor's own if it is one tensor, else flat bytes."""
    from prefixvault.layout import TensorSpec

    specs = [s for s in shard if isinstance(s, TensorSpec)]
    if len(specs) == 1:
        return specs[0].shape, specs[0].dtype
    return (sum(s.nbytes for s in specs),), "uint8"
