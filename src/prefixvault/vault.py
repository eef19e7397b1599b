"""The vault protocol over one store: save objects, publish records, look up hits and load
verified bytes. ``Vault`` is the one entry point adapters use; each idea lives in its module:

- ``objects``: which objects a boundary needs, their keys and the headers they must carry;
- ``saving``: a rank stores its objects and acknowledges each boundary (``RankAck``);
- ``publishing``: a record is written last, only when every object of every rank is
  acknowledged or seen in the store (invariant 1);
- ``lookup``: the longest published boundary whose objects are all still stored, in one or
  two batched round trips whatever the prompt length (invariant 2);
- ``loading``: every object is checked against the header the reader expects, its checksum
  (its MAC, in a namespace with a secret) and the deny-list before its payload is handed out;
  bad objects are counted, and removed where they are wrong again when read once more
  (invariant 3);
- ``quarantine`` and ``denysync``: bytes proved wrong are listed in the namespace's deny-list
  (``denylist``) and refused by loads, saves and lookups until they expire;
- ``stored_layout``: the layout object audits read to check records without an engine.

Tenants (``tenancy``): in a namespace with a secret, a request's ``cache_salt`` selects the key
its hashes are keyed with and its objects, records, tail indexes and samples are encrypted
with. Every entry point takes the tenant per call, as the salt: ``ExtraKeys.cache_salt`` where
hashes are computed, ``salt``/``salts`` per lookup, save and publish, ``ObjectRef.salt`` per
object loaded (a load may read several tenants' objects). With ``tenant_namespaces`` a
tenant's keys are also under a namespace of its own, ``{namespace}.{tag}`` (``KeySpace.of``),
for a store to bound each tenant's share. The layout object and the deny-list stay the
namespace's. Without a secret a salt only enters the hash chain (``ExtraKeys.seed``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prefixvault import codec
from prefixvault.boundary import Refusal, SavePlan
from prefixvault.codec import ObjectHeader
from prefixvault.counters import Counters
from prefixvault.denylist import DENY_TTL_S, DenyList
from prefixvault.denysync import DenySync
from prefixvault.hotset import HotSet
from prefixvault.keys import ExtraKeys, KeySpace, PromptTokens, chain_hashes, prefix_hashes
from prefixvault.layout import CacheLayout
from prefixvault.loading import READS_SEEN, Loaded, Loader
from prefixvault.lookup import RECORD_RETRIES, SPECULATIVE_KEYS, HitFinder, LookupResult, Miss, Touch
from prefixvault.objects import ObjectNames, ObjectRef, chain_order
from prefixvault.publishing import Publisher, RankAck, producer_id
from prefixvault.quarantine import Quarantine
from prefixvault.records import RECORD_VERSION
from prefixvault.saving import Saver
from prefixvault.stored_layout import LAYOUT_VERIFY_S, StoredLayout
from prefixvault.stores.base import Buffer, Store
from prefixvault.tenancy import NamespaceKey, TenantKeys

__all__ = [
    "LAYOUT_VERIFY_S", "READS_SEEN", "RECORD_RETRIES", "SPECULATIVE_KEYS", "Loaded", "LookupResult",
    "Miss", "ObjectRef", "RankAck", "Touch", "Vault", "VaultCounters", "chain_order", "producer_id",
]


@dataclass
class VaultCounters(Counters):
    """What the vault did; adapters export these as engine metrics (the lookup, load and
    save threads all count into one vault, through its parts)."""

    put_keys: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    put_skipped: int = 0  # already in the store
    put_denied: int = 0  # bytes this producer computed are in the deny-list: not stored
    get_keys: int = 0
    get_bytes: int = 0
    get_failed: int = 0
    hot_keys: int = 0  # objects a load took from the hot set, not the store
    hot_bytes: int = 0
    reread_bytes: int = 0  # bytes read for objects this vault had read before (of the last READS_SEEN)
    torn_reads: int = 0  # objects wrong when loaded and whole when read again (a read raced an overwrite)
    records_published: int = 0
    layout_writes: int = 0
    records_existing: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    lookup_asks: int = 0  # prompts looked up in the store (the connector's ``lookups`` are requests)
    found_tokens: int = 0  # tokens those lookups found (the connector's ``hit_tokens`` are loaded)
    misses: Counter[str] = field(default_factory=Counter)  # lookups short of the longest prefix, by Miss


class Vault:
    """The protocol for one layout in one namespace of one store.

    With ``key`` (the namespace's secret, derived) hashes are keyed and every object and
    record is encrypted with it, or with its request's tenant's key (``key_for``), and must
    decrypt and verify with that. The parts share one store, one key space, one set of
    counters, one deny-list and one cache of tenant keys; each is given what it uses."""

    def __init__(self, store: Store, layout: CacheLayout, namespace: str = "default",
                 key: NamespaceKey | None = None, hot_bytes: int = 0,
                 tenant_namespaces: bool = False) -> None:
        """``hot_bytes``: memory for objects recently loaded, served again without the store
        (``HotSet``; 0: none). ``tenant_namespaces``: each tenant's keys under a namespace of
        its own (``KeySpace.of``; a keyed namespace only)."""
        if key is not None and key.namespace != namespace:
            raise ValueError(f"namespace key for {key.namespace!r} given to namespace {namespace!r}")
        self.store = store
        self.layout = layout
        # The formats objects and records are written in are part of the name of everything
        # stored: engines of two versions on one store use disjoint keys, never each other's;
        # so is the form (encrypted with a key, plain without: ``codec.form_version``).
        self.fingerprint = layout.fingerprint(formats=(codec.form_version(key), RECORD_VERSION))
        self.keys = KeySpace(namespace, self.fingerprint, key.tag if key is not None else "",
                             tenant_namespaces=tenant_namespaces)
        self.key = key
        self.tenants = TenantKeys(key)
        self.counters = VaultCounters()
        self.hot = HotSet(hot_bytes) if hot_bytes > 0 else None
        self._names = ObjectNames(layout, self.keys, self.tenants)
        self._deny = DenySync(store, self.keys, key, self.counters)
        self._stored_layout = StoredLayout(store, layout, self.fingerprint, self.keys.layout(), key,
                                           self.counters)
        self._saver = Saver(store, layout, self._names, self.tenants, self.counters, self._deny)
        self._publisher = Publisher(store, layout, self.keys, self._names, self.tenants, self.counters,
                                    self._stored_layout)
        self._hits = HitFinder(store, layout, self.keys, self.counters, self._deny, self._stored_layout)
        self._loader = Loader(store, self._names, self.tenants, self.counters, self._deny, self.hot)
        self._quarantine = Quarantine(store, layout, self.keys, self._names, self._deny)

    def record_key(self, boundary_hash: bytes, salt: str | None = None) -> str:
        """The store key of the record of the boundary ``boundary_hash`` names, for the
        requests with cache salt ``salt``."""
        return self._names.space(salt).record(boundary_hash)

    def key_for(self, salt: str | None) -> NamespaceKey | None:
        """The key of the requests with cache salt ``salt``: its tenant's in a namespace with a
        secret (derived once, kept), else the namespace's (None without a secret)."""
        return self.tenants.get(salt)

    def _hash_key(self, extra: ExtraKeys | None) -> bytes:
        key = self.tenants.get(extra.cache_salt if extra is not None else None)
        return key.hash_key if key is not None else b""

    @property
    def deny(self) -> DenyList:
        """Bytes proved wrong in this namespace and layout, as this vault holds them."""
        return self._deny.held

    # -- naming (``objects``) --------------------------------------------------------------------

    def hashes(
        self, token_ids: Sequence[int], extra: ExtraKeys | None = None, start: Sequence[bytes] = ()
    ) -> list[bytes]:
        """Chain hashes of the full blocks of ``token_ids`` (keyed with the key of the tenant
        ``extra.cache_salt`` names)."""
        return chain_hashes(token_ids, self.layout.block_size, extra, start, self._hash_key(extra))

    def prefix_hashes(
        self, token_ids: Sequence[int], extra: ExtraKeys | None = None, start: Sequence[bytes] = ()
    ) -> list[bytes]:
        """The hashes naming the prefix ``token_ids`` and its objects: its full blocks' chain
        hashes, then its tail hash where it ends inside a block (``keys.prefix_hashes``)."""
        return prefix_hashes(token_ids, self.layout.block_size, extra, start, self._hash_key(extra))

    def seed(self, extra: ExtraKeys | None = None) -> bytes:
        """The chain's seed for ``extra``: what names the tails past block 0."""
        return (extra or ExtraKeys()).seed(self._hash_key(extra))

    def needed(self, hashes: Sequence[bytes], tokens: int, ranks: Iterable[int] | None = None,
               since: int = 0, salt: str | None = None) -> list[ObjectRef]:
        """Every object needed to resume at ``tokens`` (KV blocks from ``since`` on), of the
        tenant ``salt`` names."""
        return self._names.needed(hashes, tokens, ranks, since, salt)

    def block_ref(self, group: int, rank: int, block_hash: bytes, i: int,
                  tail_end: int | None = None, salt: str | None = None) -> ObjectRef:
        return self._names.block_ref(group, rank, block_hash, i, tail_end, salt)

    def state_ref(self, group: int, rank: int, boundary_hash: bytes, i: int,
                  tokens: int | None = None, salt: str | None = None) -> ObjectRef:
        return self._names.state_ref(group, rank, boundary_hash, i, tokens, salt)

    def expected_header(self, ref: ObjectRef) -> ObjectHeader:
        return self._names.expected_header(ref)

    def objects_of(self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan],
                   salt: str | None = None) -> tuple[list[tuple[ObjectRef, int]], list[list[str]]]:
        return self._names.objects_of(rank, hashes, plans, salt)

    # -- save (one rank, ``saving``) and publish (``publishing``) ---------------------------------

    def save(self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan],
             read: Callable[[ObjectRef, int], Buffer],
             read_into: Callable[[ObjectRef, int, memoryview], None] | None = None,
             salt: str | None = None) -> list[RankAck]:
        """Store this rank's objects for every plan; one ack per plan (``Saver.save_many``:
        what ``read`` and ``read_into`` give). Objects already stored are not written again.
        ``salt``: the request's cache salt (its tenant)."""
        return self.save_many(rank, [(hashes, plans)], read, read_into, [salt])[0]

    def save_many(self, rank: int, saves: Sequence[tuple[Sequence[bytes], Sequence[SavePlan]]],
                  read: Callable[[ObjectRef, int], Buffer],
                  read_into: Callable[[ObjectRef, int, memoryview], None] | None = None,
                  salts: Sequence[str | None] | None = None) -> list[list[RankAck]]:
        """``save`` for several prefixes, (hashes, plans) each, in one existence check and one
        batch put; the acks of each, in order. ``salts``: each prefix's cache salt."""
        return self._saver.save_many(rank, saves, read, read_into, salts)

    def publish(
        self, hashes: Sequence[bytes], acks: Iterable[RankAck], parent: int = 0, seed: bytes | None = None,
        salt: str | None = None,
    ) -> dict[int, Refusal | None]:
        """Write the records of the acknowledged boundaries that every rank has stored.

        ``acks`` are the answers of ``save`` (this rank's, or every rank's where a coordinator
        gathers them); a rank without an ok ack is checked in the store. ``parent`` is an
        earlier boundary of the same prefix whose record covers the KV blocks the saves skipped
        (``plan_saves(since=parent)``). Returns, per boundary, None if its record exists now,
        else why not. ``seed``: the chain's seed, for a tail boundary in the first block;
        ``salt``: the request's cache salt (its tenant)."""
        return self.publish_many([(hashes, acks, parent)], [seed], [salt])[0]

    def publish_many(
        self, publishes: Sequence[tuple[Sequence[bytes], Iterable[RankAck], int]],
        seeds: Sequence[bytes | None] | None = None, salts: Sequence[str | None] | None = None,
    ) -> list[dict[int, Refusal | None]]:
        """``publish`` for several prefixes, (hashes, acks, parent) each, in the round trips of
        one (``seeds``: each prefix's chain seed, for a tail boundary in its first block;
        ``salts``: each prefix's cache salt)."""
        return self._publisher.publish_many(publishes, seeds, salts)

    def refuse(self, reason: Refusal, count: int = 1) -> None:
        """Count boundaries the boundary rule refused (for metrics)."""
        self._publisher.refuse(reason, count)

    def layout_object(self) -> bytes:
        return self._stored_layout.blob()

    def keep_layout(self, present: bool | None = None) -> None:
        """Keep the layout object stored, valid, and as fresh as the records that need it."""
        self._stored_layout.keep(present)

    # -- lookup (``lookup``) ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int = 0,
               prompt: PromptTokens | None = None, salt: str | None = None) -> int:
        """Tokens of the longest published, still complete boundary beyond ``min_tokens``; 0 if
        none. With ``prompt`` (its tokens and extra keys), tail boundaries are looked up too.
        ``salt``: the request's cache salt (or ``prompt``'s)."""
        return self.lookup_explained(hashes, prompt_tokens, min_tokens, prompt, salt).hit

    def lookup_explained(
        self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int = 0,
        prompt: PromptTokens | None = None, salt: str | None = None,
    ) -> LookupResult:
        """The hit, and why it is shorter than the longest prefix when it is (counted by reason).

        Two round trips whatever the prompt length (records, then objects; one on a network
        store where the objects are few), and work linear in the prompt. For layouts with
        state, each round trip also asks for the KV block and the state just past the longest
        published boundary, so that a miss says whether the prefix's KV was stored further
        while no exact state was kept there."""
        salts = None if salt is None else [salt]
        return self.lookup_many([(hashes, prompt_tokens, min_tokens)], prompts=[prompt], salts=salts)[0]

    def lookup_many(self, asks: Sequence[tuple[Sequence[bytes], int, int]],
                    touch_later: list[Touch] | None = None,
                    prompts: Sequence[PromptTokens | None] | None = None,
                    salts: Sequence[str | None] | None = None,
                    read_from: Sequence[int | None] | None = None) -> list[LookupResult]:
        """``lookup_explained`` for several prompts, (hashes, prompt tokens, min tokens) each,
        in the round trips of one: each round trip touches the keys of every lookup still
        going, so lookups that arrive together over a slow store cost two round trips, not two
        each (one, where the objects of every candidate were checked beside the records).

        A lookup answered from that first round trip still touches what its hit uses, in a
        further call: made before this returns, or, with ``touch_later``, appended to it for
        the caller to make after it has used the answers (``touch``).

        ``salts``: each ask's cache salt (its tenant), where it has no prompt to say it; an ask
        with a prompt takes its prompt's (``extra.cache_salt``), and a salt given must agree.
        ``read_from``: where each ask's load would start, where its hit's objects are to be read
        in the lookup's round trips where the store allows (``LookupResult.prefetched``)."""
        later: list[Touch] = []
        full = [(h, n, m, prompts[i] if prompts is not None else None,
                 read_from[i] if read_from is not None else None) for i, (h, n, m) in enumerate(asks)]
        keys = []
        for i, (*_, prompt, _) in enumerate(full):
            salt = salts[i] if salts is not None else None
            if prompt is not None:
                if salts is not None and salt != prompt.extra.cache_salt:
                    raise ValueError("a lookup's salt and its prompt's cache salt differ")
                salt = prompt.extra.cache_salt
            keys.append(self.tenants.get(salt))
        results = self._hits.answer(full, later, keys)
        if touch_later is not None:
            touch_later += later
        else:
            self.touch(later)
        return results

    def touch(self, touches: Sequence[Touch], refresh_deny: bool = True) -> None:
        """Touch what lookups answered early use (then, with ``refresh_deny``, read the
        deny-list when it is due: on the thread that looks up)."""
        self._hits.touch(touches, refresh_deny)

    # -- load (``loading``) ----------------------------------------------------------------------

    def load(self, refs: Sequence[ObjectRef], staging: np.ndarray | None = None,
             borrow: bool = True, stored: bool = False,
             prefetched: Mapping[str, bytes] | None = None) -> Loaded:
        """Fetch and verify objects; bad ones are counted and reported, and removed from the
        store where they are wrong again when read once more. With ``borrow``, payloads may be
        views of memory the store lent: use them before the next call on the same store.
        ``stored``: keep the objects as stored too (``Loaded.objects``), where a key would
        otherwise decrypt them in place. ``prefetched``: objects a lookup read already
        (``LookupResult.prefetched``), taken from there."""
        return self._loader.load(refs, staging, borrow, stored, prefetched)

    def open_sealed(self, ref: ObjectRef, data: memoryview) -> memoryview:
        """The payload of ``ref``'s object handed over whole (header included, as stored),
        verified by the rules of every read; ``IntegrityError`` if it does not verify."""
        return self._loader.open_sealed(ref, data)

    # -- bytes proved wrong (``quarantine``, ``denysync``) ---------------------------------------

    def quarantine(self, record_key: str, salt: str | None = None) -> list[str]:
        """Take out a boundary proved wrong (``watch``): its record and the states at its
        boundary are listed in the deny-list, then removed, and its segment's KV blocks removed
        unlisted (``quarantine``). ``salt``: the cache salt of the request whose sample proved it
        wrong (its tenant's key reads its record). Returns the keys removed."""
        return self._quarantine.take_out(record_key, self.tenants.get(salt), salt)

    def deny_key(self) -> str:
        return self._deny.store_key()

    def deny_objects(self, digests: Sequence[tuple[str, bytes]], ttl: float = DENY_TTL_S) -> None:
        """List (key, content digest) pairs as proved wrong, and store the list at once."""
        self._deny.add(digests, ttl)

    def refresh_deny(self, force: bool = False) -> None:
        """Read the stored deny-list when it is due (every ``DENY_REFRESH_S``)."""
        self._deny.refresh(force)
