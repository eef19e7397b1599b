"""Boundary records: the small object that publishes a boundary.

A record exists only if its boundary is resumable, so it is written last, after every
object it needs was acknowledged by every rank, and never overwritten (put-if-absent).

A record lists only its own segment of the hash chain: the block hashes after its *parent*
(an earlier block-aligned boundary of the same prefix whose record existed when this one was
written) up to its own boundary, one per block it touches. Its bytes therefore grow with the
distance to its parent, not with the prompt, and an audit that follows parents finds every
block hash of the prefix without knowing the tokens. ``parent == 0`` means the record lists
the chain from the first block. The record of a tail boundary (one that ends inside a block)
lists, last, its tail hash, which names the boundary and its partly filled block; a tail
boundary is never a parent (its partly filled block is no longer prefix's).

Version 3 records carry the block size (a tail boundary's segment cannot tell it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from prefixvault.codec import IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.stores.base import Buffer
from prefixvault.tenancy import NamespaceKey

RECORD_VERSION = 3


@dataclass(frozen=True)
class BoundaryRecord:
    tokens: int
    hashes: tuple[bytes, ...]  # h_first ..: the blocks after the parent; the last names the boundary
    world_size: int
    block_size: int
    producer: str = ""
    created: float = 0.0
    parent: int = 0  # block-aligned boundary (tokens) this record extends; 0: none, from block 0
    parent_hash: bytes = b""  # the parent's boundary hash (names its record)

    @property
    def boundary_hash(self) -> bytes:
        return self.hashes[-1]

    @property
    def first_block(self) -> int:
        """Index in the prefix's chain of the first hash listed."""
        return self.parent // self.block_size

    @property
    def tail(self) -> bool:
        """Whether the boundary ends inside a block (the last hash is its tail hash)."""
        return self.tokens % self.block_size != 0

    def header(self, fingerprint: bytes, length: int) -> ObjectHeader:
        return ObjectHeader(
            ObjectKind.RECORD, fingerprint, self.boundary_hash, tokens=self.tokens, length=length
        )

    def encode(self, fingerprint: bytes, key: NamespaceKey | None = None) -> bytes:
        body: dict[str, object] = {
            "v": RECORD_VERSION,
            "tokens": self.tokens,
            "hashes": [h.hex() for h in self.hashes],
            "world_size": self.world_size,
            "block_size": self.block_size,
            "producer": self.producer,
            "created": self.created or time.time(),
        }
        if self.parent:
            body["parent"] = self.parent
            body["parent_hash"] = self.parent_hash.hex()
        payload = json.dumps(body, separators=(",", ":")).encode()
        return b"".join(bytes(p) for p in encode(self.header(fingerprint, len(payload)), payload, key))

    @classmethod
    def decode(
        cls, data: Buffer, fingerprint: bytes | None = None, key: NamespaceKey | None = None
    ) -> BoundaryRecord:
        """Verify and parse a record (IntegrityError if it does not verify; with ``key``,
        if it is not sealed with it)."""
        header, payload = decode(data, key=key)
        if header.kind is not ObjectKind.RECORD:
            raise IntegrityError("identity", f"kind is {header.kind.name}, expected RECORD")
        if fingerprint is not None and header.fingerprint != fingerprint:
            raise IntegrityError("identity", "record of another layout")
        try:
            body = json.loads(bytes(payload))
            rec = cls(
                tokens=int(body["tokens"]),
                hashes=tuple(bytes.fromhex(h) for h in body["hashes"]),
                world_size=int(body["world_size"]),
                block_size=int(body["block_size"]),
                producer=str(body.get("producer", "")),
                created=float(body.get("created", 0.0)),
                parent=int(body.get("parent", 0)),
                parent_hash=bytes.fromhex(str(body.get("parent_hash", ""))),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IntegrityError("format", f"record body: {e}") from None
        if not rec.hashes:
            raise IntegrityError("format", "record lists no block hashes")
        if rec.boundary_hash != header.key_hash or rec.tokens != header.tokens:
            raise IntegrityError("identity", "record body does not match its header")
        bs = rec.block_size
        if (bs <= 0 or rec.parent < 0 or rec.tokens <= rec.parent or rec.parent % bs
                or len(rec.hashes) != -(-rec.tokens // bs) - rec.parent // bs):
            raise IntegrityError("format", "record's segment does not fit its boundary and parent")
        if bool(rec.parent) != bool(rec.parent_hash):
            raise IntegrityError("format", "record names a parent without its hash, or the reverse")
        return rec
