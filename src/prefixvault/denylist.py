"""The deny-list: bytes proved wrong stay refused wherever they reappear (invariant 3).

A quarantine (``prefixvault watch``) proves a boundary wrong, not which of its objects is:
it removes the record and every object the record names, and lists the content digest
(``codec.content_digest``: identity + payload, not the nonce or tag) of each of them here.
From then on, until the entry expires:

- a load refuses an object of a listed key whose digest is listed (a replayed copy of the
  old bytes, sealed or plain), counts it (``rejected["denied"]``) and removes it;
- a producer that finds a listed key present reads it before it skips the put, and a
  producer that computed listed bytes itself does not store them (no record follows);
- a lookup refuses a replayed copy of the quarantined record.

One list per namespace and layout, stored beside them as ``{ns}/{layout}/deny``: an object
of kind DENY, sealed with the namespace's key where it has one (nobody without the secret
can add, alter or forge entries). Bounded (``DENY_MAX`` entries, the soonest to expire go
first) and expiring (``DENY_TTL_S``): a cache forgets, and a wrong computation that keeps
being made is quarantined again by the next sample. A store's user can still *delete* the
stored list (no signature stops a delete): every vault keeps what it has read in memory and
writes it back when it finds the stored list missing entries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixvault.codec import IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.stores.base import Buffer
from prefixvault.tenancy import NamespaceKey

#: How long an entry refuses its bytes (seconds).
DENY_TTL_S = 7 * 24 * 3600.0
#: Most entries one list keeps (~100 bytes each stored).
DENY_MAX = 4096
#: How often a vault reads its namespace's list again (seconds): a quarantine reaches every
#: consumer within this long (its record and objects are removed at once regardless).
DENY_REFRESH_S = 10.0
DENY_VERSION = 1


@dataclass
class DenyList:
    """Object key suffix (the key after ``{ns}/{layout}/``; a key under a tenant's namespace of
    its own, ``tenant_namespaces``, whole) -> content digest -> expiry
    (unix time). Keyed by object key so that the common case, a key not listed, costs a
    dict lookup and no digest."""

    entries: dict[str, dict[bytes, float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(d) for d in self.entries.values())

    def __contains__(self, suffix: object) -> bool:
        return suffix in self.entries

    def add(self, suffix: str, digest: bytes, expires: float) -> None:
        held = self.entries.setdefault(suffix, {})
        held[digest] = max(expires, held.get(digest, 0.0))

    def denied(self, suffix: str, digest: bytes, now: float | None = None) -> bool:
        expires = self.entries.get(suffix, {}).get(digest)
        return expires is not None and expires > (time.time() if now is None else now)

    def items(self) -> Iterable[tuple[str, bytes, float]]:
        for suffix, digests in self.entries.items():
            for digest, expires in digests.items():
                yield suffix, digest, expires

    def merge(self, other: DenyList) -> bool:
        """Add ``other``'s entries; True if it had any this list lacked (or later expiries)."""
        grew = False
        for suffix, digest, expires in other.items():
            if self.entries.get(suffix, {}).get(digest, 0.0) < expires:
                self.add(suffix, digest, expires)
                grew = True
        return grew

    def prune(self, now: float | None = None) -> None:
        """Drop expired entries, then the soonest to expire beyond ``DENY_MAX``."""
        now = time.time() if now is None else now
        live = sorted(((e, s, d) for s, d, e in self.items() if e > now), reverse=True)[:DENY_MAX]
        self.entries = {}
        for expires, suffix, digest in live:
            self.add(suffix, digest, expires)

    def encode(self, fingerprint: bytes, key: NamespaceKey | None) -> bytes:
        self.prune()
        body = {"v": DENY_VERSION, "e": [[s, d.hex(), round(e, 3)] for s, d, e in sorted(self.items())]}
        data = json.dumps(body, separators=(",", ":")).encode()
        header = ObjectHeader(ObjectKind.DENY, fingerprint, fingerprint, length=len(data))
        return b"".join(bytes(p) for p in encode(header, data, key))

    @classmethod
    def decode(cls, blob: Buffer, fingerprint: bytes, key: NamespaceKey | None) -> DenyList:
        """The list stored as ``blob``; IntegrityError if it does not verify (with ``key``:
        is not sealed with it) or is not a deny-list of this layout."""
        header, payload = decode(blob, key=key)
        if header.kind is not ObjectKind.DENY or header.fingerprint != fingerprint:
            raise IntegrityError("identity", "not this layout's deny-list")
        out = cls()
        try:
            body = json.loads(bytes(payload))
            for suffix, digest, expires in body["e"]:
                out.add(str(suffix), bytes.fromhex(str(digest)), float(expires))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise IntegrityError("format", f"deny-list body: {type(e).__name__}") from None
        return out
