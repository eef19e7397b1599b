"""Lookups on the lookup lane: every lookup queued by then hashed and looked up as one batch.

The scheduler hands a request's prompt over (``Lookups.submit``) and takes the answer from a
future when it is in; nothing here touches request state. A prompt naming a boundary with a
save in flight answers None (the scheduler asks again once the save settled); a store error
fails every lookup of the batch, each then a miss by the lane's reason (``LOOKUP_MISS``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace

from prefixvault.codec import HEADER_SIZE
from prefixvault.costs import RestoreCosts, restore_bytes
from prefixvault.guard import Guard
from prefixvault.keys import ExtraKeys, PromptTokens
from prefixvault.lane import Failure, Lane
from prefixvault.vault import LookupResult, Miss, ObjectRef, Touch, Vault
from prefixvault.vllm.in_step import ReadAhead, ReadAheadBudget

log = logging.getLogger("vllm.prefixvault")

#: Lookups queued or running at most; past it a request is a ``busy`` miss (computed).
LOOKUP_QUEUE = 4096
#: Junctions cut lately that are remembered at most (the oldest cut forgotten first).
CUTS_KEPT = 4096
#: Batches of touches queued or running at most; past it a batch's touches are dropped (its
#: hits' objects then age as if unused: freshness for the store's eviction, nothing else).
TOUCH_QUEUE = 64

#: What a lookup answers: the prompt's chain hashes, its result (None: held for a save), and
#: with ``read_from`` the verified payloads of every object a load of its hit needs (rank 0), or
#: None if any could not be read.
Answer = tuple[list[bytes], LookupResult | None, ReadAhead | None]


@dataclass(frozen=True, kw_only=True)
class LookupJob:
    """A lookup handed to the lookup lane (a record between threads); answered through ``future``."""

    future: Future[Answer]
    prompt: list[int]
    extra: ExtraKeys
    known: list[bytes]  # chain hashes already computed for the prompt
    num_tokens: int
    min_tokens: int  # tokens the engine has: a hit must pass them
    # Boundaries with a save in flight (the scheduler's live counter, read with ``in`` only);
    # a prompt naming one is answered None. None: not held for saves.
    saving: Counter[bytes] | None
    # Also read the objects the hit's load needs (``restore_in_step``, one rank): a load of a hit
    # past ``read_from`` (vLLM's offer, where a load may start) starts there, another from
    # ``min_tokens`` (vLLM's agreed hit, the scheduler asks again for it). None: no read ahead.
    read_from: int | None = None
    # vLLM's junction for the request (``shared_prefix_boundary``: where its prompt leaves a
    # prefix an earlier request had, the engine's own cache holding no state there; 0: none),
    # and whether its load would be synchronous (what ``RestoreCosts`` judges it by).
    junction: int = 0
    in_step: bool = False


class LaneFailed(Exception):
    """A job the lane refused or dropped (queue full, closing, past its deadline)."""

    def __init__(self, reason: Failure) -> None:
        super().__init__(f"lane {reason.value}")
        self.reason = reason


#: The miss a lookup the lane failed counts as.
LOOKUP_MISS = {Failure.STORE_ERROR: Miss.STORE_ERROR, Failure.BREAKER_OPEN: Miss.BREAKER_OPEN,
               Failure.INTERNAL_ERROR: Miss.INTERNAL_ERROR, Failure.TIMEOUT: Miss.LOOKUP_TIMEOUT,
               Failure.FULL: Miss.BUSY, Failure.CLOSED: Miss.BUSY}


class Lookups:
    def __init__(self, vault: Vault, guard: Guard, capacity: int = LOOKUP_QUEUE,
                 budget: ReadAheadBudget | None = None, costs: RestoreCosts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``budget``: bounds the bytes read ahead (``read_ahead``); None: nothing is.
        ``costs``: told how long each batch's lookup took in the store, and judges cuts at a
        junction. ``clock``: when a cut at a junction is made."""
        self.vault = vault
        self._now = clock
        self.guard = guard
        self.budget = budget
        self.costs = costs
        # One lane: the scheduler's lookups stay in order, and never run in its step.
        self.lane: Lane[LookupJob] = Lane("lookup", self._run, self._fail, capacity=capacity, guard=guard)
        # What the hits use is touched on a lane of its own: over a network store a touch is a
        # round trip, and the next batch of lookups must not queue behind it.
        self.touches: Lane[list[Touch]] = Lane("touch", self._touch, self._touch_failed, capacity=TOUCH_QUEUE,
                                               guard=guard)
        # Junctions cut lately, by chain hash: until when (``clock``) the cut is expected still
        # on its way into the engine's cache, its restore's time and a step. A request that
        # reaches the junction meanwhile finds no state there yet, and a cut of its own would
        # serve no request the first one's does not (``_at_junction``). The lookup lane's
        # alone; past ``CUTS_KEPT`` the oldest cut is forgotten.
        self._cuts: OrderedDict[bytes, float] = OrderedDict()

    def submit(self, *, prompt: list[int], extra: ExtraKeys, known: list[bytes], num_tokens: int,
               min_tokens: int, saving: Counter[bytes] | None,
               read_from: int | None = None, junction: int = 0, in_step: bool = False) -> Future[Answer]:
        """Queue a lookup (``LookupJob`` says what each argument is); it is answered with every
        lookup queued by the time the lane is free (``Vault.lookup_many``: one or two round
        trips for all of them; with ``read_from``, one more read for the objects of every hit
        that asked for them, none where the lookup's first round trip read them already)."""
        job = LookupJob(future=Future(), prompt=prompt, extra=extra, known=known, num_tokens=num_tokens,
                        min_tokens=min_tokens, saving=saving, read_from=read_from, junction=junction,
                        in_step=in_step)
        refused = self.lane.put(job)
        if refused is not None:
            job.future.set_exception(LaneFailed(refused))
        return job.future

    def close(self, timeout: float) -> bool:
        """Drop the lookups and touches queued; wait up to ``timeout`` for a running batch of
        each. Whether both lanes are idle."""
        start = time.monotonic()
        idle = self.lane.close(timeout)
        return self.touches.close(max(0.0, timeout - (time.monotonic() - start))) and idle

    def _touch(self, batch: list[list[Touch]]) -> None:
        """Touch what the hits of the lookups answered use, every batch queued by then in one call."""
        self.vault.touch([t for touches in batch for t in touches], refresh_deny=False)

    @staticmethod
    def _touch_failed(batch: list[list[Touch]], reason: Failure, error: BaseException | None) -> None:
        """The answers stand; a touch not made costs freshness only."""
        log.debug("prefixvault: touching what %d lookup batches found failed: %s", len(batch),
                  error or reason.value)

    def _fail(self, jobs: list[LookupJob], reason: Failure, error: BaseException | None) -> None:
        """Lookups the lane could not answer: each is then a miss, by ``reason``."""
        for job in jobs:
            with contextlib.suppress(InvalidStateError):  # answered, or cancelled meanwhile
                job.future.set_exception(error if error is not None else LaneFailed(reason))

    def _run(self, batch: list[LookupJob]) -> None:
        """Hash each queued prompt, then look them up together. A prompt naming a boundary in
        ``saving`` (a save in flight) answers None instead."""
        asks: list[tuple[list[bytes], int, int]] = []
        prompts: list[PromptTokens | None] = []
        waiting: list[tuple[LookupJob, list[bytes]]] = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue  # timed out or finished while queued
            try:
                hashes = self.vault.hashes(job.prompt, job.extra, job.known)
            except Exception as e:  # ours: this lookup only
                self.guard.failed("lookup", e)
                job.future.set_exception(e)
                continue
            if job.saving and any(h in job.saving for h in hashes):
                job.future.set_result((hashes, None, None))
                continue
            asks.append((hashes, job.num_tokens, job.min_tokens))
            prompts.append(PromptTokens(job.prompt, job.extra))  # (its tail boundaries too)
            waiting.append((job, hashes))
        if not asks:
            return
        touches: list[Touch] = []
        # (raises: the lane fails the batch)
        t0 = time.monotonic()
        # (salts: the prompts'; a lookup reading ahead reads its hit's objects in its round trip
        # where the store allows: ``LookupResult.prefetched``)
        reading = [job.read_from if self.budget is not None else None for job, _ in waiting]
        found = self.vault.lookup_many(asks, touch_later=touches, prompts=prompts, read_from=reading)
        if self.costs is not None:
            self.costs.looked_up(time.monotonic() - t0)
        ahead = []
        for (job, hashes), result in zip(waiting, found, strict=True):
            result = self._at_junction(job, hashes, result)
            if job.read_from is not None and result.hit > job.min_tokens:
                ahead.append((job, hashes, result))
            else:  # answered first: reading ahead for others never delays them
                job.future.set_result((hashes, result, None))
        for (job, hashes, result), payloads in zip(ahead, self._read_ahead(ahead), strict=True):
            job.future.set_result((hashes, result, payloads))
        if touches:  # answered: now keep what the hits use fresh for the store's eviction
            self.touches.put(touches)  # (refused: the answers stand, freshness is lost)
        try:  # the deny-list, read when due (a lookup never waits for it)
            self.vault.touch([])
        except Exception as e:  # the answers stand; read again at the next batch
            log.debug("prefixvault: reading the deny-list failed: %s", e)

    def _at_junction(self, job: LookupJob, hashes: list[bytes], result: LookupResult) -> LookupResult:
        """The hit cut to the request's junction where the store holds the junction whole and
        what the next request of the prefix saves by computing past it outweighs what the cut
        costs this one (``RestoreCosts.stop_at_junction``), unless a cut there is still on its
        way into the engine's cache (``_cuts``): vLLM keeps the
        state at a request's junction, so every later request of that prefix is a hit in the
        engine's own cache there, as on an engine with no store, instead of each restoring its
        own boundary from the store (the engine's cache holds the prefix's KV, no state in it).
        This request computes from the junction: what a request resuming there would do."""
        j, bs = job.junction, self.vault.layout.block_size
        if (self.costs is None or not job.min_tokens < j < result.hit or j % bs
                or j not in result.resumable):
            return result
        key, now = hashes[j // bs - 1], self._now()
        if now < self._cuts.get(key, 0.0):  # a cut there still landing (this one's too, if asked again)
            return result
        past = restore_bytes(self.vault.layout, result.hit, j)
        if not self.costs.stop_at_junction(result.hit - j, past, job.in_step):
            return result
        est = self.costs.estimates()
        landed = now + est.restore_s(restore_bytes(self.vault.layout, j, job.min_tokens), job.in_step)
        self._cuts.pop(key, None)
        self._cuts[key] = landed + (est.step_s or 0.0)
        if len(self._cuts) > CUTS_KEPT:
            self._cuts.popitem(last=False)
        if result.miss is None:  # (a lookup counts one miss: the reason it first fell short by)
            self.vault.counters.tally("misses", Miss.NOT_WORTH_IT.value)
        return replace(result, hit=j, miss=Miss.NOT_WORTH_IT, boundary_hash=key, at_junction=True)

    def _read_ahead(self, ahead: list[tuple[LookupJob, list[bytes], LookupResult]]) -> list[ReadAhead | None]:
        """For each hit, the verified objects its load needs (rank 0, from ``read_from`` or
        ``min_tokens``), in memory of their own (bytes counted in ``budget`` until the
        ``ReadAhead`` is released); None if the budget has no room for them or any could not be
        read. Every hit's objects are read in one call (one round trip to a network store).
        Best effort: the hits stand either way (their loads then read the objects themselves)."""
        out: list[ReadAhead | None] = [None] * len(ahead)
        if self.budget is None:
            return out
        bs = self.vault.layout.block_size
        wanted: list[tuple[int, list[ObjectRef], int]] = []  # (index in ahead, refs, bytes taken)
        for i, (job, hashes, result) in enumerate(ahead):
            if job.read_from is None:
                continue
            since = job.read_from if result.hit > job.read_from else job.min_tokens
            try:
                named = [*hashes[: result.hit // bs], *([result.boundary_hash] if result.hit % bs else [])]
                refs = self.vault.needed(named, result.hit, ranks=[0], since=since, salt=job.extra.cache_salt)
            except Exception as e:  # ours: no read ahead for it
                self.guard.failed("lookup", e)
                continue
            size = sum(HEADER_SIZE + self.vault.layout.groups[r.group].nbytes(0) for r in refs)
            if self.budget.take(size):
                wanted.append((i, refs, size))
        if not wanted:
            return out
        every = list(dict.fromkeys(r for _, refs, _ in wanted for r in refs))
        prefetched = {k: v for i, _, _ in wanted for k, v in ahead[i][2].prefetched.items()}
        try:
            # each object in memory of its own, kept past this call (never lent memory): a hit
            # held keeps its own objects alive, no other hit's
            loaded = self.vault.load(every, borrow=False, stored=True, prefetched=prefetched).objects
        except Exception as e:  # the store's or ours: the answers stand, their loads read later
            log.debug("prefixvault: reading ahead %d objects failed: %s", len(every), e)
            loaded = {}
        for i, refs, size in wanted:
            if not all(r in loaded for r in refs):
                self.budget.give(size)
                continue
            objects = {r: loaded[r] for r in refs}
            # (two hits naming one object share its bytes: each counts them, as each lets go)
            nbytes = sum(len(o) for o in objects.values())
            self.budget.give(size - nbytes)  # (nothing: the same, by the layout)
            out[i] = ReadAhead(objects=objects, nbytes=nbytes, budget=self.budget)
        return out
