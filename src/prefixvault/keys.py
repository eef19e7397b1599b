"""Chain hashes over token ids and the store keys derived from them.

``h_i`` names the prefix ending at block i: it covers every token before it and every
extra key (LoRA, cache salt, multimodal inputs). A prefix that ends inside a block (a *tail*
boundary: a prompt's exact end, a chunk that ended mid-block) is named by its *tail hash*:
the hash of its last full block's chain hash (the seed, before the first block) and the
tokens past it. The hashes of a prefix of ``t`` tokens are one per block it touches,
``ceil(t / block_size)``: the chain hashes of its full blocks, then its tail hash if it has a
tail (``prefix_hashes``); the last always names the prefix itself. Hashes use BLAKE2b with fixed byte
encodings, so they match across processes and machines without any seed to set. Keys
carry hashes only, never raw token ids. In a namespace with a secret the chain's seed is
keyed (``tenancy.NamespaceKey.hash_key``), so every hash of the chain is a keyed hash and
nobody without the secret can compute the key of a prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prefixvault.tenancy import NamespaceKey

HASH_BYTES = 16
#: Hex digits of a key's tag (``NamespaceKey.tag``): a tenant's namespace is ``{ns}.{tag}``.
TAG_CHARS = 16
#: Longest namespace name.
MAX_NAMESPACE = 64
_NAMESPACE = re.compile(rf"^[A-Za-z0-9._-]{{1,{MAX_NAMESPACE}}}$")


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
    # The engine's epoch after a reset of its cache (new weights): a random token no client
    # knows, so nothing keyed before the reset, nor by any other engine, is ever found. None
    # before any reset (the keys every engine of the namespace shares).
    epoch: str | None = None

    def seed(self, key: bytes = b"") -> bytes:
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"pv-seed", key=key)
        for tag, value in (("lora", self.lora), ("salt", self.cache_salt), ("epoch", self.epoch)):
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


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's token ids and extra keys: what names its tail boundaries (``tail_hash``)."""

    tokens: Sequence[int]
    extra: ExtraKeys = field(default_factory=ExtraKeys)

    def tail(self, parent: bytes, start: int, end: int) -> bytes:
        """The tail hash of the prefix of ``end`` tokens whose last full block ends at ``start``
        (``parent``: the chain hash there, or the seed)."""
        return tail_hash(parent, self.tokens[start:end], self.extra.block_extra(start, end))


def tail_hash(parent: bytes, tail: Sequence[int] | np.ndarray, extra_bytes: bytes = b"") -> bytes:
    """The name of a prefix that ends ``len(tail)`` tokens past a block boundary: ``parent`` is
    the chain hash there (or the chain's seed), ``extra_bytes`` the multimodal hashes of the
    tail's span. Another hash function than the chain's (its own personalisation), so a tail
    hash never equals a chain hash."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"pv-tail")
    h.update(np.asarray(tail, dtype="<i8").tobytes())
    if extra_bytes:
        h.update(extra_bytes)
    return h.digest()


def prefix_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: ExtraKeys | None = None,
    start: Sequence[bytes] = (),
    key: bytes = b"",
) -> list[bytes]:
    """The hashes of the prefix ``token_ids``: one per block it touches, the chain hashes of
    its full blocks then, if it ends inside a block, its tail hash. ``start``: chain hashes
    already computed (full blocks only)."""
    extra = extra or ExtraKeys()
    out = chain_hashes(token_ids, block_size, extra, start, key)
    k = len(out)
    if len(token_ids) > k * block_size:
        parent = out[-1] if out else extra.seed(key)
        out.append(tail_hash(parent, token_ids[k * block_size :],
                             extra.block_extra(k * block_size, len(token_ids))))
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
    ``{ns}/{layout}/t/{h_k}``                 the tail boundaries published past block k (``tails``)
    ``{ns}/{layout}/layout``                  the layout itself (for audits); ``layout.{tag}`` keyed
    ``{ns}/{layout}/deny``                    bytes proved wrong (``denylist``); ``deny.{tag}`` keyed

    With ``tenant_namespaces`` a tenant's objects, records, tail indexes and samples are kept
    under ``{ns}.{tenant tag}/{layout}/`` instead (``of``): a namespace of their own, which a
    store bounds as any other (the local store's ``namespace_share``, a Redis ACL's key
    pattern), so one tenant filling the store evicts its own objects first. The layout and
    the deny-list stay the namespace's.
    """

    namespace: str
    fingerprint: bytes
    #: ``NamespaceKey.tag`` for a keyed namespace ("" otherwise): the layout and deny-list of
    #: a keyed namespace are named ``layout.{tag}`` and ``deny.{tag}``.
    tag: str = ""
    #: Each tenant's keys under a namespace of its own (``of``); a keyed namespace only.
    tenant_namespaces: bool = False
    #: The ``NamespaceKey.tag`` of the tenant whose keys these are ("": the namespace's own).
    tenant: str = ""

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.tenant_namespaces:
            check_namespace(f"{self.namespace}.{'0' * TAG_CHARS}")  # room for a tenant's tag
            if not self.tag:
                raise ValueError("tenant_namespaces needs a namespace with a secret (a tenant is a key)")

    def of(self, key: NamespaceKey | None) -> KeySpace:
        """The keys of the requests sealed with ``key`` (``TenantKeys.get``): a tenant's own
        namespace with ``tenant_namespaces``, else these."""
        if not self.tenant_namespaces or key is None or not key.is_tenant or self.tenant:
            return self
        return _tenant_space(self, key.tag)

    @property
    def home(self) -> str:
        """The prefix of the namespace's own keys (its layout and deny-list are there)."""
        return f"{self.namespace}/{self.fingerprint.hex()}/"

    @property
    def prefix(self) -> str:
        name = f"{self.namespace}.{self.tenant}" if self.tenant else self.namespace
        return f"{name}/{self.fingerprint.hex()}/"

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

    def tail_index_prefix(self) -> str:
        return f"{self.prefix}t/"

    def tail_index(self, parent_hash: bytes) -> str:
        return self.tail_index_prefix() + parent_hash.hex()

    def layout(self) -> str:
        return f"{self.home}layout" + (f".{self.tag}" if self.tag else "")

    def deny(self) -> str:
        return f"{self.home}deny" + (f".{self.tag}" if self.tag else "")


@functools.lru_cache(maxsize=4096)
def _tenant_space(space: KeySpace, tag: str) -> KeySpace:
    """(Kept: every lookup, save and load of a tenant asks for its keys again.)"""
    return dataclasses.replace(space, tenant=tag)
