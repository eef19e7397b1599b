"""Object codec: a fixed 128-byte header in front of every object's bytes.

The header says what the bytes are (layout fingerprint, kind, group, rank, the block or
boundary hash, token count, dtype, shape, length). A reader states what it expects; anything
that does not match exactly, or does not verify, raises IntegrityError and is never handed to
a model.

Three forms; the header's version (and flag byte) says which one an object has:

- *plain* (version 1, a namespace without a secret): xxh3-64 checksums of the payload and of
  the header. They catch torn, truncated and corrupted bytes, not a writer who means harm.
- *encrypted* (version 2, a namespace with a secret, ``tenancy.NamespaceKey``): the payload is
  AES-256-GCM ciphertext under a random 96-bit nonce, the header's fields are its associated
  data, and the tag sits in the header. Without the key nobody can read a payload, write an
  object or a record that verifies, alter one, or move one to another key (the header names
  the key's hash, group, rank and layout, and the tag covers it).
- *sealed* (version 1 with the sealed flag): an AES-256-GMAC over a readable payload, what
  keyed namespaces of earlier releases wrote. No reader of this release accepts one: a keyed
  namespace is named anew by the encrypted form (the layout fingerprint names the form,
  ``form_version``), so its sealed objects are never met under its keys and age out.

A reader with a key accepts encrypted objects only; a reader without one, plain objects only.
An object encrypted under a tenant's key (a request's ``cache_salt``: ``NamespaceKey.tenant``)
carries the tenant flag (it is part of the associated data): a reader with the namespace's own
key meets it as ``tenant`` (another's bytes, never removed for it), while under a key it named
itself it fails its tag like any forgery. (The flag tells a store reader that a request had a
salt, never which.)

Why AES-GCM: decrypting and verifying must cost about a copy, since a load's decryption *is*
its copy (``decode(..., out=)`` writes the plaintext where the caller wants it, and the local
store lets it read straight from its memory: ``Store.get_taken``). With AES-NI/VAES and
carry-less multiply OpenSSL runs it at memory speed on one core; keyed BLAKE2b or HMAC would
be 1-2 GB/s before any encryption. Its one condition, a nonce never reused under one key,
holds with random nonces for far more objects than a namespace writes between secret
rotations (2**32 objects keep the chance of a repeat below 2**-32).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from prefixvault.layout import DTYPE_SIZES
from prefixvault.stores.base import Buffer
from prefixvault.tenancy import NamespaceKey

MAGIC = b"PVO1"
#: The plain form (and the sealed form of earlier releases, told apart by the flag byte).
VERSION = 1
#: The encrypted form: every object of a namespace with a secret.
ENCRYPTED_VERSION = 2
HEADER_SIZE = 128
MAX_DIMS = 8
_DTYPES = sorted(DTYPE_SIZES)  # stable code = index in this list
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPES)}
# magic, version, kind, dtype, ndim, flags, group, rank, tokens, fingerprint, key hash,
# shape[8], payload length. Then, plain: the payload checksum at offset 94, zero padding and
# the header checksum (covering every byte before it) in the last 8 bytes. Encrypted (and
# sealed): zero padding, the nonce at offset 100 and the tag (over bytes 0..99 as associated
# data, and the payload) last.
_FIELDS = struct.Struct(f"<4sHBBBBHHQ16s16s{MAX_DIMS}IQ")
_SUM = struct.Struct("<Q")
_FLAGS_AT = 9
FLAG_SEALED = 1
FLAG_ENCRYPTED = 2
FLAG_TENANT = 4  # with FLAG_ENCRYPTED: under a tenant's key, not the namespace's
_PAYLOAD_SUM_AT = _FIELDS.size
_HEADER_SUM_AT = HEADER_SIZE - _SUM.size
NONCE_SIZE, TAG_SIZE = 12, 16
_TAG_AT = HEADER_SIZE - TAG_SIZE
_NONCE_AT = _TAG_AT - NONCE_SIZE
assert _PAYLOAD_SUM_AT + _SUM.size <= _HEADER_SUM_AT and _FIELDS.size <= _NONCE_AT
_FORMAT = struct.Struct("<4sH")  # the first fields of every version's header: magic, version
_VERSION_END = _FORMAT.size


def form_version(key: NamespaceKey | None) -> int:
    """The version objects are written in: encrypted where there is a key, else plain. The
    layout fingerprint names it (``Vault``), so the two forms never share a key."""
    return ENCRYPTED_VERSION if key is not None else VERSION


#: ``IntegrityError`` reasons that prove bytes wrong for the key they sit under: only those
#: make a reader remove them. Not among them (``proved_wrong`` adds them under the reader's
#: own fingerprint): ``version`` (an object of this codec's family in a version this release
#: does not read: a writer of another release, whose bytes are its own), ``sealed`` (a
#: secret this reader lacks) and ``unencrypted`` (a sealed object of an earlier release).
#: ``format`` is bytes that are no object at all (no magic) or a header that verifies yet makes
#: no sense: wrong.
PROVED_WRONG = frozenset({"format", "truncated", "header checksum", "payload checksum", "mac",
                          "identity", "length", "unsealed", "denied"})
#: Reasons that name bytes of another writer's form: wrong only under the reader's own keys.
#: ``tenant``: a tenant's object met with the namespace's key (only an audit, which walks every
#: key, meets one legitimately: it passes ``own_fingerprint=False`` for it, ``inventory``).
_OTHER_FORM = frozenset({"version", "sealed", "unencrypted", "tenant"})


def _forms() -> tuple[tuple[int, int], ...]:
    """The (version, flags) pairs this release reads (read when called: tests play a later
    release by changing ``VERSION``)."""
    return ((VERSION, 0), (VERSION, FLAG_SEALED), (ENCRYPTED_VERSION, FLAG_ENCRYPTED),
            (ENCRYPTED_VERSION, FLAG_ENCRYPTED | FLAG_TENANT))


def proved_wrong(reason: str, own_fingerprint: bool) -> bool:
    """Whether an ``IntegrityError`` of ``reason`` proves the bytes wrong for their key. Under a
    key whose fingerprint is the reader's own, an object of another form does too: the
    fingerprint names the codec and record versions and the form (``CacheLayout.fingerprint``),
    so no release writes another form's object there; such bytes are a flipped bit or a forged
    write, and kept they would fail every hit through them forever."""
    return reason in PROVED_WRONG or (own_fingerprint and reason in _OTHER_FORM)
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


def _form(view: memoryview) -> tuple[int, int] | None:
    """(version, flags) of bytes with this codec's magic and a full header, else None."""
    if len(view) < HEADER_SIZE or bytes(view[:4]) != MAGIC:
        return None
    return _FORMAT.unpack(view[:_VERSION_END])[1], view[_FLAGS_AT]


