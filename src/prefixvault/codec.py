"""Object codec: a fixed 128-byte header in front of every object's bytes.

The header says what the bytes are (layout fingerprint, kind, group, rank, the block or
boundary hash, token count, dtype, shape, length). A reader states what it expects; anything
that does not match exactly, or does not verify, raises IntegrityError and is never handed to
a model.

Two ways to verify, told apart by a flag byte:

- *plain* (a namespace without a secret): xxh3-64 checksums of the payload and of the header.
  They catch torn, truncated and corrupted bytes, not a writer who means harm.
- *sealed* (a namespace with a secret, ``tenancy.NamespaceKey``): an AES-256-GMAC tag over the
  header and the payload, with a random 96-bit nonce per object. Without the key nobody can
  write an object or a record that verifies, nor alter one, nor move one to another key (the
  header names the key's hash, group, rank and layout, and the tag covers it). A reader with
  a key accepts sealed objects only; a reader without one accepts plain objects only.

Why GMAC: the tag must be cheap next to the copy it guards (a verified load at least half as
fast as memcpy). With AES-NI and carry-less multiply, OpenSSL's GMAC runs at ~30 GB/s on one
core, as fast as xxh3; keyed BLAKE3 runs at ~8-10 GB/s and keyed BLAKE2b or HMAC-SHA-256 at
1-2 GB/s. Its one condition, a nonce never reused under one key, holds with random nonces for
far more objects than a namespace writes between secret rotations (2**32 objects keep the
chance of a repeat below 2**-32).
"""

from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from prefixvault.layout import DTYPE_SIZES
from prefixvault.stores.base import Buffer
from prefixvault.tenancy import NamespaceKey

MAGIC = b"PVO1"
VERSION = 1
HEADER_SIZE = 128
MAX_DIMS = 8
_DTYPES = sorted(DTYPE_SIZES)  # stable code = index in this list
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPES)}
# magic, version, kind, dtype, ndim, flags, group, rank, tokens, fingerprint, key hash,
# shape[8], payload length. Then, plain: the payload checksum at offset 94, zero padding and
# the header checksum (covering every byte before it) in the last 8 bytes. Sealed: zero
# padding, the nonce at offset 100 and the GMAC tag (over bytes 0..99 and the payload) last.
_FIELDS = struct.Struct(f"<4sHBBBBHHQ16s16s{MAX_DIMS}IQ")
_SUM = struct.Struct("<Q")
_FLAGS_AT = 9
FLAG_SEALED = 1
_PAYLOAD_SUM_AT = _FIELDS.size
_HEADER_SUM_AT = HEADER_SIZE - _SUM.size
NONCE_SIZE, TAG_SIZE = 12, 16
_TAG_AT = HEADER_SIZE - TAG_SIZE
_NONCE_AT = _TAG_AT - NONCE_SIZE
assert _PAYLOAD_SUM_AT + _SUM.size <= _HEADER_SUM_AT and _FIELDS.size <= _NONCE_AT
_FORMAT = struct.Struct("<4sH")  # the first fields of every version's header: magic, version
_VERSION_END = _FORMAT.size
_OURS = _FORMAT.pack(MAGIC, VERSION)


#: ``IntegrityError`` reasons that prove bytes wrong for the key they sit under: only those
#: make a reader remove them. Not among them: ``version`` (an object of this codec's family in
#: another version: a writer of another release, whose bytes are its own, unless the key is
#: the reader's own: ``proved_wrong``) and ``sealed`` (a secret this reader lacks).
#: ``format`` is bytes that are no object at all (no magic) or a header that verifies yet makes
#: no sense: wrong.
PROVED_WRONG = frozenset({"format", "truncated", "header checksum", "payload checksum", "mac",
                          "identity", "length", "unsealed", "denied"})


def proved_wrong(reason: str, own_fingerprint: bool) -> bool:
    """Whether an ``IntegrityError`` of ``reason`` proves the bytes wrong for their key. Under a
    key whose fingerprint is the reader's own, ``version`` does too: the fingerprint names the
    codec and record versions (``CacheLayout.fingerprint``), so no release writes another
    version's object there; such bytes are a flipped bit or a forged write, and kept they would
    fail every hit through them forever."""
    return reason in PROVED_WRONG or (own_fingerprint and reason == "version")
#: The first bytes of every version's objects.
MAGIC_FAMILY = b"PVO"


class ObjectKind(IntEnum):
    BLOCK = 1  # KV block of an attention group
    STATE = 2  # recurrent state at a boundary
    RECORD = 3  # boundary record
    LAYOUT = 4  # a layout description
    DENY = 5  # a namespace's deny-list: digests of bytes proved wrong (``denylist``)
    TAIL_INDEX = 6  # the tail boundaries published past one block boundary (``tails``)


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


def is_sealed(blob: Buffer) -> bool:
    """Whether ``blob`` claims to be sealed (its flag byte; proves nothing about who wrote it,
    only that a reader needs the namespace's key for it)."""
    view = memoryview(blob).cast("B")
    return len(view) >= HEADER_SIZE and bytes(view[:4]) == MAGIC and view[_FLAGS_AT] == FLAG_SEALED


def content_digest(header: ObjectHeader, payload: Buffer) -> bytes:
    """What an object *says*, apart from how it was sealed: xxh3-128 over its identity and its
    payload. A sealed object's nonce and tag differ on every write of the same content, so
    the deny-list names content by this digest: the same wrong bytes are refused whether they
    are replayed as stored or computed and sealed again. (Not collision-resistant against a
    writer who means harm; it need not be: a digest only ever *refuses* bytes, and the MAC
    still decides what verifies.)"""
    h = xxhash.xxh3_128()
    h.update(_fields(header, 0))
    h.update(memoryview(payload).cast("B"))
    return h.digest()


