"""Quarantine: a boundary proved wrong (``prefixvault watch``) is taken out, and its bytes stay
refused wherever they reappear (invariant 3).

Its record and the states at its boundary (every state group, every rank) are listed in the
namespace's deny-list by content digest, then removed. The KV blocks of its segment (those its
record names, past its parent) are removed too, but not listed: a block is named by its tokens
alone and shared by every prefix through it, so a wrong restore at one boundary does not prove
them wrong, and listing them would refuse the right bytes of every other boundary for as long
as the entry lives; yet they may be what was wrong (a layout or copy bug of the producer), and
kept, a re-published boundary would skip them as present and serve them again. Removed, the
next producer writes them fresh, and other prefixes through them restore a shorter hit until
then. (A worker's hot set, ``load_cache_mib``, is emptied once its vault sees the deny-list
grow, so no copy kept there outlives them.)
What a wrong restore implicates first, and what the seed bug's class of errors gets wrong, is
the state at the boundary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prefixvault.codec import IntegrityError, content_digest, decode
from prefixvault.denysync import DenySync
from prefixvault.keys import KeySpace
from prefixvault.layout import CacheLayout
from prefixvault.objects import ObjectNames, ObjectRef
from prefixvault.read_twice import read_opened
from prefixvault.records import BoundaryRecord
from prefixvault.stores.base import Store
from prefixvault.tenancy import NamespaceKey


@dataclass(eq=False)
class Quarantine:
    """Takes boundaries of one namespace and layout (``keys``) out of ``store``."""

    store: Store
    layout: CacheLayout
    keys: KeySpace
    names: ObjectNames
    deny: DenySync

    def take_out(self, record_key: str, key: NamespaceKey | None, salt: str | None) -> list[str]:
        """Take out the boundary whose record is ``record_key``: list the digests of its record
        and of its states in the deny-list, then remove them and its segment's KV blocks.
        ``key``: its tenant's (of ``salt``, the cache salt of the request that restored it);
        the deny-list stays the namespace's. Returns the keys removed."""
        space = self.names.space(salt)  # (its tenant's namespace, with ``tenant_namespaces``)
        prefix = space.record_prefix()
        hexed = record_key[len(prefix):] if record_key.startswith(prefix) else ""
        try:
            boundary = bytes.fromhex(hexed)
        except ValueError:
            boundary = b""
        if len(boundary) != len(self.keys.fingerprint):
            raise ValueError(f"{record_key[:200]!r} is not a record key of this namespace and layout")
        blob = self.store.get_many([record_key])[0]
        record: BoundaryRecord | None = None
        digests: list[tuple[str, bytes]] = []
        if blob is not None:
            try:
                header, body = decode(blob, key=key)
                record = BoundaryRecord.decode(blob, self.keys.fingerprint, key)
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
            t = record.tokens
            refs.extend(self.names.state_ref(gi, r, boundary, (t - 1) // bs, t, salt) for gi, r in states)
        else:  # the boundary's token count is unknown: its states say it
            keys = [space.state(gi, r, boundary) for gi, r in states]
            for (gi, r), found in zip(states, self.store.get_many(keys), strict=True):
                with contextlib.suppress(IntegrityError):
                    h = decode(found, key=key)[0] if found is not None else None
                    if h is not None and h.tokens > 0:
                        refs.append(self.names.state_ref(gi, r, boundary, (h.tokens - 1) // bs, h.tokens,
                                                         salt))
        headers = {r.key: self.names.expected_header(r) for r in refs}
        opened = read_opened(self.store, list(headers), lambda k, got: decode(got, headers[k], key)[1])
        for ref, state in zip(refs, opened, strict=True):
            if isinstance(state, memoryview):  # (one that does not verify is refused by every load anyway)
                digests.append((ref.key, content_digest(headers[ref.key], state)))
        if digests:
            self.deny.add(digests)
        keys = list(dict.fromkeys([record_key, *(r.key for r in refs), *self._segment(record, salt)]))
        self.store.delete_many(keys)
        return keys

    def _segment(self, record: BoundaryRecord | None, salt: str | None) -> list[str]:
        """The keys of the KV blocks a record names (its segment, every KV group and rank)."""
        if record is None:
            return []
        n = -(-record.tokens // self.layout.block_size)
        tail = record.tokens if record.tail else None  # its last block, partly filled, is its own
        ranks = range(self.layout.world_size)
        return [self.names.block_ref(gi, r, h, i, tail if i == n - 1 else None, salt).key
                for gi, g in enumerate(self.layout.groups) if not g.is_state
                for i, h in enumerate(record.hashes, record.first_block) for r in ranks]
