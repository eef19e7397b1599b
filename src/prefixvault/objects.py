"""The objects of one layout: which ones a boundary needs, the key of each, and the header its
bytes must carry.

An object is the bytes of one KV block or one state, of one cache group on one rank. Its key
names its content (the chain hash of the block, or of the boundary for a state; for a tail
boundary, its tail hash names both its state and its partly filled last block) within a
namespace and a layout fingerprint, so the same key is the same bytes whoever computed them;
its expected header is what a reader checks before it uses them (invariant 3). A ref also
carries the ``cache_salt`` of the request that names it: the tenant whose key its bytes are
encrypted under (``tenancy``), so one load may read the objects of several tenants.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prefixvault.boundary import SavePlan, needed_blocks
from prefixvault.codec import ObjectHeader, ObjectKind
from prefixvault.keys import KeySpace
from prefixvault.layout import CacheLayout, TensorSpec
from prefixvault.tenancy import TenantKeys


@dataclass(frozen=True)
class ObjectRef:
    """One object a boundary needs: a KV block or a state, of one group on one rank."""

    key: str
    kind: ObjectKind
    group: int
    rank: int
    key_hash: bytes
    tokens: int  # block end (BLOCK; a tail boundary for its partly filled block) or boundary (STATE)
    block_index: int  # index of the KV block, or of the block a state's boundary ends in
    # The request's cache salt: which tenant's key seals the object (None: the namespace's).
    # Never shown: a tenant's salt is its secret as much as the namespace's secret is.
    salt: str | None = field(default=None, repr=False)


def chain_order(ref: ObjectRef) -> tuple[int, bool]:
    """Where an object sits in its prefix's chain: by block, a block's KV before the state at
    its end. Objects are handed to the store in this order, and a store ranks keys used
    together in the order given (the first kept longest), so a chain ages from its tail."""
    return ref.tokens, ref.kind is ObjectKind.STATE


@dataclass(frozen=True)
class ObjectNames:
    """Names the objects of ``layout`` in the key space ``keys`` (of that layout's
    fingerprint). Pure: no store, no state."""

    layout: CacheLayout
    keys: KeySpace
    #: Each salt's key, where tenants' objects are named apart (``KeySpace.of``).
    tenants: TenantKeys | None = None

    def space(self, salt: str | None) -> KeySpace:
        """The keys of the requests with cache salt ``salt`` (``KeySpace.of``)."""
        if salt is None or self.tenants is None or not self.keys.tenant_namespaces:
            return self.keys
        return self.keys.of(self.tenants.get(salt))

    def needed(
        self, hashes: Sequence[bytes], tokens: int, ranks: Iterable[int] | None = None, since: int = 0,
        salt: str | None = None,
    ) -> list[ObjectRef]:
        """Every object (all groups, the given ranks) needed to resume at ``tokens``, named by
        ``hashes`` (the prefix's: ``keys.prefix_hashes``); KV blocks only from boundary ``since``
        on (those before it are covered elsewhere: a parent record, or the engine's own cache);
        ``salt``: the request's cache salt (``ObjectRef.salt``)."""
        bs = self.layout.block_size
        n = -(-tokens // bs)
        if tokens <= 0 or n > len(hashes) or (tokens % bs and not self.layout.has_state):
            raise ValueError(f"boundary {tokens} is not a boundary within {len(hashes)} blocks")
        first = since // bs if 0 < since < tokens else 0
        space = self.space(salt)
        refs: list[ObjectRef] = []
        for rank in range(self.layout.world_size) if ranks is None else ranks:
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:
                    refs.append(self._state_ref(space, gi, rank, hashes[n - 1], n - 1, tokens, salt))
                else:
                    need = needed_blocks(group, tokens, bs)
                    refs.extend(self._chain_block(space, gi, rank, hashes, i, tokens, salt)
                                for i in range(max(first, need.start), need.stop))
        return refs

    def objects_of(
        self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan], salt: str | None = None
    ) -> tuple[list[tuple[ObjectRef, int]], list[list[str]]]:
        """The distinct objects ``plans`` store on ``rank``, each with the engine block it is
        read from, and each plan's object keys."""
        wanted: dict[str, tuple[ObjectRef, int]] = {}
        per_plan: list[list[str]] = []
        space = self.space(salt)
        for plan in plans:
            keys: list[str] = []
            n = -(-plan.tokens // self.layout.block_size)
            for gi, i, block_id in plan.blocks:
                ref = self._chain_block(space, gi, rank, hashes, i, plan.tokens, salt)
                wanted.setdefault(ref.key, (ref, block_id))
                keys.append(ref.key)
            for gi, block_id in plan.states:
                ref = self._state_ref(space, gi, rank, hashes[n - 1], n - 1, plan.tokens, salt)
                wanted[ref.key] = (ref, block_id)
                keys.append(ref.key)
            per_plan.append(keys)
        return list(wanted.values()), per_plan

    def _chain_block(self, space: KeySpace, group: int, rank: int, hashes: Sequence[bytes], i: int,
                     boundary: int, salt: str | None) -> ObjectRef:
        """Block ``i`` of the prefix ``hashes`` names, which resumes at ``boundary``: the block a
        tail boundary ends in is its partly filled one."""
        tail = boundary if i == boundary // self.layout.block_size else None
        return self._block_ref(space, group, rank, hashes[i], i, tail, salt)

    def block_ref(self, group: int, rank: int, block_hash: bytes, i: int,
                  tail_end: int | None = None, salt: str | None = None) -> ObjectRef:
        """KV block ``i`` (named by its chain hash) of an attention group on ``rank``; with
        ``tail_end``, the block filled up to that tail boundary (named by its tail hash)."""
        return self._block_ref(self.space(salt), group, rank, block_hash, i, tail_end, salt)

    def state_ref(self, group: int, rank: int, boundary_hash: bytes, i: int,
                  tokens: int | None = None, salt: str | None = None) -> ObjectRef:
        """The state of a state group on ``rank`` at the end of block ``i``, or at ``tokens``
        inside it (a tail boundary)."""
        return self._state_ref(self.space(salt), group, rank, boundary_hash, i, tokens, salt)

    def _block_ref(self, space: KeySpace, group: int, rank: int, block_hash: bytes, i: int,
                   tail_end: int | None, salt: str | None) -> ObjectRef:
        end = tail_end if tail_end is not None else (i + 1) * self.layout.block_size
        return ObjectRef(space.block(group, rank, block_hash), ObjectKind.BLOCK, group, rank,
                         block_hash, end, i, salt)

    def _state_ref(self, space: KeySpace, group: int, rank: int, boundary_hash: bytes, i: int,
                   tokens: int | None, salt: str | None) -> ObjectRef:
        end = tokens if tokens is not None else (i + 1) * self.layout.block_size
        return ObjectRef(space.state(group, rank, boundary_hash), ObjectKind.STATE, group, rank,
                         boundary_hash, end, i, salt)

    def expected_header(self, ref: ObjectRef) -> ObjectHeader:
        """The header an object must carry to be used for ``ref``."""
        group = self.layout.groups[ref.group]
        shard = group.shards[ref.rank]
        shape, dtype = _payload_shape(shard)
        return ObjectHeader(ref.kind, self.keys.fingerprint, ref.key_hash, ref.group, ref.rank,
                            ref.tokens, dtype, shape, group.nbytes(ref.rank))


def _payload_shape(shard: Sequence[object]) -> tuple[tuple[int, ...], str]:
    """Header shape and dtype of a shard: the tensor's own if it is one tensor, else flat bytes."""
    specs = [s for s in shard if isinstance(s, TensorSpec)]
    if len(specs) == 1:
        return specs[0].shape, specs[0].dtype
    return (sum(s.nbytes for s in specs),), "uint8"
