"""Lookups: the longest boundary a prompt may resume from, and why it is not longer
(invariant 2: a hit is only what is published and still complete).

Records first, then an existence check of every object the published candidates need, in two
batched round trips whatever the prompt length, in time linear in the prompt; on a network
store, where the objects of every candidate are few, they are checked beside the records, and
a hit is answered after one round trip (its objects are touched afterwards). For layouts with
state, the first round trip also reads the tail index of every block boundary in range
(``tails``, ``Store.touch_and_get``: one round trip on Redis, Valkey and Mooncake), and the deepest tails
listed that the prompt reaches are checked beside the other candidates' objects: a second round
trip only where the prompt has such a tail. A hit's record is
read only where the deny-list names it: a replayed copy of a quarantined record is refused,
removed, and the lookup answers again from what is left. Every object is verified where it is
loaded, so junk at a record key costs a load that fails, never wrong bytes. Each lookup
names, and reads, what it asks with its own tenant's key (its prompt's cache salt,
``tenancy``): a lookup of another tenant's prompt names other keys, and finds nothing.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from prefixvault.boundary import choose_hit, max_resume_tokens, needed_blocks, resume_limit
from prefixvault.codec import HEADER_SIZE, IntegrityError, decode
from prefixvault.counters import Counters
from prefixvault.coverage import Coverage
from prefixvault.denysync import DenySync
from prefixvault.keys import KeySpace, PromptTokens
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.records import BoundaryRecord
from prefixvault.stored_layout import StoredLayout
from prefixvault.stores.base import Store
from prefixvault.tails import TAIL_CANDIDATES, TailIndex
from prefixvault.tenancy import NamespaceKey

#: On a network store (``Store.remote``) a lookup checks the objects of every candidate
#: boundary beside the records (one round trip instead of two) when they are at most this many
#: keys: the extra keys a miss then checks cost less than a second round trip.
SPECULATIVE_KEYS = 512

#: A lookup that will read its hit's objects (``Ask``'s ``read_from``) reads them in its first round
#: trip where the store pipelines (``Store.pipelines``) and every candidate's objects it would read
#: are at most this many bytes: those of candidates past the hit are read for nothing, and cost
#: less than a round trip more.
PREFETCH_BYTES = 32 << 20

def _within_prefetch(keys: list[str], size: int) -> list[str]:
    """``keys`` (once each) where ``size``, the bytes a lookup's reads come to, is within
    ``PREFETCH_BYTES``; else none: past it the bytes cost more than the round trip saved."""
    return list(dict.fromkeys(keys)) if size <= PREFETCH_BYTES else []


#: A lookup whose hit's record does not verify answers again from what is left, at most this
#: many times (each bad record is removed first), then reports a miss.
RECORD_RETRIES = 3

#: Keys to touch after a lookup answered, and which of them (``Store.touch_many``'s arguments).
Touch = tuple[list[str], list[bool]]


class Miss(StrEnum):
    """Why a lookup restored less than the longest block-aligned prefix it could have."""

    SHORT_PROMPT = "short_prompt"  # no block-aligned prefix leaves a prompt token to compute
    LOCAL_HIT = "local_hit"  # the engine's own cache already holds the longest one
    NO_RECORD = "no_record"  # nothing published there (for this layout, namespace and salt)
    NO_STATE = "no_state"  # KV blocks are stored past the hit, but no exact state was kept there
    EVICTED = "evicted"  # published, but objects it needs are gone from the store
    STORE_ERROR = "store_error"  # the store failed during the lookup
    BREAKER_OPEN = "breaker_open"  # the store failed too often lately and was not called
    LOOKUP_TIMEOUT = "lookup_timeout"  # the lookup took longer than the connector's lookup_timeout
    INTERNAL_ERROR = "internal_error"  # an error of prefixvault's own (a bug: logged with its traceback)
    BUSY = "busy"  # the connector's lookup queue was full, or it was shutting down: not looked up
    WORKER_OFF = "worker_off"  # a worker of the engine went off (its caches unusable): no hit is offered
    RESET = "reset"  # running when the engine's cache was reset (new weights): restores nothing more
    # restoring would end later than computing (``costs``: the store's round trips and transfer
    # against the engine's prefill, as measured); not looked up, or its hit not loaded
    NOT_WORTH_IT = "not_worth_it"


@dataclass(frozen=True)
class LookupResult:
    hit: int  # tokens of the boundary to restore, 0 if none
    longest: int  # the longest block-aligned prefix that leaves a token to compute
    miss: Miss | None  # why ``hit < longest``; None when it is not (a tail hit may pass it)
    boundary_hash: bytes = field(default=b"", compare=False)  # the hit's name (chain or tail hash)
    # The block-aligned boundaries past the tokens the engine has that the store holds whole
    # (every object resuming there needs), the longest first: a caller that would rather resume
    # at a shallower one (a junction: ``vllm/lookups.py``) may, and knows it can.
    resumable: tuple[int, ...] = field(default=(), compare=False)
    # The hit was cut to the request's junction (``resumable`` names the longer one).
    at_junction: bool = field(default=False, compare=False)
    # Objects read in the lookup's round trips (rank 0, as stored, by key; ``PREFETCH_BYTES``):
    # a load of the hit takes them from here instead of the store (verified there, as any read).
    prefetched: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)


#: One lookup: the prompt's chain hashes (full blocks), its length, the tokens the engine has,
#: its tokens and extra keys where its tail boundaries are looked up too (None: not), and where
#: a load of its hit would start, where its objects are to be read in the lookup (None: not).
Ask = tuple[Sequence[bytes], int, int, PromptTokens | None, int | None]
#: What one round trip of a lookup asks: keys to check, whether each counts as used, and keys to
#: read (``Store.touch_and_get``); it is answered with whether each exists, and what each read holds.
Round = tuple[list[str], list[bool], list[str]]
Reply = tuple[list[bool], list[bytes | None]]


@dataclass(eq=False)
class HitFinder:
    """Answers lookups for one namespace and layout (``keys``) of ``store``; the vault's
    lookup, load and save threads share its counters and deny-list."""

    store: Store
    layout: CacheLayout
    keys: KeySpace
    counters: Counters  # lookup_asks, found_tokens, misses; refused records (``rejected``)
    deny: DenySync
    stored_layout: StoredLayout

    def answer(self, asks: Sequence[Ask], later: list[Touch],
               sealers: Sequence[NamespaceKey | None]) -> list[LookupResult]:
        """The results of several lookups (``Ask``) in the round trips of one; what those
        answered from their first round trip still have to touch is appended to ``later``.
        ``sealers``: each ask's tenant's key (what its hashes were keyed with)."""
        return self._verified(asks, self._lookup_rounds(asks, later, sealers), later, sealers)

    def touch(self, touches: Sequence[Touch], refresh_deny: bool = True) -> None:
        """Touch what lookups answered early use, all in one call (order kept); and, once the
        answers are out, with ``refresh_deny``, read the deny-list when it is due (a lookup
        never waits for it)."""
        keys = [k for ks, _ in touches for k in ks]
        if keys:
            self.store.touch_many(keys, [t for _, ts in touches for t in ts])
        if refresh_deny:
            self.deny.refresh()

    def _lookup_rounds(self, asks: Sequence[Ask], later: list[Touch],
                       sealers: Sequence[NamespaceKey | None]) -> list[LookupResult]:
        """The lookups' round trips, all asks together (their hits not yet verified): in each,
        one store call for every lookup still going (what each checks, and what each reads)."""
        prefetched: list[dict[str, bytes]] = [{} for _ in asks]
        expected: dict[str, int] = {}  # the size of each object a round trip reads, where known
        steps = [self._lookup_steps(h, n, m, later, p, k, r, read, expected)
                 for (h, n, m, p, r), k, read in zip(asks, sealers, prefetched, strict=True)]
        results: list[LookupResult | None] = [None] * len(steps)
        pending: dict[int, Round] = {}
        for i, step in enumerate(steps):
            try:
                pending[i] = next(step)
            except StopIteration as done:
                results[i] = done.value
        while pending:
            every = [k for keys, _, _ in pending.values() for k in keys]
            marks = [t for _, touch, _ in pending.values() for t in touch]
            reads = [k for _, _, read in pending.values() for k in read]
            found, blobs = (self.store.touch_and_get(every, marks, reads, [expected.get(k, 0) for k in reads])
                            if reads else (self.store.touch_many(every, marks), []))
            got: dict[int, Reply] = {}
            pos = at = 0
            for i, (keys, _, read) in pending.items():
                got[i] = (found[pos : pos + len(keys)], blobs[at : at + len(read)])
                pos += len(keys)
                at += len(read)
            pending = {}
            for i, answer in got.items():
                try:
                    pending[i] = steps[i].send(answer)
                except StopIteration as done:
                    results[i] = done.value
        assert all(r is not None for r in results)
        return [replace(r, prefetched=read) if read else r
                for r, read in zip(results, prefetched, strict=True) if r is not None]

    def _verified(self, asks: Sequence[Ask], results: list[LookupResult],
                  later: list[Touch], sealers: Sequence[NamespaceKey | None]) -> list[LookupResult]:
        """Refuse hits whose record is a copy of one a quarantine proved wrong. Only records the
        deny-list names are read (one batched read; none at all in the common case): a record
        is only a marker that a boundary's objects were all stored, and every object is
        verified again where it is loaded, so junk at a record key costs a load that fails,
        never wrong bytes, while reading every hit's record would add a round trip to every
        lookup over a network store. A refused record is removed and counted
        (``rejected["record ..."]``), and that lookup answers again from what is left."""
        bs = self.layout.block_size
        if not self.deny.read_once and any(r.hit for r in results):
            self.deny.refresh()  # once per vault; later reads follow the answers (``touch``)
        for attempt in range(RECORD_RETRIES + 1):
            hits = [i for i, r in enumerate(results) if r.hit]
            names = {i: self.keys.of(sealers[i]).record(results[i].boundary_hash
                                                        or asks[i][0][results[i].hit // bs - 1])
                     for i in hits}
            listed = [i for i in hits if self.deny.listed(names[i])]
            if not listed:
                break
            unique = list(dict.fromkeys(names[i] for i in listed))
            blobs = dict(zip(unique, self.store.get_many(unique), strict=True))
            bad: dict[str, bool] = {}  # record key -> whether to remove it
            for i in listed:
                named = results[i].boundary_hash or asks[i][0][results[i].hit // bs - 1]
                why = self._record_problem(names[i], blobs[names[i]], named, results[i].hit, sealers[i])
                if why is not None:
                    bad[names[i]] = why != "gone"
                    if why != "gone":
                        self.counters.tally("rejected", f"record {why}", 1)
            if not bad:
                break
            if any(bad.values()):
                self.store.delete_many([k for k, remove in bad.items() if remove])
            redo = [i for i in listed if names[i] in bad]
            for i in redo:  # answered again: counted again
                self._uncount(results[i])
            if attempt == RECORD_RETRIES:
                for i in redo:
                    results[i] = self._result(0, results[i].longest, Miss.EVICTED)
                    self.counters.add(lookup_asks=1)
                break
            again = self._lookup_rounds([asks[i] for i in redo], later, [sealers[i] for i in redo])
            for i, r in zip(redo, again, strict=True):
                results[i] = r
        return results

    def _record_problem(self, name: str, blob: bytes | None, boundary_hash: bytes, hit: int,
                        key: NamespaceKey | None) -> str | None:
        """Why the record ``blob`` stored at ``name`` cannot publish boundary ``hit`` named
        ``boundary_hash`` (None: it can)."""
        if blob is None:
            return "gone"  # removed since the existence check: evicted, or quarantined
        try:
            record = BoundaryRecord.decode(blob, self.keys.fingerprint, key)
            if self.deny.listed(name):
                header, body = decode(blob, key=key)
                if self.deny.denied(name, header, body):
                    return "denied"
        except IntegrityError as e:
            return e.reason
        bs = self.layout.block_size
        if record.tokens != hit or record.boundary_hash != boundary_hash or record.block_size != bs:
            return "identity"
        return None

    def _uncount(self, result: LookupResult) -> None:
        self.counters.add(lookup_asks=-1)
        self.counters.add(found_tokens=-result.hit)
        if result.miss is not None:
            self.counters.tally("misses", result.miss.value, -1)

    def _lookup_steps(
        self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int, later: list[Touch],
        prompt: PromptTokens | None, key: NamespaceKey | None, read_from: int | None = None,
        prefetched: dict[str, bytes] | None = None, expected: dict[str, int] | None = None,
    ) -> Generator[Round, Reply, LookupResult]:
        """One lookup as the keys it checks or reads, round trip by round trip
        (``_lookup_rounds`` sends each answer back); returns its result.

        What it touches (keeps fresh for the store's eviction) and in which order: the
        layout, the records, then the KV blocks from the first on, so a chain ages from its
        tail. Of the states, only the one at the longest published boundary (the hit, unless
        an object of it is gone) is touched: a state the hit passes over ages (a
        conversation's earlier turns, once a later one is stored). Probes past the hit are
        only checked. Tail indexes and the records and objects of the tails checked are
        touched.

        On a network store, where every candidate's objects are at most ``SPECULATIVE_KEYS``
        keys, they are checked (not touched) in the first round trip, the answer comes from it,
        and the second round trip's touches go to ``later`` instead (unless the indexes list a
        tail of this prompt: its objects are then checked in a second round trip). There, with
        ``read_from`` on a store that pipelines, the objects of rank 0 that a load from
        ``read_from`` to any candidate reads are read rather than checked, where they are at most
        ``PREFETCH_BYTES``, into ``prefetched``; and those of the deepest tail of this prompt in
        the second round trip, which checks them (``_prefetch_tail``)."""
        self.counters.add(lookup_asks=1)
        bs = self.layout.block_size
        limit = min(max_resume_tokens(prompt_tokens, bs), len(hashes) * bs)
        candidates = range(limit, min_tokens, -bs)
        # Tail boundaries past every block boundary in range, up to one token short of the prompt.
        tail_limit = min(resume_limit(prompt_tokens), len(prompt.tokens)) \
            if prompt is not None and self.layout.has_state else 0
        index_ks = range(min_tokens // bs, (tail_limit - 1) // bs + 1 if tail_limit > min_tokens else 0)
        if not candidates and not index_ks:
            return self._result(0, limit, Miss.LOCAL_HIT if limit else Miss.SHORT_PROMPT)
        seed = prompt.extra.seed(key.hash_key if key is not None else b"") if prompt else b""
        parents = [hashes[k - 1] if k else seed for k in index_ks]
        hexes = [h.hex() for h in hashes[: max(limit, tail_limit) // bs]]
        space = self.keys.of(key)  # (its tenant's namespace, with ``tenant_namespaces``)
        rprefix = space.record_prefix()
        # Records from the shortest boundary on (the tail of a chain ages first).
        record_keys = [rprefix + hexes[b // bs - 1] for b in reversed(candidates)]
        probes = self._probes(space, hexes[0]) if hexes else []  # past boundary 0: the first block
        # Every object of every candidate, when they are few (a superset of what the second
        # round trip would check: its probes included).
        every = self._wanted(space, candidates) if candidates else []
        checked = self.store.remote and bool(every) and sum(len(idx) for *_, idx in every) <= SPECULATIVE_KEYS
        speculative = [k for k in dict.fromkeys(prefix + hexes[i] for _, _, prefix, idx in every for i in idx)
                       if k not in probes] if checked else []
        # (where the store pipelines, a lookup that will read its hit's objects reads them here)
        prefetch = prefetched if read_from is not None and self.store.pipelines else None
        sized = expected if expected is not None else {}
        reads = self._prefetch(every, hexes, read_from, sized) \
            if checked and read_from is not None and prefetch is not None else []
        if reads:
            kept = set(reads)
            speculative = [k for k in speculative if k not in kept]
        index_keys = [space.tail_index(p) for p in parents]
        first = [space.layout(), *record_keys, *probes]
        # The tail indexes are read in the same round trip: on a network store one wait, not two.
        marks = [True] * (1 + len(record_keys)) + [False] * (len(probes) + len(speculative)) \
            + [True] * len(index_keys)
        exists, blobs = yield ([*first, *speculative, *index_keys], marks, [*index_keys, *reads])
        index_blobs, read = blobs[: len(index_keys)], blobs[len(index_keys) :]
        ahead = exists[len(first) - len(probes) : len(first) + len(speculative)]
        known = dict(zip([*probes, *speculative], ahead, strict=True)) if checked else {}
        for k, blob in zip(reads, read, strict=True):  # (a probe read too: its check stands)
            known.setdefault(k, blob is not None)
            if blob is not None and prefetch is not None:
                prefetch[k] = blob
        index_found = exists[len(first) + len(speculative) :]
        indexed = [(k, p, blob)
                   for k, p, e, blob in zip(index_ks, parents, index_found, index_blobs, strict=True) if e]
        exists = exists[: len(first)]
        published = [b for b, e in zip(reversed(candidates), exists[1 : 1 + len(candidates)], strict=True)
                     if e][::-1]
        if (published or indexed) and not exists[0]:
            self.stored_layout.keep(present=False)  # evicted or removed: write it again (rare)
        missed = self._past_hit(probes, exists[len(exists) - len(probes) :])
        tails: list[tuple[int, bytes]] = []  # (tokens, tail hash), the deepest first
        if indexed and prompt is not None:
            tails = self._tails(indexed, prompt, min_tokens, tail_limit, key)
        if not published and not tails:
            return self._result(0, limit, missed)
        top = published[0] // bs if published else 0
        # Per (group, rank): the block (or state) indices to check; the full blocks of every tail too.
        low = min([*published, *(t for t, _ in tails)])
        wanted = self._wanted(space, published, max([top, *(t // bs for t, _ in tails)]), low)
        keys = [prefix + hexes[i] for _, _, prefix, idx in wanted for i in idx]
        # Sent in chain order (each index's blocks, then the state at its end), blocks touched.
        chain = np.concatenate([2 * np.asarray(idx, dtype=np.int64) + self.layout.groups[gi].is_state
                                for gi, _, _, idx in wanted]) if wanted else np.zeros(0, np.int64)
        order = np.argsort(chain, kind="stable")
        ranked = chain[order]
        tail_keys = [k for t, h in tails for k in self._tail_keys(space, t, h)]
        probes = self._probes(space, hexes[top]) if published and top * bs < limit else []  # past the top
        asked = [keys[j] for j in order.tolist()] + tail_keys + probes
        touched = ((ranked % 2 == 0) | (ranked == 2 * top - 1)).tolist() + [True] * len(tail_keys) \
            + [False] * len(probes)
        if checked and all(k in known for k in asked):
            sent = [known[k] for k in asked]
            later.append(([k for k, t in zip(asked, touched, strict=True) if t], [True] * sum(touched)))
        else:
            # A tail's objects are named only now: read those of the deepest in this round trip
            # too, as the first one reads a block boundary's.
            reads = self._prefetch_tail(space, tails[0], hexes, read_from, prefetch, sized) \
                if tails and read_from is not None and prefetch is not None else []
            sent, read = yield (asked, touched, reads)
            for k, blob in zip(reads, read, strict=True):
                if blob is not None and prefetch is not None:
                    prefetch[k] = blob
        unsorted = np.empty(len(keys), dtype=bool)
        unsorted[order] = sent[: len(keys)]
        flags = unsorted.tolist()
        tail_flags = sent[len(keys) : len(keys) + len(tail_keys)]
        probed = sent[len(keys) + len(tail_keys) :]
        answers: list[tuple[int, int, Sequence[int], Sequence[bool]]] = []
        pos = 0
        for gi, rank, _, idx in wanted:
            answers.append((gi, rank, idx, flags[pos : pos + len(idx)]))
            pos += len(idx)
        coverage = Coverage.from_flags(self.layout, answers)
        hit = choose_hit(published, prompt_tokens, bs, coverage.resumable) if published else 0
        name = hashes[hit // bs - 1] if hit else b""
        pos, per_tail = 0, len(tail_keys) // len(tails) if tails else 0
        for t, h in tails:  # the deepest first: the first that resumes is the best
            if t > hit and all(tail_flags[pos : pos + per_tail]) and coverage.full_blocks_present(t):
                hit, name = t, h
                break
            pos += per_tail
        self.counters.add(found_tokens=hit)
        whole = tuple(b for b in published if coverage.resumable(b))
        if hit >= limit:
            return self._result(hit, limit, None, name, whole)
        if published and hit < published[0]:  # the longest published boundary cannot resume any more
            return self._result(hit, limit, Miss.EVICTED, name, whole)
        return self._result(hit, limit, self._past_hit(probes, probed) if published else missed, name, whole)

    def _prefetch(self, every: Sequence[tuple[int, int, str, range | list[int]]], hexes: Sequence[str],
                  read_from: int, sizes: dict[str, int]) -> list[str]:
        """Of every candidate's objects (``_wanted``), the keys of those of rank 0 that a load from
        ``read_from`` to any candidate reads (KV blocks from ``read_from``'s block on, states past
        it); none where they could be more than ``PREFETCH_BYTES``. Each one's size goes into
        ``sizes``."""
        first = read_from // self.layout.block_size
        keys: list[str] = []
        size = 0
        for gi, rank, prefix, idx in every:
            if rank:
                continue
            each = HEADER_SIZE + self.layout.groups[gi].nbytes(0)
            for i in idx:
                if i >= first:
                    keys.append(prefix + hexes[i])
                    sizes[keys[-1]] = each
                    size += each
        return _within_prefetch(keys, size)

    def _prefetch_tail(self, space: KeySpace, tail: tuple[int, bytes], hexes: Sequence[str], read_from: int,
                       prefetched: Mapping[str, bytes], sizes: dict[str, int]) -> list[str]:
        """The keys of the objects of rank 0 that a load from ``read_from`` to ``tail`` (tokens,
        tail hash) reads and the first round trip did not: its full KV blocks from
        ``read_from``'s block on, its partly filled block and its state; none where, with what
        was read already, they could be more than ``PREFETCH_BYTES``."""
        tokens, name = tail
        bs = self.layout.block_size
        size = sum(len(b) for b in prefetched.values())
        keys: list[str] = []
        for gi, group in enumerate(self.layout.groups):
            each = HEADER_SIZE + group.nbytes(0)
            if group.is_state:
                named = [space.state(gi, 0, name)]
            else:
                blocks = needed_blocks(group, tokens, bs)
                full = range(max(blocks.start, read_from // bs), min(blocks.stop, tokens // bs))
                named = [space.block_prefix(gi, 0) + hexes[i] for i in full]
                if tokens % bs and blocks:
                    named.append(space.block(gi, 0, name))
            for k in named:
                if k not in prefetched:
                    keys.append(k)
                    sizes[k] = each
                    size += each
        return _within_prefetch(keys, size)

    def _tails(self, indexed: Sequence[tuple[int, bytes, bytes | None]],
               prompt: PromptTokens, min_tokens: int, tail_limit: int,
               key: NamespaceKey | None) -> list[tuple[int, bytes]]:
        """The tail boundaries the indexes read (block boundary, its chain hash, the index's
        bytes) list that are this prompt's (the tail hash its tokens give at that length), the
        ``TAIL_CANDIDATES`` deepest. An index that does not verify lists none."""
        bs = self.layout.block_size
        found: set[tuple[int, bytes]] = set()
        for k, parent, blob in indexed:
            if blob is None:
                continue
            try:
                index = TailIndex.decode(blob, self.keys.fingerprint, parent, bs, key)
            except IntegrityError as e:
                self.counters.tally("rejected", f"tail index {e.reason}", 1)
                continue
            for past, name in index.tails:
                t = k * bs + past
                if min_tokens < t <= tail_limit and prompt.tail(parent, k * bs, t) == name:
                    found.add((t, name))
        return sorted(found, reverse=True)[:TAIL_CANDIDATES]

    def _tail_keys(self, space: KeySpace, tokens: int, name: bytes) -> list[str]:
        """What a tail boundary needs beyond its full blocks: its record, and per rank its partly
        filled block in every attention group and its state in every state group."""
        keys = [space.record(name)]
        for rank in range(self.layout.world_size):
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:
                    keys.append(space.state(gi, rank, name))
                elif needed_blocks(group, tokens, self.layout.block_size):
                    keys.append(space.block(gi, rank, name))
        return keys

    def _wanted(self, space: KeySpace, boundaries: Sequence[int], top: int | None = None,
                low: int | None = None) -> list[tuple[int, int, str, range | list[int]]]:
        """Per (group, rank): its key prefix and the block (or state) indices that restoring
        any of ``boundaries`` (block-aligned tokens, longest first) needs; KV blocks up to block
        ``top`` and from where resuming at ``low`` tokens needs them, where given (the full
        blocks of tail boundaries)."""
        bs = self.layout.block_size
        top = boundaries[0] // bs if top is None else top
        low = boundaries[-1] if low is None else low
        wanted: list[tuple[int, int, str, range | list[int]]] = []
        for rank in range(self.layout.world_size):
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:  # (a range of boundaries gives a range: counted for free)
                    if isinstance(boundaries, range) and boundaries.step == -bs:
                        first_state, last_state = boundaries[0] // bs - 1, boundaries[-1] // bs - 1
                        states: range | list[int] = range(first_state, last_state - 1, -1)
                    else:
                        states = [b // bs - 1 for b in boundaries]
                    wanted.append((gi, rank, space.state_prefix(gi, rank), states))
                else:
                    first = needed_blocks(group, low, bs).start
                    wanted.append((gi, rank, space.block_prefix(gi, rank), range(first, top)))
        return wanted

    def _probes(self, space: KeySpace, block_hex: str) -> list[str]:
        """For layouts with state: a KV block of a full-attention group, and the state at the
        end of that block (rank 0)."""
        attn = next((i for i, g in enumerate(self.layout.groups) if g.kind is GroupKind.FULL_ATTENTION), None)
        state = next((i for i, g in enumerate(self.layout.groups) if g.is_state), None)
        if attn is None or state is None:
            return []
        return [space.block_prefix(attn, 0) + block_hex, space.state_prefix(state, 0) + block_hex]

    @staticmethod
    def _past_hit(probes: list[str], found: Sequence[bool]) -> Miss:
        """The KV block past the hit is stored but no state at its end: a state is missing."""
        return Miss.NO_STATE if probes and found[0] and not found[1] else Miss.NO_RECORD

    def _result(self, hit: int, longest: int, miss: Miss | None, name: bytes = b"",
                resumable: tuple[int, ...] = ()) -> LookupResult:
        if miss is not None:
            self.counters.tally("misses", miss.value, 1)
        return LookupResult(hit, longest, miss, name, resumable)
