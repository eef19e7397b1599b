"""Tail indexes: how a lookup finds the tail boundaries published past a block boundary.

A tail boundary (one that ends inside a block: a prompt's exact end, a chunk that ended
mid-block, a state the engine offered on its hash unit) is named by its tail hash, which a
lookup can compute only for a length it knows. So every tail published past block boundary
``k`` is listed, by its length past that boundary and its tail hash, in the tail index of that
boundary: one small object per block boundary (``t/{h_k}``, the chain hash there, or the
chain's seed before the first block). A lookup checks the index keys of every block boundary in
its range beside the records, reads those that exist, and keeps the tails whose hash its own
prompt gives at that length (other prompts' tails past a shared block are listed too); those it
checks like any other candidate: record, then objects.

An index is written by read, merge and replace (no store offers an atomic append): two
producers adding tails past the same block at once may lose one entry, which costs that tail's
hits (it stays stored, unfound), never a wrong one; and an entry whose record is gone costs a
key in a lookup. It keeps the ``TAILS_PER_INDEX`` most recent entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from prefixvault.codec import IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.stores.base import Buffer
from prefixvault.tenancy import NamespaceKey

#: Entries one tail index keeps (the most recently published first).
TAILS_PER_INDEX = 32
#: Tail candidates a lookup checks at most, the deepest first.
TAIL_CANDIDATES = 8


#: One listed tail: its tokens past the block boundary, and its tail hash.
Tail = tuple[int, bytes]


@dataclass(frozen=True)
class TailIndex:
    parent: bytes  # the chain hash of the block boundary the tails are past (or the seed)
    tails: tuple[Tail, ...]  # most recently published first; tokens past it in (0, block size)

    def with_tail(self, past: int, name: bytes) -> TailIndex:
        """This index with the tail ``name`` listed first (once), bounded to ``TAILS_PER_INDEX``."""
        rest = tuple(t for t in self.tails if t[1] != name)
        return TailIndex(self.parent, ((past, name), *rest)[:TAILS_PER_INDEX])

    def encode(self, fingerprint: bytes, key: NamespaceKey | None = None) -> bytes:
        body = {"v": 1, "tails": [[past, name.hex()] for past, name in self.tails]}
        payload = json.dumps(body, separators=(",", ":")).encode()
        header = ObjectHeader(ObjectKind.TAIL_INDEX, fingerprint, self.parent, length=len(payload))
        return b"".join(bytes(p) for p in encode(header, payload, key))

    @classmethod
    def decode(cls, data: Buffer, fingerprint: bytes, parent: bytes, block_size: int,
               key: NamespaceKey | None = None) -> TailIndex:
        """Verify and parse the index of ``parent`` (IntegrityError if it does not verify, is
        another's, or lists a length that is no tail)."""
        header, payload = decode(data, key=key)
        if header.kind is not ObjectKind.TAIL_INDEX or header.fingerprint != fingerprint \
                or header.key_hash != parent:
            raise IntegrityError("identity", "not this block boundary's tail index")
        try:
            listed = json.loads(bytes(payload))["tails"]
            tails = tuple((int(past), bytes.fromhex(name)) for past, name in listed)
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError("format", f"tail index body: {e}") from None
        if len(tails) > TAILS_PER_INDEX or any(not 0 < past < block_size for past, _ in tails):
            raise IntegrityError("format", "tail index lists a length that is no tail")
        return cls(parent, tails)