def gmac(key: bytes, nonce: bytes, *parts: Buffer) -> bytes:
    """AES-256-GMAC of ``parts`` (GCM authenticating data only: nothing is encrypted)."""
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    for part in parts:
        enc.authenticate_additional_data(part)
    enc.finalize()
    return enc.tag


def _fields(header: ObjectHeader, flags: int) -> bytes:
    if len(header.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dims, got shape {header.shape}")
    if len(header.fingerprint) != 16 or len(header.key_hash) != 16:
        raise ValueError("fingerprint and key hash must be 16 bytes")
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    return _FIELDS.pack(
        MAGIC, VERSION, int(header.kind), _DTYPE_CODE[header.dtype], len(header.shape), flags,
        header.group, header.rank, header.tokens, header.fingerprint, header.key_hash,
        *shape, header.length,
    )


def encode_header(header: ObjectHeader, payload: Buffer, key: NamespaceKey | None = None) -> bytes:
    """The header of ``payload``: checksummed (plain), or sealed with ``key``'s MAC."""
    out = bytearray(HEADER_SIZE)
    out[: _FIELDS.size] = _fields(header, FLAG_SEALED if key is not None else 0)
    if key is None:
        out[_PAYLOAD_SUM_AT : _PAYLOAD_SUM_AT + _SUM.size] = _SUM.pack(checksum(payload))
        out[_HEADER_SUM_AT:] = _SUM.pack(checksum(memoryview(out)[:_HEADER_SUM_AT]))
    else:
        nonce = os.urandom(NONCE_SIZE)
        out[_NONCE_AT:_TAG_AT] = nonce
        out[_TAG_AT:] = gmac(key.mac_key, nonce, memoryview(out)[:_NONCE_AT], payload)
    return bytes(out)


def encode(header: ObjectHeader, payload: Buffer, key: NamespaceKey | None = None) -> list[Buffer]:
    """Header and payload as the parts of one object (no copy of the payload)."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length:
        raise ValueError(f"payload has {len(view)} bytes, header says {header.length}")
    return [encode_header(header, view, key), view]


def _parse(view: memoryview) -> ObjectHeader:
    fields = _FIELDS.unpack(view[: _FIELDS.size])
    magic, version, kind, dtype, ndim = fields[:5]
    if magic != MAGIC or version != VERSION:
        raise IntegrityError("format", f"magic {magic!r} version {version}")
    try:
        kind_e, dtype_s = ObjectKind(kind), _DTYPES[dtype]
    except (ValueError, IndexError) as e:
        raise IntegrityError("format", str(e)) from None
    if ndim > MAX_DIMS:
        raise IntegrityError("format", f"{ndim} dims")
    group, rank, tokens, fingerprint, key_hash = fields[6:11]
    shape = tuple(fields[11 : 11 + ndim])
    length = fields[11 + MAX_DIMS]
    return ObjectHeader(kind_e, fingerprint, key_hash, group, rank, tokens, dtype_s, shape, length)


def decode(
    data: Buffer, expected: ObjectHeader | None = None, key: NamespaceKey | None = None
) -> tuple[ObjectHeader, memoryview]:
    """Verify an object and return its header and a view of its payload.

    With ``expected``, every identity field must match: a valid object for another
    boundary, group, rank or layout is as unusable as a corrupt one. With ``key`` the object
    must be sealed with it; without, it must be plain.
    """
    view = memoryview(data).cast("B")
    # What format the bytes claim comes first: a header of another version may put its
    # checksums elsewhere, and bytes of another format are not wrong, only not ours to read.
    if len(view) >= _VERSION_END and bytes(view[:_VERSION_END]) != _OURS:
        magic, version = _FORMAT.unpack(view[:_VERSION_END])
        if magic.startswith(MAGIC_FAMILY):
            raise IntegrityError("version", f"an object of format {magic!r} version {version}, this "
                                 f"release reads {MAGIC!r} version {VERSION}")
        raise IntegrityError("format", f"not an object (magic {magic!r})")
    if len(view) < HEADER_SIZE:
        raise IntegrityError("truncated", f"{len(view)} bytes, header needs {HEADER_SIZE}")
    sealed = view[_FLAGS_AT] == FLAG_SEALED
    if key is None and sealed:
        raise IntegrityError("sealed", "object is sealed with a namespace secret; none was given")
    if key is not None and not sealed:
        raise IntegrityError("unsealed", "object in a namespace with a secret carries no MAC")
    if not sealed:
        (stored,) = _SUM.unpack(view[_HEADER_SUM_AT:HEADER_SIZE])
        if checksum(view[:_HEADER_SUM_AT]) != stored:
            raise IntegrityError("header checksum")
    header = _parse(view)  # for a sealed object, trusted only once the MAC verifies below
    if expected is not None and header.identity() != expected.identity():
        raise IntegrityError("identity", _first_difference(header, expected))
    payload = view[HEADER_SIZE:]
    if len(payload) != header.length:
        raise IntegrityError("length", f"{len(payload)} payload bytes, header says {header.length}")
    if key is not None:
        tag = gmac(key.mac_key, bytes(view[_NONCE_AT:_TAG_AT]), view[:_NONCE_AT], payload)
        if not hmac.compare_digest(tag, bytes(view[_TAG_AT:HEADER_SIZE])):
            raise IntegrityError("mac")
    else:
        (payload_sum,) = _SUM.unpack(view[_PAYLOAD_SUM_AT : _PAYLOAD_SUM_AT + _SUM.size])
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
