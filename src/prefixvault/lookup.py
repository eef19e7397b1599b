"""Lookups: the longest boundary a prompt may resume from, and why it is not longer
(invariant 2: a hit is only what is published and still complete).

Records first, then an existence check of every object the published candidates need, in two
batched round trips whatever the prompt length, in time linear in the prompt; on a network
store, where the objects of every candidate are few, they are checked beside the records, and
a hit is answered after one round trip (its objects are touched afterwards). A hit's record is
read only where the deny-list names it: a replayed copy of a quarantined record is refused,
removed, and the lookup answers again from what is left. Every object is verified where it is
loaded, so junk at a record key costs a load that fails, never wrong bytes.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from prefixvault.boundary import choose_hit, max_resume_tokens, needed_blocks
from prefixvault.codec import IntegrityError, decode
from prefixvault.counters import Counters
from prefixvault.coverage import Coverage
from prefixvault.denysync import DenySync
from prefixvault.keys import KeySpace
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.records import BoundaryRecord
from prefixvault.stored_layout import StoredLayout
from prefixvault.stores.base import Store
from prefixvault.tenancy import NamespaceKey

#: On a network store (``Store.remote``) a lookup checks the objects of every candidate
#: boundary beside the records (one round trip instead of two) when they are at most this many
#: keys: the extra keys a miss then checks cost less than a second round trip.
SPECULATIVE_KEYS = 512

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


@dataclass(frozen=True)
class LookupResult:
    hit: int  # tokens of the boundary to restore, 0 if none
    longest: int  # the longest block-aligned prefix that leaves a token to compute
    miss: Miss | None  # why ``hit < longest``; None when it is not


@dataclass(eq=False)
class HitFinder:
    """Answers lookups for one namespace and layout (``keys``) of ``store``; the vault's
    lookup, load and save threads share its counters and deny-list."""

    store: Store
    layout: CacheLayout
    keys: KeySpace
    key: NamespaceKey | None
    counters: Counters  # lookup_asks, found_tokens, misses; refused records (``rejected``)
    deny: DenySync
    stored_layout: StoredLayout

    def answer(self, asks: Sequence[tuple[Sequence[bytes], int, int]],
               later: list[Touch]) -> list[LookupResult]:
        """The results of several lookups, (hashes, prompt tokens, min tokens) each, in the round
        trips of one; what those answered from their first round trip still have to touch is
        appended to ``later`` (``touch``)."""
        return self._verified(asks, self._lookup_rounds(asks, later), later)

    def touch(self, touches: Sequence[Touch]) -> None:
        """Touch what lookups answered early use, all in one call (order kept); and, once the
        answers are out, read the deny-list when it is due (a lookup never waits for it)."""
        keys = [k for ks, _ in touches for k in ks]
        if keys:
            self.store.touch_many(keys, [t for _, ts in touches for t in ts])
        self.deny.refresh()

    def _lookup_rounds(self, asks: Sequence[tuple[Sequence[bytes], int, int]],
                       later: list[Touch]) -> list[LookupResult]:
        """The lookups' round trips, all asks together (their hits not yet verified)."""
        steps = [self._lookup_steps(h, n, m, later) for h, n, m in asks]
        results: list[LookupResult | None] = [None] * len(steps)
        pending: dict[int, tuple[list[str], list[bool]]] = {}
        for i, step in enumerate(steps):
            try:
                pending[i] = next(step)
            except StopIteration as done:
                results[i] = done.value
        while pending:
            order = list(pending.items())
            flags = self.store.touch_many([k for _, (keys, _) in order for k in keys],
                                          [t for _, (_, touch) in order for t in touch])
            pending, pos = {}, 0
            for i, (keys, _) in order:
                got = flags[pos : pos + len(keys)]
                pos += len(keys)
                try:
                    pending[i] = steps[i].send(got)
                except StopIteration as done:
                    results[i] = done.value
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _verified(self, asks: Sequence[tuple[Sequence[bytes], int, int]], results: list[LookupResult],
                  later: list[Touch]) -> list[LookupResult]:
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
            names = {i: self.keys.record(asks[i][0][results[i].hit // bs - 1]) for i in hits}
            listed = [i for i in hits if self.deny.listed(names[i])]
            if not listed:
                break
            unique = list(dict.fromkeys(names[i] for i in listed))
            blobs = dict(zip(unique, self.store.get_many(unique), strict=True))
            bad: dict[str, bool] = {}  # record key -> whether to remove it
            for i in listed:
                why = self._record_problem(names[i], blobs[names[i]], asks[i][0], results[i].hit)
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
            for i, r in zip(redo, self._lookup_rounds([asks[i] for i in redo], later), strict=True):
                results[i] = r
        return results

    def _record_problem(self, name: str, blob: bytes | None, hashes: Sequence[bytes], hit: int) -> str | None:
        """Why the record ``blob`` stored at ``name`` cannot publish boundary ``hit`` of
        ``hashes`` (None: it can)."""
        if blob is None:
            return "gone"  # removed since the existence check: evicted, or quarantined
        try:
            record = BoundaryRecord.decode(blob, self.keys.fingerprint, self.key)
            if self.deny.listed(name):
                header, body = decode(blob, key=self.key)
                if self.deny.denied(name, header, body):
                    return "denied"
        except IntegrityError as e:
            return e.reason
        bs = self.layout.block_size
        if record.tokens != hit or record.boundary_hash != hashes[hit // bs - 1] or record.block_size != bs:
            return "identity"
        return None

    def _uncount(self, result: LookupResult) -> None:
        self.counters.add(lookup_asks=-1)
        self.counters.add(found_tokens=-result.hit)
        if result.miss is not None:
            self.counters.tally("misses", result.miss.value, -1)

    def _lookup_steps(
        self, hashes: Sequence[bytes], prompt_tokens: int, min_tokens: int, later: list[Touch]
    ) -> Generator[tuple[list[str], list[bool]], list[bool], LookupResult]:
        """One lookup as the keys it checks, round trip by round trip (``_lookup_rounds`` sends
        each answer back); returns its result.

        What it touches (keeps fresh for the store's eviction) and in which order: the
        layout, the records, then the KV blocks from the first on, so a chain ages from its
        tail. Of the states, only the one at the longest published boundary (the hit, unless
        an object of it is gone) is touched: a state the hit passes over ages (a
        conversation's earlier turns, once a later one is stored). Probes past the hit are
        only checked.

        On a network store, where every candidate's objects are at most ``SPECULATIVE_KEYS``
        keys, they are checked (not touched) in the first round trip, the answer comes from it,
        and the second round trip's touches go to ``later`` instead."""
        self.counters.add(lookup_asks=1)
        bs = self.layout.block_size
        limit = min(max_resume_tokens(prompt_tokens, bs), len(hashes) * bs)
        candidates = range(limit, min_tokens, -bs)
        if not candidates:
            return self._result(0, limit, Miss.LOCAL_HIT if limit else Miss.SHORT_PROMPT)
        hexes = [h.hex() for h in hashes[: limit // bs]]
        rprefix = self.keys.record_prefix()
        # Records from the shortest boundary on (the tail of a chain ages first).
        record_keys = [rprefix + hexes[b // bs - 1] for b in reversed(candidates)]
        probes = self._probes(hexes[0])  # past boundary 0: the first block
        # Every object of every candidate, when they are few (a superset of what the second
        # round trip would check: its probes included).
        every = self._wanted(candidates)
        checked = self.store.remote and sum(len(idx) for *_, idx in every) <= SPECULATIVE_KEYS
        speculative = [k for k in dict.fromkeys(prefix + hexes[i] for _, _, prefix, idx in every for i in idx)
                       if k not in probes] if checked else []
        first = [self.keys.layout(), *record_keys, *probes]
        exists = yield ([*first, *speculative], [True] * (1 + len(record_keys)) + [False] * (
            len(probes) + len(speculative)))
        known = dict(zip([*probes, *speculative], exists[len(first) - len(probes):], strict=True)) \
            if checked else {}
        exists = exists[: len(first)]
        published = [b for b, e in zip(reversed(candidates), exists[1 : 1 + len(candidates)], strict=True)
                     if e][::-1]
        if published and not exists[0]:
            self.stored_layout.keep(present=False)  # evicted or removed: write it again (rare)
        if not published:
            return self._result(0, limit, self._past_hit(probes, exists[len(exists) - len(probes):]))
        top = published[0] // bs
        # Per (group, rank): the block (or state) indices to check.
        wanted = self._wanted(published)
        keys = [prefix + hexes[i] for _, _, prefix, idx in wanted for i in idx]
        # Sent in chain order (each index's blocks, then the state at its end), blocks touched.
        chain = np.concatenate([2 * np.asarray(idx, dtype=np.int64) + self.layout.groups[gi].is_state
                                for gi, _, _, idx in wanted]) if wanted else np.zeros(0, np.int64)
        order = np.argsort(chain, kind="stable")
        ranked = chain[order]
        probes = self._probes(hexes[top]) if top * bs < limit else []  # past the top published
        asked = [keys[j] for j in order.tolist()] + probes
        touched = ((ranked % 2 == 0) | (ranked == 2 * top - 1)).tolist() + [False] * len(probes)
        if checked and all(k in known for k in asked):
            sent = [known[k] for k in asked]
            later.append(([k for k, t in zip(asked, touched, strict=True) if t], [True] * sum(touched)))
        else:
            sent = yield (asked, touched)
        unsorted = np.empty(len(keys), dtype=bool)
        unsorted[order] = sent[: len(keys)]
        flags = unsorted.tolist()
        probed = sent[len(keys) :]
        answers: list[tuple[int, int, Sequence[int], Sequence[bool]]] = []
        pos = 0
        for gi, rank, _, idx in wanted:
            answers.append((gi, rank, idx, flags[pos : pos + len(idx)]))
            pos += len(idx)
        coverage = Coverage.from_flags(self.layout, answers)
        hit = choose_hit(published, prompt_tokens, bs, coverage.resumable)
        self.counters.add(found_tokens=hit)
        if hit == limit:
            return self._result(hit, limit, None)
        if hit < published[0]:  # the longest published boundary cannot resume any more
            return self._result(hit, limit, Miss.EVICTED)
        return self._result(hit, limit, self._past_hit(probes, probed))

    def _wanted(self, boundaries: Sequence[int]) -> list[tuple[int, int, str, range | list[int]]]:
        """Per (group, rank): its key prefix and the block (or state) indices that restoring
        any of ``boundaries`` (tokens, longest first) needs."""
        bs = self.layout.block_size
        top, low = boundaries[0] // bs, boundaries[-1] // bs
        wanted: list[tuple[int, int, str, range | list[int]]] = []
        for rank in range(self.layout.world_size):
            for gi, group in enumerate(self.layout.groups):
                if group.is_state:  # (a range of boundaries gives a range: counted for free)
                    states = range(top - 1, low - 2, -1) if isinstance(boundaries, range) and \
                        boundaries.step == -bs else [b // bs - 1 for b in boundaries]
                    wanted.append((gi, rank, self.keys.state_prefix(gi, rank), states))
                else:
                    first = needed_blocks(group, low * bs, bs).start
                    wanted.append((gi, rank, self.keys.block_prefix(gi, rank), range(first, top)))
        return wanted

    def _probes(self, block_hex: str) -> list[str]:
        """For layouts with state: a KV block of a full-attention group, and the state at the
        end of that block (rank 0)."""
        attn = next((i for i, g in enumerate(self.layout.groups) if g.kind is GroupKind.FULL_ATTENTION), None)
        state = next((i for i, g in enumerate(self.layout.groups) if g.is_state), None)
        if attn is None or state is None:
            return []
        return [self.keys.block_prefix(attn, 0) + block_hex, self.keys.state_prefix(state, 0) + block_hex]

    @staticmethod
    def _past_hit(probes: list[str], found: Sequence[bool]) -> Miss:
        """The KV block past the hit is stored but no state at its end: a state is missing."""
        return Miss.NO_STATE if probes and found[0] and not found[1] else Miss.NO_RECORD

    def _result(self, hit: int, longest: int, miss: Miss | None) -> LookupResult:
        if miss is not None:
            self.counters.tally("misses", miss.value, 1)
        return LookupResult(hit, longest, miss)
