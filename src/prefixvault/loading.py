"""Loads: objects read from the store (or the hot set) and handed out only where they verify
(invariant 3).

Every object is checked against the header the reader expects and its checksum (in a namespace
with a secret: decrypted and its AES-GCM tag verified, as it is copied out of the store), and
against the deny-list, before its payload is handed out. Bad
objects are counted by reason; those proved wrong, and wrong again when read once more, are
removed from the store (bytes of another
format or key are someone else's, and stay; an object of another version under a key this
reader named is proved wrong: ``codec.proved_wrong``). Each object is opened with the key of the
tenant its ref names (``ObjectRef.salt``): one load may serve the requests of several tenants.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prefixvault.codec import HEADER_SIZE, IntegrityError, ObjectHeader, decode, proved_wrong
from prefixvault.counters import Counters
from prefixvault.denysync import DenySync
from prefixvault.hotset import HotSet
from prefixvault.objects import ObjectNames, ObjectRef, chain_order
from prefixvault.stores.base import Store, StoreError, Take, copy_into
from prefixvault.tenancy import NamespaceKey, TenantKeys

log = logging.getLogger("vllm.prefixvault")

#: Keys a vault remembers having read, to count bytes read again (``reread_bytes``).
READS_SEEN = 1 << 16


@dataclass(frozen=True)
class Loaded:
    """Verified payloads of a load, and what failed (missing or rejected), by ref."""

    payloads: dict[ObjectRef, memoryview]
    failed: dict[ObjectRef, str]
    # Each object read from the store whole, header included, as stored (a plain payload is a
    # view of it): what a scheduler hands a worker, which verifies it again (``open_sealed``).
    # Objects served by a hot set have none; encrypted ones, only for a load asked ``stored``.
    objects: dict[ObjectRef, memoryview] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(eq=False)
class Loader:
    """Reads and verifies objects of ``names`` from ``store``, through ``hot`` where there is one."""

    store: Store
    names: ObjectNames
    tenants: TenantKeys  # the key of each ref's tenant
    counters: Counters  # get_*, hot_*, reread_bytes, torn_reads; what was refused (``rejected``)
    deny: DenySync
    hot: HotSet | None
    # hashes of the keys read last (READS_SEEN)
    _seen: OrderedDict[int, None] = field(default_factory=OrderedDict, init=False)
    _hot_since: int = field(default=0, init=False)  # the deny-list's ``grown`` the hot set was kept since

    def load(self, refs: Sequence[ObjectRef], staging: np.ndarray | None = None,
             borrow: bool = True, stored: bool = False,
             prefetched: Mapping[str, bytes] | None = None) -> Loaded:
        """Fetch and verify objects; bad ones are counted and reported, and removed from the
        store where they are wrong again when read once more (``_wrong_again``).

        With ``borrow``, payloads may be views of memory the store lent: use them before the
        next call on the same store (a load beside other calls on their own thread passes
        ``borrow=False``; then each object has memory of its own, so one kept keeps no other
        alive). With a hot set, objects in it are served from it (the deny-list still applies),
        and only the others are read, then kept in it. In a namespace with a key an object is
        decrypted as it is copied out of the store (one pass), so ``Loaded.objects`` holds the
        objects as stored only where ``stored`` asks for them (then each is decrypted into
        memory of its own: a second pass). ``prefetched``: objects already read, by key (a
        lookup's, ``LookupResult.prefetched``), copied from there rather than read again, where
        the objects are kept as stored (``stored``, or a namespace without a key)."""
        refs = sorted(refs, key=chain_order)  # a read is a use: the store ranks them in this order
        hot = self._from_hot(refs) if self.hot is not None else {}
        if hot:
            refs = [r for r in refs if r not in hot]
            if not refs:
                return Loaded(hot, {})
        headers = [self.names.expected_header(r) for r in refs]
        sizes = [HEADER_SIZE + h.length for h in headers]
        total = sum(sizes)
        views: list[memoryview] = []
        if staging is not None and staging.nbytes >= total:
            buf: memoryview | None = staging.data.cast("B")
        elif borrow:  # memory the store can fill directly, where it has such memory
            buf = self.store.staging_buffer(total) or np.empty(total, dtype=np.uint8).data.cast("B")
        else:
            buf = None
            views = [np.empty(s, dtype=np.uint8).data.cast("B") for s in sizes]
        if buf is not None:
            off = 0
            for s in sizes:
                views.append(buf[off : off + s])
                off += s
        self.deny.refresh()
        keys = [r.key for r in refs]
        opened: dict[int, memoryview | Exception] = {}
        keyed = self.tenants.namespace_key is not None
        if keyed and not stored:
            sealers = [self.tenants.get(r.salt) for r in refs]
            got = self.store.get_taken(keys, views, self._decrypting(headers, sealers, opened))
            for e in opened.values():
                if isinstance(e, Exception) and not isinstance(e, IntegrityError):
                    raise e  # ours, kept from the store's read
        else:
            got = self._get_into(keys, views, prefetched or {})
        payloads: dict[ObjectRef, memoryview] = {}
        objects: dict[ObjectRef, memoryview] = {}
        failed: dict[ObjectRef, str] = {}
        bad: list[tuple[ObjectRef, ObjectHeader]] = []
        for i, (ref, header, view, size) in enumerate(zip(refs, headers, views, got, strict=True)):
            if size is None:
                failed[ref] = "missing"
                self.counters.add(get_failed=1)
                continue
            try:
                if size != len(view):
                    raise IntegrityError("length", f"object has {size} bytes, expected {len(view)}")
                if keyed and not stored:
                    done = opened.get(i)
                    if isinstance(done, Exception) or done is None:
                        raise done or IntegrityError("length", "not read whole")
                    payload = self._checked(ref, header, done)
                else:
                    payload = self._open(ref, header, view)
                    objects[ref] = view
            except IntegrityError as e:
                failed[ref] = e.reason
                self.counters.tally("rejected", e.reason, 1)
                self.counters.add(get_failed=1)
                if proved_wrong(e.reason, own_fingerprint=True):  # (every key read is named here)
                    bad.append((ref, header))
                continue
            payloads[ref] = payload
            self.counters.add(get_keys=1)
            self.counters.add(get_bytes=size)
            if self._read_before(ref.key):
                self.counters.add(reread_bytes=size)
        if bad:  # proved wrong only: bytes of another format or key are someone else's
            wrong = self._wrong_again(bad)
            if wrong:
                self.store.delete_many(wrong)
        if self.hot is not None:
            for ref, payload in payloads.items():
                self.hot.put(ref.key, payload)
        payloads.update(hot)
        return Loaded(payloads, failed, objects)

    def _wrong_again(self, bad: Sequence[tuple[ObjectRef, ObjectHeader]]) -> list[str]:
        """The keys of ``bad`` whose bytes, read once more, are wrong again: only those are
        removed. A read that raced an overwrite of the same key may return parts of two whole
        versions (Mooncake writes an object of unchanged size in place: ``stores.mooncake``),
        and the object then stored is good: removing it would lose another producer's work.
        Such a read is counted (``torn_reads``) and costs this load only. One more read, on
        failures only; it cannot race the same overwrite: Mooncake refuses a read from the
        start of an in-place write to its end (the replica is not ready), so a read issued after
        the torn one returns nothing or a whole version. A read that fails proves nothing."""
        try:
            blobs = self.store.get_many([ref.key for ref, _ in bad])
        except StoreError as e:
            log.debug("prefixvault: reading %d rejected objects once more failed: %s", len(bad), e)
            return []
        wrong: list[str] = []
        for (ref, header), blob in zip(bad, blobs, strict=True):
            if blob is None:
                continue  # gone meanwhile: nothing to remove
            try:
                self._open(ref, header, memoryview(blob))  # the rules of every read, deny-list too
            except IntegrityError as e:
                if proved_wrong(e.reason, own_fingerprint=True):
                    wrong.append(ref.key)
                continue
            self.counters.add(torn_reads=1)
        return wrong

    def _get_into(self, keys: Sequence[str], views: Sequence[memoryview],
                  prefetched: Mapping[str, bytes]) -> list[int | None]:
        """``Store.get_into``, the objects in ``prefetched`` copied from there."""
        out: list[int | None] = [None] * len(keys)
        rest = [i for i, k in enumerate(keys) if k not in prefetched]
        for i, key in enumerate(keys):
            if key in prefetched:
                out[i] = copy_into(prefetched[key], views[i])
        if rest:
            for i, size in zip(rest, self.store.get_into([keys[i] for i in rest], [views[i] for i in rest]),
                               strict=True):
                out[i] = size
        return out

    def _decrypting(self, headers: Sequence[ObjectHeader], keys: Sequence[NamespaceKey | None],
                    opened: dict[int, memoryview | Exception]) -> Take:
        """What a store calls with each object's bytes: verify and decrypt them (with its
        tenant's key, ``keys``) into the payload part of its buffer; the payload, or what
        failed, goes into ``opened``."""

        def take(i: int, src: memoryview, dst: memoryview) -> None:
            try:
                if len(src) != len(dst):
                    raise IntegrityError("length", f"object has {len(src)} bytes, expected {len(dst)}")
                opened[i] = decode(src, headers[i], keys[i], out=dst[HEADER_SIZE:])[1]
            except Exception as e:  # (a store's callback must not raise: settled after the read)
                opened[i] = e

        return take

    def _open(self, ref: ObjectRef, header: ObjectHeader, data: memoryview) -> memoryview:
        """The payload of an object read whole, verified as every object is: its header, its
        identity (``header``), its checksum or tag, and the deny-list."""
        _, payload = decode(data, header, self.tenants.get(ref.salt))
        return self._checked(ref, header, payload)

    def _checked(self, ref: ObjectRef, header: ObjectHeader, payload: memoryview) -> memoryview:
        """``payload``, verified, unless the deny-list names its bytes."""
        if self.deny.denied(ref.key, header, payload):  # a copy of bytes proved wrong
            raise IntegrityError("denied", "bytes a quarantine proved wrong")
        return payload

    def open_sealed(self, ref: ObjectRef, data: memoryview) -> memoryview:
        """The payload of ``ref``'s object as stored, handed over rather than read here (a
        scheduler's read ahead): verified by the rules of every read. Raises
        ``IntegrityError``, counted under ``rejected``."""
        try:
            return self._open(ref, self.names.expected_header(ref), data)
        except IntegrityError as e:
            self.counters.tally("rejected", e.reason, 1)
            raise

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
        self.deny.refresh()
        if self.deny.grown != self._hot_since:  # a quarantine since: what it removed goes too
            self.hot.clear()
            self._hot_since = self.deny.grown
        out: dict[ObjectRef, memoryview] = {}
        for ref in refs:
            payload = self.hot.get(ref.key)
            if payload is None:
                continue
            if self.deny.denied(ref.key, self.names.expected_header(ref), payload):
                self.hot.discard(ref.key)  # proved wrong since it was loaded: read (and refused) again
                continue
            out[ref] = memoryview(payload)
            self.counters.add(hot_keys=1, hot_bytes=len(payload))
        return out
