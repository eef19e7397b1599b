"""Chain hashes over token ids and the store keys derived from them.

``h_i`` names the prefix ending at block i: it covers every token before it and every
extra key (LoRA, cache salt, multimodal inputs). Hashes use BLAKE2b with fixed byte
encodings, so they match across processes and machines without any seed to set. Keys
carry hashes only, never raw token ids. In a namespace with a secret the chain's seed is
keyed (``tenancy.NamespaceKey.hash_key``), so every hash of the chain is a keyed hash and
nobody without the secret can compute the key of a prompt.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

HASH_BYTES = 16
_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input: its content hash and the token span its placeholders occupy."""

    hash: str
    offset: int
    length: int


@dataclass(frozen=True)
class ExtraKeys:
    """Everything besides token ids that changes a prefix's cache."""

    lora: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalItem, ...] = field(default=())

    def seed(self, key: bytes = b"") -> bytes:
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"pv-seed", key=key)
        for tag, value in (("lora", self.lora), ("salt", self.cache_salt)):
            if value is not None:
                # surrogatepass: any str vLLM accepts (a lone surrogate is valid JSON) has
                # one encoding, distinct from every other string's.
                h.update(f"{tag}={len(value)}:{value};".encode("utf-8", "surrogatepass"))
        return h.digest()

    def block_extra(self, start: int, end: int) -> bytes:
        """Multimodal hashes (with their spans) of the items overlapping tokens [start, end)."""
        parts = [
            f"mm={m.offset},{m.length},{m.hash};"
            for m in self.multimodal
            if m.offset < end and m.offset + m.length > start
        ]
        return "".join(parts).encode("utf-8", "surrogatepass")


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: ExtraKeys | None = None,
    start: Sequence[bytes] = (),
    key: bytes = b"",
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``; ``start`` reuses already computed ones;
    ``key`` (a namespace's hash key) makes them keyed hashes."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    extra = extra or ExtraKeys()
    tokens = np.asarray(token_ids, dtype="<i8")
    n_blocks = len(tokens) // block_size
    out = list(start[:n_blocks])
    parent = out[-1] if out else extra.seed(key)
    for i in range(len(out), n_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"pv-block")
        h.update(tokens[lo:hi].tobytes())
        mm = extra.block_extra(lo, hi)
        if mm:
            h.update(mm)
        parent = h.digest()
        out.append(parent)
    return out


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError(f"invalid namespace {str(namespace)[:100]!r}: use 1..64 chars of [A-Za-z0-9._-]")
    return namespace


@dataclass(frozen=True)
class KeySpace:
    """Store keys of one namespace and one layout.

    ``{ns}/{layout}/b/{group}/{rank}/{h_i}``  KV block i of an attention group
    ``{ns}/{layout}/s/{group}/{rank}/{h_i}``  state of a state group at boundary (i+1)*block_size
    ``{ns}/{layout}/r/{h_i}``                 boundary record for boundary (i+1)*block_size
    ``{ns}/{layout}/layout``                  the layout itself (for audits); ``layout.{tag}`` keyed
    ``{ns}/{layout}/deny``                    bytes proved wrong (``denylist``); ``deny.{tag}`` keyed
    """

    namespace: str
    fingerprint: bytes
    #: ``NamespaceKey.tag`` for a keyed namespace ("" otherwise): the layout and deny-list of
    #: a keyed namespace are named ``layout.{tag}`` and ``deny.{tag}``.
    tag: str = ""

    def __post_init__(self) -> None:
        check_namespace(self.namespace)

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/{self.fingerprint.hex()}/"

    # ``*_prefix`` + a hash's hex is the key: lookups build thousands of keys from one hex each.

    def block_prefix(self, group: int, rank: int) -> str:
        return f"{self.prefix}b/{group}/{rank}/"

    def state_prefix(self, group: int, rank: int) -> str:
        return f"{self.prefix}s/{group}/{rank}/"

    def record_prefix(self) -> str:
        return f"{self.prefix}r/"

    def block(self, group: int, rank: int, block_hash: bytes) -> str:
        return self.block_prefix(group, rank) + block_hash.hex()

    def state(self, group: int, rank: int, boundary_hash: bytes) -> str:
        return self.state_prefix(group, rank) + boundary_hash.hex()

    def record(self, boundary_hash: bytes) -> str:
        return self.record_prefix() + boundary_hash.hex()

    def layout(self) -> str:
        return f"{self.prefix}layout" + (f".{self.tag}" if self.tag else "")

    def deny(self) -> str:
        return f"{self.prefix}deny" + (f".{self.tag}" if self.tag else "")