def is_sealed(blob: Buffer) -> bool:
    """Whether ``blob`` claims to need a namespace's key (encrypted, or sealed by an earlier
    release); proves nothing about who wrote it."""
    form = _form(memoryview(blob).cast("B"))
    return form in _forms() and form != (VERSION, 0)


def content_digest(header: ObjectHeader, payload: Buffer) -> bytes:
    """What an object *says*, apart from how it was sealed: xxh3-128 over its identity and its
    plaintext payload. An encrypted object's nonce, tag and ciphertext differ on every write of
    the same content, so the deny-list names content by this digest: the same wrong bytes are
    refused whether they are replayed as stored or computed and encrypted again. (Not
    collision-resistant against a writer who means harm; it need not be: a digest only ever
    *refuses* bytes, and the tag still decides what verifies.)"""
    h = xxhash.xxh3_128()
    h.update(_fields(header, VERSION, 0))
    h.update(memoryview(payload).cast("B"))
    return h.digest()


def _fields(header: ObjectHeader, version: int, flags: int) -> bytes:
    if len(header.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dims, got shape {header.shape}")
    if len(header.fingerprint) != 16 or len(header.key_hash) != 16:
        raise ValueError("fingerprint and key hash must be 16 bytes")
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    return _FIELDS.pack(
        MAGIC, version, int(header.kind), _DTYPE_CODE[header.dtype], len(header.shape), flags,
        header.group, header.rank, header.tokens, header.fingerprint, header.key_hash,
        *shape, header.length,
    )


def _u8(data: Buffer) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _encrypted_flags(key: NamespaceKey) -> int:
    return FLAG_ENCRYPTED | (FLAG_TENANT if key.is_tenant else 0)


def _encrypt(key: NamespaceKey, head: bytearray, payload: Buffer, out: memoryview) -> None:
    """Encrypt ``payload`` into ``out`` (may be the payload's own memory) under a fresh nonce,
    with ``head``'s fields as associated data; write the nonce and tag into ``head``."""
    nonce = os.urandom(NONCE_SIZE)
    head[_NONCE_AT:_TAG_AT] = nonce
    enc = Cipher(algorithms.AES(key.mac_key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(bytes(head[:_NONCE_AT]))
    if len(out):
        enc.update_into(payload, out)
    enc.finalize()
    head[_TAG_AT:] = enc.tag


def encode_into(header: ObjectHeader, payload: Buffer, dst: memoryview,
                key: NamespaceKey | None = None) -> None:
    """Write the whole object into ``dst`` (``HEADER_SIZE + header.length`` bytes) in one pass
    over the payload: copied and checksummed (plain), or encrypted into it (with ``key``).
    ``payload`` may already lie at ``dst[HEADER_SIZE:]`` (built in place)."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length or len(dst) != HEADER_SIZE + header.length:
        raise ValueError(f"payload has {len(view)} bytes, header says {header.length}, "
                         f"object has room for {len(dst) - HEADER_SIZE}")
    head = bytearray(HEADER_SIZE)
    body = dst[HEADER_SIZE:]
    if key is None:
        head[: _FIELDS.size] = _fields(header, VERSION, 0)
        src, out = _u8(view), _u8(body)
        if len(src) and src.ctypes.data != out.ctypes.data:
            np.copyto(out, src)
        head[_PAYLOAD_SUM_AT : _PAYLOAD_SUM_AT + _SUM.size] = _SUM.pack(checksum(body))
        head[_HEADER_SUM_AT:] = _SUM.pack(checksum(memoryview(head)[:_HEADER_SUM_AT]))
    else:
        head[: _FIELDS.size] = _fields(header, ENCRYPTED_VERSION, _encrypted_flags(key))
        _encrypt(key, head, view, body)
    dst[:HEADER_SIZE] = head


def encode_header(header: ObjectHeader, payload: Buffer) -> bytes:
    """The header of a plain object of ``payload`` (encrypted objects: ``encode``)."""
    out = bytearray(HEADER_SIZE)
    out[: _FIELDS.size] = _fields(header, VERSION, 0)
    out[_PAYLOAD_SUM_AT : _PAYLOAD_SUM_AT + _SUM.size] = _SUM.pack(checksum(payload))
    out[_HEADER_SUM_AT:] = _SUM.pack(checksum(memoryview(out)[:_HEADER_SUM_AT]))
    return bytes(out)


def encode(header: ObjectHeader, payload: Buffer, key: NamespaceKey | None = None) -> list[Buffer]:
    """Header and payload as the parts of one object: the payload itself (plain, no copy), or
    its ciphertext in fresh memory (with ``key``)."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length:
        raise ValueError(f"payload has {len(view)} bytes, header says {header.length}")
    if key is None:
        return [encode_header(header, view), view]
    head = bytearray(HEADER_SIZE)
    head[: _FIELDS.size] = _fields(header, ENCRYPTED_VERSION, _encrypted_flags(key))
    out = np.empty(len(view), dtype=np.uint8).data.cast("B")
    _encrypt(key, head, view, out)
    return [bytes(head), out]


def _parse(view: memoryview) -> ObjectHeader:
    fields = _FIELDS.unpack(view[: _FIELDS.size])
    kind, dtype, ndim = fields[2:5]
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
    data: Buffer, expected: ObjectHeader | None = None, key: NamespaceKey | None = None,
    out: memoryview | None = None,
) -> tuple[ObjectHeader, memoryview]:
    """Verify an object and return its header and its (plaintext) payload.

    With ``expected``, every identity field must match: a valid object for another
    boundary, group, rank or layout is as unusable as a corrupt one. With ``key`` the object
    must be encrypted with it, and its payload is decrypted into ``out`` (the payload's length;
    it may be the object's own payload bytes: decrypted in place), or into fresh memory;
    without a key it must be plain, and the payload is a view of ``data``. Bytes written into
    ``out`` before a failure are garbage, never a payload.
    """
    view = memoryview(data).cast("B")
    # What format the bytes claim comes first: a header of another version may put its
    # checksums elsewhere, and bytes of another format are not wrong, only not ours to read.
    if len(view) >= _VERSION_END:
        magic, version = _FORMAT.unpack(view[:_VERSION_END])
        if magic != MAGIC or version not in (VERSION, ENCRYPTED_VERSION):
            if magic.startswith(MAGIC_FAMILY):
                raise IntegrityError("version", f"an object of format {magic!r} version {version}, this "
                                     f"release reads {MAGIC!r} versions {VERSION} and {ENCRYPTED_VERSION}")
            raise IntegrityError("format", f"not an object (magic {magic!r})")
    if len(view) < HEADER_SIZE:
        raise IntegrityError("truncated", f"{len(view)} bytes, header needs {HEADER_SIZE}")
    form = _form(view)
    assert form is not None
    if form not in _forms():
        raise IntegrityError("format", f"version {form[0]} with flags {form[1]}")
    encrypted = form[0] == ENCRYPTED_VERSION
    if key is not None and not key.is_tenant and form[1] & FLAG_TENANT:
        raise IntegrityError("tenant", "object is encrypted for a tenant (a cache_salt) this reader "
                             "does not hold")
    if key is None and form[1]:
        raise IntegrityError("sealed", "object is sealed with a namespace secret; none was given")
    if key is not None and not encrypted:
        if form[1] == FLAG_SEALED:
            raise IntegrityError("unencrypted", "a sealed object of an earlier release: its payload "
                                 "is readable, and keyed namespaces accept encrypted objects only")
        raise IntegrityError("unsealed", "object in a namespace with a secret carries no MAC")
    if encrypted:
        head = memoryview(bytes(view[:HEADER_SIZE]))  # (what is checked is what authenticates)
    else:
        head = view[:HEADER_SIZE]
        (stored,) = _SUM.unpack(head[_HEADER_SUM_AT:HEADER_SIZE])
        if checksum(head[:_HEADER_SUM_AT]) != stored:
            raise IntegrityError("header checksum")
    header = _parse(head)  # for an encrypted object, trusted only once the tag verifies below
    if expected is not None and header.identity() != expected.identity():
        raise IntegrityError("identity", _first_difference(header, expected))
    payload = view[HEADER_SIZE:]
    if len(payload) != header.length:
        raise IntegrityError("length", f"{len(payload)} payload bytes, header says {header.length}")
    if not encrypted:
        (payload_sum,) = _SUM.unpack(head[_PAYLOAD_SUM_AT : _PAYLOAD_SUM_AT + _SUM.size])
        if checksum(payload) != payload_sum:
            raise IntegrityError("payload checksum")
        return header, payload
    assert key is not None
    if out is None:
        out = np.empty(len(payload), dtype=np.uint8).data.cast("B")
    elif len(out) != len(payload):
        raise ValueError(f"{len(out)} bytes given for a payload of {len(payload)}")
    dec = Cipher(algorithms.AES(key.mac_key), modes.GCM(bytes(head[_NONCE_AT:_TAG_AT]))).decryptor()
    dec.authenticate_additional_data(head[:_NONCE_AT])
    if len(payload):
        dec.update_into(payload, out)
    try:
        dec.finalize_with_tag(bytes(head[_TAG_AT:]))
    except InvalidTag:
        raise IntegrityError("mac") from None
    return header, out


def _first_difference(got: ObjectHeader, want: ObjectHeader) -> str:
    for name in ("kind", "fingerprint", "key_hash", "group", "rank", "tokens", "dtype",
                 "shape", "length"):
        a, b = getattr(got, name), getattr(want, name)
        if a != b:
            return f"{name} is {a!r}, expected {b!r}"
    return "headers differ"
