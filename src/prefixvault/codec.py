"""Object codec: a fixed 128-byte header and a checksum in front of every object's bytes.

The header says what the bytes are (layout fingerprint, kind, group, rank, the block or
boundary hash, token count, dtype, shape, length) and carries xxh3-64 checksums of the
payload and of itself. A reader states what it expects; anything that does not match
exactly, or does not checksum, raises IntegrityError and is never handed to a model.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from prefixvault.layout import DTYPE_SIZES
from prefixvault.stores.base import Buffer

MAGIC = b"PVO1"
VERSION = 1
HEADER_SIZE = 128
MAX_DIMS = 8
_DTYPES = sorted(DTYPE_SIZES)  # stable code = index in this list
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPES)}
# magic, version, kind, dtype, ndim, pad, group, rank, tokens, fingerprint, key hash,
# shape[8], payload length, payload checksum; zero padding; header checksum in the last 8 bytes
_BODY = struct.Struct(f"<4sHBBBBHHQ16s16s{MAX_DIMS}IQQ")
_CHECK = struct.Struct("<Q")
_SUMMED = HEADER_SIZE - _CHECK.size  # the header checksum covers every byte before it
assert _BODY.size <= _SUMMED


class ObjectKind(IntEnum):
    BLOCK = 1  # KV block of an attention group
    STATE = 2  # recurrent state at a boundary
    RECORD = 3  # boundary record
    LAYOUT = 4  # a layout description


class IntegrityError(Exception):
    """Bytes that must not be used: wrong header, wrong identity, or bad checksum."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class ObjectHeader:
    kind: ObjectKind
    fingerprint: bytes
    key_hash: bytes  # block hash (BLOCK) or boundary hash (STATE, RECORD)
    group: int = 0
    rank: int = 0
    tokens: int = 0  # tokens the object covers: block end or boundary
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    length: int = 0

    def identity(self) -> tuple[object, ...]:
        """Fields a reader must find exactly as it expects (all but the checksum)."""
        return (self.kind, self.fingerprint, self.key_hash, self.group, self.rank,
                self.tokens, self.dtype, self.shape, self.length)


def checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_header(header: ObjectHeader, payload_checksum: int) -> bytes:
    if len(header.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dims, got shape {header.shape}")
    if len(header.fingerprint) != 16 or len(header.key_hash) != 16:
        raise ValueError("fingerprint and key hash must be 16 bytes")
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    body = _BODY.pack(
        MAGIC, VERSION, int(header.kind), _DTYPE_CODE[header.dtype], len(header.shape), 0,
        header.group, header.rank, header.tokens, header.fingerprint, header.key_hash,
        *shape, header.length, payload_checksum,
    )
    out = bytearray(HEADER_SIZE)
    out[: _BODY.size] = body
    out[_SUMMED:] = _CHECK.pack(checksum(memoryview(out)[:_SUMMED]))
    return bytes(out)


def encode(header: ObjectHeader, payload: Buffer) -> list[Buffer]:
    """Header and payload as the parts of one object (no copy of the payload)."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length:
        raise ValueError(f"payload has {len(view)} bytes, header says {header.length}")
    return [encode_header(header, checksum(view)), view]


def decode_header(data: Buffer) -> tuple[ObjectHeader, int]:
    """Parse and self-check a header; returns it with the payload checksum it promises."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise IntegrityError("truncated", f"{len(view)} bytes, header needs {HEADER_SIZE}")
    (stored,) = _CHECK.unpack(view[_SUMMED:HEADER_SIZE])
    if checksum(view[:_SUMMED]) != stored:
        raise IntegrityError("header checksum")
    fields = _BODY.unpack(view[: _BODY.size])
    magic, version, kind, dtype, ndim = fields[:5]
    if magic != MAGIC or version != VERSION:
        raise IntegrityError("format", f"magic {magic!r} version {version}")
    try:
        kind_e, dtype_s = ObjectKind(kind), _DTYPES[dtype]
    except (ValueError, IndexError) as e:
        raise IntegrityError("format", str(e)) from None
    group, rank, tokens, fingerprint, key_hash = fields[6:11]
    shape = tuple(fields[11 : 11 + ndim])
    length, payload_sum = fields[11 + MAX_DIMS], fields[12 + MAX_DIMS]
    header = ObjectHeader(kind_e, fingerprint, key_hash, group, rank, tokens, dtype_s, shape, length)
    return header, payload_sum


def decode(data: Buffer, expected: ObjectHeader | None = None) -> tuple[ObjectHeader, memoryview]:
    """Verify an object and return its header and a view of its payload.

    With ``expected``, every identity field must match: a valid object for another
    boundary, group, rank or layout is as unusable as a corrupt one.
    """
    view = memoryview(data).cast("B")
    header, payload_sum = decode_header(view)
    if expected is not None and header.identity() != expected.identity():
        raise IntegrityError("identity", _first_difference(header, expected))
    payload = view[HEADER_SIZE:]
    if len(payload) != header.length:
        raise IntegrityError("length", f"{len(payload)} payload bytes, header says {header.length}")
    if checksum(payload) != payload_sum:
        raise IntegrityError("payload checksum")
    return header, payload


def _first_difference(got: ObjectHeader, want: ObjectHeader) -> str:
    for name in ("kind", "fingerprint", "key_hash", "group", "rank", "tokens", "dtype",
                 "shape", "length"):
        a, b = getattr(got, name), getattr(want, name)
        if a != b:
            return f"{name} is {a!r}, expected {b!r}"
    return "headers differ"
