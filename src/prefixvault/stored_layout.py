"""The layout object: the layout stored beside the records of its fingerprint, so that audits
can check records without an engine.

It is kept as fresh as the records that need it: every publish touches it after writing its
records, and every lookup touches it with the records; whoever finds it missing writes it
again, and a publishing vault reads it back (the first time, then every ``LAYOUT_VERIFY_S``)
and replaces it if it does not verify.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from prefixvault.codec import IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.counters import Counters
from prefixvault.layout import CacheLayout
from prefixvault.stores.base import Store
from prefixvault.tenancy import NamespaceKey

#: How often a publishing vault reads its stored layout back to check it (seconds).
LAYOUT_VERIFY_S = 300.0


def _is_layout(blob: bytes, expected: bytes, key: NamespaceKey | None) -> bool:
    """Whether ``blob`` verifies and says what ``expected`` says (sealed copies differ in
    their nonce and tag, so their payloads are compared)."""
    try:
        header, payload = decode(blob, key=key)
        want_header, want = decode(expected, key=key)
    except IntegrityError:
        return False
    return header == want_header and payload == want


@dataclass(eq=False)
class StoredLayout:
    """The layout object of ``layout`` (fingerprint ``fingerprint``) at ``store_key``."""

    store: Store
    layout: CacheLayout
    fingerprint: bytes
    store_key: str
    key: NamespaceKey | None
    counters: Counters  # counts writes (``layout_writes``)
    verified: float | None = field(default=None, init=False)  # monotonic time the stored layout was last read

    def blob(self) -> bytes:
        """The stored form of the layout: what audits read to check records without an engine."""
        data = json.dumps(self.layout.to_json(), sort_keys=True).encode()
        header = ObjectHeader(ObjectKind.LAYOUT, self.fingerprint, self.fingerprint, length=len(data))
        return b"".join(bytes(p) for p in encode(header, data, self.key))

    def keep(self, present: bool | None = None) -> None:
        """Keep the layout object stored, valid, and as fresh as the records that need it.

        One round trip: a read that verifies it (the first time, then every
        ``LAYOUT_VERIFY_S``), else a touch; a missing or bad layout is written again. With
        ``present`` (already known from a lookup's touch) a present layout costs nothing.
        """
        key = self.store_key
        now = time.monotonic()
        corrupt = False
        if self.verified is None or now - self.verified >= LAYOUT_VERIFY_S:
            blob = self.store.get_many([key])[0]
            corrupt = blob is not None and not _is_layout(blob, self.blob(), self.key)
            present = blob is not None
            self.verified = now
        elif present is None:
            present = self.store.touch_many([key])[0]
        if corrupt:
            self.store.put_many([(key, [self.blob()])])
        elif not present:
            self.store.put_if_absent(key, self.blob())
        self.counters.add(layout_writes=corrupt or not present)
