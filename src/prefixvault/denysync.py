"""A vault's copy of its namespace's deny-list, kept in step with the stored one, and the check
that loads, saves and lookups make against it (invariant 3: bytes proved wrong stay refused).

The list itself (entries, format, bounds) is ``denylist``; this is how a vault holds it: read
before its first hit and then every ``DENY_REFRESH_S``, merged (never replaced) with what it
held, and written back where the stored list lacks entries the vault holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixvault.codec import IntegrityError, ObjectHeader, content_digest
from prefixvault.counters import Counters
from prefixvault.denylist import DENY_REFRESH_S, DENY_TTL_S, DenyList
from prefixvault.keys import KeySpace
from prefixvault.stores.base import Buffer, Store, StoreError
from prefixvault.tenancy import NamespaceKey


@dataclass(eq=False)
class DenySync:
    """The deny-list of one namespace and layout (those of ``keys``), as one vault holds it.

    Invariant: ``held`` only ever grows between reads of the stored list (merged, never
    replaced), so a deleted list cannot undo a quarantine this vault has seen."""

    store: Store
    keys: KeySpace
    key: NamespaceKey | None
    counters: Counters  # counts a stored list that does not verify (``rejected``)
    held: DenyList = field(default_factory=DenyList, init=False)
    _read: float | None = field(default=None, init=False)  # monotonic time the stored list was last read
    _blob: bytes | None = field(default=None, init=False)  # the stored list as last read
    # How many times ``held`` gained entries: a quarantine seen. What was kept from before it
    # (a hot set) may hold bytes it removed from the store without listing them (KV blocks).
    grown: int = field(default=0, init=False)

    @property
    def read_once(self) -> bool:
        """Whether the stored list was read at least once."""
        return self._read is not None

    def store_key(self) -> str:
        return self.keys.deny()

    def _suffix(self, key: str) -> str:
        """A key of this namespace and layout, as the deny-list names it: past the namespace's
        prefix, or whole for a tenant's key under a namespace of its own (``KeySpace.of``)."""
        home = self.keys.home
        return key[len(home):] if key.startswith(home) else key

    def listed(self, key: str) -> bool:
        """Whether the list names ``key`` (any digest): a dict lookup, no digest."""
        return self._suffix(key) in self.held

    def denied(self, key: str, header: ObjectHeader, payload: Buffer) -> bool:
        """Whether these bytes for ``key`` were proved wrong (a digest only where the key is
        listed: an empty or unrelated list costs a dict lookup)."""
        suffix = self._suffix(key)
        return suffix in self.held and self.held.denied(suffix, content_digest(header, payload))

    def _due(self) -> bool:
        return self._read is None or time.monotonic() - self._read >= DENY_REFRESH_S

    def refresh(self, force: bool = False) -> None:
        """Read the stored deny-list when it is due (every ``DENY_REFRESH_S``)."""
        if force or self._due():
            self._take(self.store.get_many([self.store_key()])[0])

    def _take(self, blob: bytes | None, again: bool = True) -> None:
        """Merge the stored list into this vault's; write the union back where the stored
        one lacks entries this vault holds (deleted, evicted, or lost to a racing writer). A
        list that does not verify is read once more (``again``) before ours replaces it: a
        read racing another vault's write-back of the same size may be torn on a store that
        overwrites in place (``stores.mooncake``), and ours would drop the entries this vault
        has not merged yet."""
        self._read = time.monotonic()
        if blob is not None and blob == self._blob:
            return  # unchanged since the last read (the common case): nothing to merge
        stored = DenyList()
        if blob is not None:
            try:
                stored = DenyList.decode(blob, self.keys.fingerprint, self.key)
            except IntegrityError as e:  # forged, or of another key: ours replaces it
                if again:
                    self._take(self.store.get_many([self.store_key()])[0], again=False)
                    return
                self.counters.tally("rejected", f"deny-list {e.reason}", 1)
        self._blob = blob
        if self.held.merge(stored):
            self.grown += 1
        self.held.prune()
        if len(self.held) and DenyList(dict(stored.entries)).merge(self.held):
            mine = self.held.encode(self.keys.fingerprint, self.key)
            with contextlib.suppress(StoreError):  # read-only: this vault still refuses what it holds
                if self.store.put_many([(self.store_key(), [mine])])[0]:
                    self._blob = mine

    def add(self, digests: Sequence[tuple[str, bytes]], ttl: float = DENY_TTL_S) -> None:
        """List (key, content digest) pairs as proved wrong, and store the list at once."""
        expires = time.time() + ttl
        for key, digest in digests:
            self.held.add(self._suffix(key), digest, expires)
        self.grown += 1
        self.refresh(force=True)  # merges what is stored and writes the union back
