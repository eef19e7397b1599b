"""Boundary records: the small object that publishes a boundary.

A record exists only if its boundary is resumable, so it is written last, after every
object it needs was acknowledged by every rank, and never overwritten (put-if-absent).
It lists the block hashes of its prefix so that an audit can find every object it needs
without knowing the tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from prefixvault.codec import IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.stores.base import Buffer


@dataclass(frozen=True)
class BoundaryRecord:
    tokens: int
    hashes: tuple[bytes, ...]  # h_0 .. h_{n-1}; the last one names the boundary
    world_size: int
    producer: str = ""
    created: float = 0.0

    @property
    def boundary_hash(self) -> bytes:
        return self.hashes[-1]

    def header(self, fingerprint: bytes, length: int) -> ObjectHeader:
        return ObjectHeader(
            ObjectKind.RECORD, fingerprint, self.boundary_hash, tokens=self.tokens, length=length
        )

    def encode(self, fingerprint: bytes) -> bytes:
        payload = json.dumps(
            {
                "v": 1,
                "tokens": self.tokens,
                "hashes": [h.hex() for h in self.hashes],
                "world_size": self.world_size,
                "producer": self.producer,
                "created": self.created or time.time(),
            },
            separators=(",", ":"),
        ).encode()
        return b"".join(bytes(p) for p in encode(self.header(fingerprint, len(payload)), payload))

    @classmethod
    def decode(cls, data: Buffer, fingerprint: bytes | None = None) -> BoundaryRecord:
        """Verify and parse a record (IntegrityError if it does not verify)."""
        header, payload = decode(data)
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
                producer=str(body.get("producer", "")),
                created=float(body.get("created", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError("format", f"record body: {e}") from None
        if not rec.hashes:
            raise IntegrityError("format", "record lists no block hashes")
        if rec.boundary_hash != header.key_hash or rec.tokens != header.tokens:
            raise IntegrityError("identity", "record body does not match its header")
        return rec
