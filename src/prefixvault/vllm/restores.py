"""How a restore is answered: from vLLM's first ask about a request to the load it allocates.

vLLM asks ``get_num_new_matched_tokens`` for each waiting request, every step until it gets an
answer, and once more after a load fails or the request is preempted; after allocating the
request's blocks it calls ``update_state_after_alloc``. ``Restores`` answers, moving each
request's ``Restore`` (``vllm/request.py``) through its phases:

1. **Look up** (NEW): the prompt is hashed and looked up on the lookup lane, with every lookup
   queued by then as one batch. A step waits for new lookups at most ``LOOKUP_WAIT_S``
   (``IN_STEP_WAIT_S`` with ``restore_in_step``), and once, ``LOOKUP_YIELD_S``, for one already
   in flight (to hand the lookup lane the interpreter lock); until the answer is in, the
   request is undetermined (``None``: vLLM keeps it waiting and asks again next step) while
   every other request goes on. A lookup past ``lookup_timeout`` or a store error is a miss.
2. **Wait for a save** (WAITING_FOR_SAVE): a prompt that continues a prefix whose save is in
   flight (the previous turn of a conversation) is held until the workers report that save
   settled, up to ``lookup_timeout``, and looked up again then, once.
3. **Answer** (ANSWERED): a hit past vLLM's offer is answered as tokens to load. Where the
   lookup read the load's bytes ahead and the engine's worker takes synchronous loads
   (``vllm/in_step.py``), the bytes are handed over first (HANDED_OVER) and the answer is
   synchronous: the first chunk runs in this step. A divergent offer (``vllm/restored.py``) the
   store cannot complete is asked again, once, for vLLM's agreed hit.
4. **Load** (LOADING): vLLM allocated the blocks; the load is queued for the workers. Asked
   again, the request is looked up afresh, at most ``MAX_LOADS_PER_REQUEST`` loads, then
   computed (COMPUTED). After a failed load it is looked up no deeper than the workers say
   (``Restore.cap``: short of the first object that failed; what the engine held before the
   load where the load failed whole, a timeout or a store error), so it restores the deepest
   boundary whose objects did not fail rather than failing at the same one again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from typing import Any

from prefixvault.costs import Judgment, RestoreCosts, restore_bytes
from prefixvault.lane import Lane, failure_of
from prefixvault.vault import Miss
from prefixvault.vllm.compat import keep_restored_state
from prefixvault.vllm.config import IN_STEP_WAIT_S
from prefixvault.vllm.in_step import InStepHandover
from prefixvault.vllm.lookups import LOOKUP_MISS, LaneFailed, Lookups
from prefixvault.vllm.metadata import LoadMode, LoadSpec
from prefixvault.vllm.request import (
    Answered,
    Computed,
    HandedOver,
    Loading,
    LookingUp,
    New,
    Restore,
    TrackedRequest,
    WaitingForSave,
)
from prefixvault.vllm.restored import DivergentHits, Offer
from prefixvault.vllm.scheduler_context import SchedulerContext

log = logging.getLogger("vllm.prefixvault")

#: After this many loads for one request, it is computed without the store.
MAX_LOADS_PER_REQUEST = 2
#: How long the scheduler waits for a lookup before it lets the step go on without it.
LOOKUP_WAIT_S = 0.005
#: How long it waits once per step, within that, for lookups already in flight: an engine with
#: nothing else to run spins through empty steps holding the interpreter lock, which the lookup
#: lane then got back only at the 5 ms switch interval after each store call.
LOOKUP_YIELD_S = 0.0005


class StepWait:
    """What one step may still wait for lookups: ``budget`` for new ones, however many requests
    are new, within which one short yield to lookups already in flight."""

    def __init__(self, budget: float, never: bool = False) -> None:
        """``never``: no wait at all, not even the yield (``Restores``: steps that overlap)."""
        self.budget = budget
        self.left = budget
        self.yielded = never
        self.never = never

    def next_step(self, budget: float | None = None) -> None:
        """A new step: ``budget`` for it (None: the one it was made with)."""
        if self.never:
            self.left = 0.0
            return
        self.left, self.yielded = self.budget if budget is None else budget, False

    def for_new(self) -> float:
        return self.left

    def for_running(self) -> float:
        wait = 0.0 if self.yielded else min(LOOKUP_YIELD_S, self.left)
        self.yielded = True
        return wait

    def spent(self, seconds: float) -> None:
        self.left = max(0.0, self.left - seconds)


class Restores:
    """The scheduler side's owner of restores (see the module)."""

    def __init__(self, ctx: SchedulerContext, handover: InStepHandover, divergent: DivergentHits,
                 in_step: bool, costs: RestoreCosts, overlapped: bool = False) -> None:
        """``costs``: which restores pay (``restore_when``), and how long a step may wait for
        lookups, as measured. ``overlapped``: the engine overlaps its steps (async scheduling,
        or a GPU engine): a step never waits for lookups (their requests are asked again in a
        later step), since the wait would hold the next step's launch, not just this one."""
        self.ctx = ctx
        self.settings, self.vault, self.counters = ctx.settings, ctx.vault, ctx.counters
        self.handover = handover
        self.divergent = divergent
        self.costs = costs
        self.in_step = in_step
        self.block_size = ctx.layout.block_size
        self.has_state = ctx.layout.has_state
        self._lookups = Lookups(ctx.vault, ctx.guard, budget=handover.budget, costs=costs)
        self._wait = StepWait(IN_STEP_WAIT_S if in_step else LOOKUP_WAIT_S, never=overlapped and not in_step)
        self._pending: list[LoadSpec] = []  # loads vLLM allocated since the last step was built
        # Loads beside the steps not yet reported done, by request: (seconds from its lookup
        # queued to a step taking its answer, when vLLM allocated it, a rank's bytes): what the
        # restore takes is measured once the load is done (``landed``).
        self._landing: dict[str, tuple[float, float, int]] = {}
        self._step = 0  # the last step built: asks now are for the next one

    @property
    def lane(self) -> Lane[Any]:
        return self._lookups.lane

    @property
    def lanes(self) -> list[Lane[Any]]:
        """The lookup lane, and the lane that touches what hits use."""
        return [self._lookups.lane, self._lookups.touches]

    def close(self) -> bool:
        """Drop lookups still queued and wait for a running one up to ``lookup_timeout`` (its
        request is a miss by then); whether the lookup lane is idle."""
        return self._lookups.close(self.settings.lookup_timeout)

    def landed(self, req_ids: Collection[str]) -> None:
        """The workers report these requests' loads done (vLLM's ``finished_recving``): each can
        be scheduled in the next step, so what its restore took is measured now
        (``RestoreCosts.restored``): from its lookup queued to a step taking its answer (at
        most a busy step after the lookup replied: ``_answered_after``), and from vLLM's
        allocation to now. A longer wait before the allocation (the step's token budget taken
        by other requests) is left out: a request computed would wait as long."""
        if not self._landing:
            return
        now = time.monotonic()
        for rid in [r for r in req_ids if r in self._landing]:
            answered, allocated, nbytes = self._landing.pop(rid)
            self.costs.restored(answered + now - allocated, nbytes, in_step=False)

    def next_step(self, step: int) -> list[LoadSpec]:
        """Step ``step`` is being built: the loads allocated for it (handed over whatever
        happens next), and a new wait budget for the asks of the step after it."""
        self._step = step
        self.handover.next_step()
        # With restore_in_step a step waits for its lookups whatever they cost (a local store's
        # read is a copy); else only as long as a restore a step sooner pays back (``costs``).
        self._wait.next_step(None if self.in_step else self.costs.wait_for_lookups(LOOKUP_WAIT_S))
        loads, self._pending = self._pending, []
        return loads

    # -- vLLM asks ----------------------------------------------------------------------------------

    def answer(self, tr: TrackedRequest, request: Any, computed: int) -> tuple[int | None, bool]:
        """vLLM's ask for a request that has ``computed`` tokens in the engine's own cache
        (``get_num_new_matched_tokens``)."""
        r = tr.restore
        if isinstance(r.phase, Loading):
            # Asked again after a load: it failed (a bad object was removed) or the request was
            # preempted. Saves are planned from the first block again, so what went missing is
            # written again rather than trusted to the record it was loaded from.
            self._landing.pop(tr.req_id, None)
            r.restart()
            tr.saved = tr.saved_tail = 0
        if r.loads >= MAX_LOADS_PER_REQUEST or (isinstance(r.phase, New) and r.cap is not None
                                                and r.cap <= computed):
            r.give_up()  # its loads keep failing, or nothing past what the engine holds is left
        if isinstance(r.phase, Computed):
            return 0, False
        if isinstance(r.phase, New | WaitingForSave | LookingUp) and not self._look_up(tr, request, computed):
            return None, False  # still in flight: vLLM asks again next step
        self.divergent.answered(tr.req_id)
        if r.take_back():  # asked again: handed over for an earlier answer
            self.handover.take_back(tr.req_id)
        phase = r.phase
        assert isinstance(phase, Answered)
        offer, agreed = self.divergent.classify(request, computed)
        if phase.hit > computed and offer is not Offer.ON_COMPUTED_KV:
            # handed over before the answer: a load promised synchronous has its bytes in the
            # worker's mailbox (or none is promised)
            token = self._hand_over(tr, phase.hit, computed)
            if token:
                r.hand_over(token, computed)
                if self.has_state and phase.hit % self.block_size == 0:
                    # vLLM caches a synchronous load's blocks as it allocates them, before
                    # ``update_state_after_alloc``: the state it lands in is kept only if named now
                    keep_restored_state(request, phase.hit)
            else:
                r.keep_read_ahead(False)  # loaded asynchronously: its worker reads them
            return phase.hit - computed, not r.sync
        if offer is Offer.AGREED or phase.hit <= agreed or phase.asked_agreed:
            r.keep_read_ahead(False)  # nothing to load
            return 0, False  # vLLM computes from the hit every group holds (it reconciles to it)
        # The store holds a boundary past vLLM's agreed hit that this divergent offer cannot
        # use (on KV this engine computed, or past the boundary): asked again, once, with
        # divergent hits not offered meanwhile (one step later), vLLM offers its agreed hit, and
        # the request is answered from the same lookup.
        log.debug("prefixvault: request %s: divergent hit at %d (%s); asked again for vLLM's agreed hit %d",
                  tr.req_id, computed, offer.value, agreed)
        r.ask_agreed(computed)
        self.divergent.want_agreed(tr.req_id)
        return None, False

    def _look_up(self, tr: TrackedRequest, request: Any, computed: int) -> bool:
        """Queue the request's lookup if it has none, or wait for the one in flight (within the
        step's budget); whether its answer is in."""
        r = tr.restore
        if isinstance(r.phase, LookingUp):
            wait = self._wait.for_running()  # hold the step only to hand the lookup lane the lock
        else:
            if (isinstance(r.phase, WaitingForSave)  # until the save settles, or for lookup_timeout
                    and self.ctx.in_flight.names_any(tr.hashes)
                    and time.monotonic() - r.phase.since < self.settings.lookup_timeout):
                return False
            # from the hit every cache group holds: past a divergent offer the store may not
            # complete, it may hold a boundary past that one (asked again for it, in ``answer``)
            offer, since = self.divergent.classify(request, computed)
            # a load starts at the offer where it is on KV loads wrote, else at the agreed hit
            # (asked again for it); should the offer have moved when the answer is taken,
            # ``_hand_over`` finds out and the load is asynchronous
            start = computed if offer is Offer.ON_RESTORED_KV else since
            # after a failed load, no deeper than the objects that failed (``Restore.cap``)
            num_tokens = request.num_tokens if r.cap is None else min(request.num_tokens, r.cap + 1)
            if not isinstance(r.phase, WaitingForSave) and not r.waited_for_save:
                # (what the engine computes without a load: from the hit every group holds)
                if not self._worth_looking_up(tr, num_tokens, since, computed, start):
                    return True
                self.counters.add(lookups=1)  # (a lookup held for a save in flight counts once)
            saving = None if r.waited_for_save else self.ctx.in_flight.hashes
            read_from = start if self.handover.reads_ahead() else None
            # Where the engine holds a prefix's KV but no state: vLLM's junction, or a divergent
            # offer (vLLM names no junction with one; asked again without it, the offer is it).
            junction = computed if offer is not Offer.AGREED \
                else int(getattr(request, "shared_prefix_boundary", 0) or 0)
            lookup = self._lookups.submit(prompt=list(tr.prompt), extra=tr.extra, known=list(tr.hashes),
                                          num_tokens=num_tokens, min_tokens=since, saving=saving,
                                          read_from=read_from, junction=junction,
                                          in_step=self._loads_in_step)
            r.look_up(lookup, computed, time.monotonic(), agreed=since, start=start)
            wait = self._wait.for_new()
        t0 = time.monotonic()
        done = self._take_answer(tr, wait)
        self._wait.spent(time.monotonic() - t0)
        return done

    @property
    def _loads_in_step(self) -> bool:
        """Whether a hit is loaded in the step that takes it (``restore_in_step``, or its bytes
        read ahead by the lookup): its costs are judged by what such restores took."""
        return self.in_step or self.handover.reads_ahead()

    def _worth_looking_up(self, tr: TrackedRequest, num_tokens: int, agreed: int, computed: int,
                          start: int) -> bool:
        """Whether the request (of ``num_tokens``, as far as it may restore) could restore
        enough past ``agreed`` (what the engine computes from without a load) to pay for the
        round trips and the bytes of its longest possible hit, loaded from ``start``
        (``RestoreCosts.look_up``); if not it is answered a miss now, with none (``computed``:
        vLLM's offer)."""
        sync = self._loads_in_step
        longest = max(0, num_tokens - 1)
        nbytes = restore_bytes(self.ctx.layout, longest, min(start, longest))
        judged = self.costs.look_up(max(0, longest - agreed), sync, nbytes)
        self.counters.tally("judged", f"lookup_{judged.value}")
        if judged is not Judgment.NOT_WORTH_IT:
            return True
        tr.restore.decline()
        self.vault.counters.tally("misses", Miss.NOT_WORTH_IT.value)
        if not tr.counted:
            tr.counted = True
            self.ctx.admission.arrived(bool(computed or getattr(tr.source, "shared_prefix_boundary", 0)))
        return False

    def _worth_loading(self, hit: int, phase: LookingUp, read_ahead: bool) -> bool:
        """Whether loading a hit of ``hit`` tokens (from ``phase.start``) ends sooner than
        computing them from the hit every group holds (``phase.agreed``: what the engine
        computes from without a load; ``RestoreCosts.restore``); bytes read ahead already cost
        nothing more than a copy."""
        if hit <= phase.agreed or read_ahead:
            return True
        nbytes = restore_bytes(self.ctx.layout, hit, min(phase.start, hit))
        judged = self.costs.restore(hit - phase.agreed, nbytes, self.in_step)
        self.counters.tally("judged", f"load_{judged.value}")
        return judged is not Judgment.NOT_WORTH_IT

    def _take_answer(self, tr: TrackedRequest, wait: float) -> bool:
        """Take the lookup's answer if it is in (waiting up to ``wait`` s for it); a lookup past
        ``lookup_timeout`` is a miss. False while it is still undetermined."""
        r = tr.restore
        phase = r.phase
        assert isinstance(phase, LookingUp)
        if not futures_wait([phase.lookup], timeout=wait).done:
            if time.monotonic() - phase.since < self.settings.lookup_timeout:
                return False
            phase.lookup.cancel()  # if it has not started, it never will
            self.counters.add(lookup_errors=1)
            self.vault.counters.tally("misses", Miss.LOOKUP_TIMEOUT.value)
            log.debug("prefixvault: lookup for request %s took over %.1f s: computing it", tr.req_id,
                      self.settings.lookup_timeout)
            r.answer(0)
            return True
        try:
            hashes, found, read_ahead = phase.lookup.result()
        except Exception as e:  # fail closed: a miss (logged where it was caught: the lane, or hashing)
            self.counters.add(lookup_errors=1)
            miss = LOOKUP_MISS[e.reason if isinstance(e, LaneFailed) else failure_of(e)]
            self.vault.counters.tally("misses", miss.value)
            log.debug("prefixvault: lookup failed (%s), computing request %s: %s", miss.value, tr.req_id, e)
            r.answer(0)
            return True
        if len(hashes) > len(tr.hashes):
            tr.hashes = hashes
        if found is None:  # a save of its prefix is in flight: ask again once it settled
            r.wait_for_save()
            log.debug("prefixvault: request %s waits for a save of its prefix in flight", tr.req_id)
            return False
        if not self._worth_loading(found.hit, phase, read_ahead is not None):
            r.not_worth_it = True
            self.vault.counters.tally("misses", Miss.NOT_WORTH_IT.value)
            log.debug("prefixvault: request %s computes %d tokens the store holds: sooner than loading them",
                      tr.req_id, found.hit - phase.local)
            found = replace(found, hit=0)
        if found.at_junction:
            self.counters.tally("judged", "load_to_junction")
            log.debug("prefixvault: request %s restores %d tokens, to its junction, and computes the rest: "
                      "its prefix's later requests resume there", tr.req_id, found.hit)
        r.answer(found.hit, read_ahead, junction=found.at_junction)
        if not tr.counted:
            tr.counted = True
            self.ctx.admission.arrived(bool(found.hit or phase.local
                                        or getattr(tr.source, "shared_prefix_boundary", 0)))
        if found.hit:
            self.ctx.admission.restored(found.boundary_hash)  # (its chain hash, or its tail hash)
        if found.miss is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("prefixvault: request %s restores %d of %d block-aligned prompt tokens: %s",
                      tr.req_id, found.hit, found.longest, found.miss.value)
        return True

    def _hand_over(self, tr: TrackedRequest, hit: int, start: int) -> int:
        """Hand the worker the bytes of the request's load from ``start`` tokens, for the step
        being built, if they were read ahead: the mailbox token (0: the load is asynchronous)."""
        if tr.restore.read_ahead is None:
            return 0
        refs = self.vault.needed(self.ctx.chain(tr, hit), hit, ranks=[0], since=start,
                                 salt=tr.extra.cache_salt)
        return self.handover.hand_over(tr.req_id, tr.restore.read_ahead, refs, self._step + 1)

    # -- vLLM allocates -------------------------------------------------------------------------------

    def allocated(self, tr: TrackedRequest, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (``update_state_after_alloc``), with
        ``num_external_tokens`` to load: its load is queued for the step being built."""
        r = tr.restore
        if num_external_tokens <= 0 or not r.hit:
            if r.take_back():  # vLLM loads nothing for it (it may drop a hit)
                self.handover.take_back(tr.req_id)
            r.allocated()
            return
        phase = r.phase
        assert isinstance(phase, Answered | HandedOver)
        tokens = phase.hit
        local = tokens - num_external_tokens
        block_ids = blocks.get_block_ids()
        hashes = self.ctx.chain(tr, tokens)
        if self.has_state and tokens % self.block_size == 0:
            # a restore is done once per engine: vLLM keeps the state it lands in (at a block
            # boundary: vLLM keeps no state for a junction inside a block)
            keep_restored_state(request, tokens)
        self.divergent.loading(block_ids, local, tokens)
        mode, token = LoadMode.ASYNC, 0
        if isinstance(phase, HandedOver):  # vLLM took the load as synchronous: the engine's worker
            # writes it from the bytes handed over when it was answered (for a load from there)
            handed = local == phase.start
            mode = LoadMode.HANDED_OVER if handed else LoadMode.READ_IN_STEP
            token = phase.token if handed else 0
        # Invariant: the load is queued last; nothing after it raises (``fail_load`` would
        # otherwise queue a second one for the request).
        self._pending.append(LoadSpec(tr.req_id, hashes, tokens, local, tuple(list(b) for b in block_ids),
                                      mode=mode, token=token, salt=tr.extra.cache_salt))
        if r.asked_at is not None:  # what the restore takes, up to when the request can be scheduled
            now = time.monotonic()
            answered = self._answered_after(r, now) - r.asked_at
            nbytes = restore_bytes(self.ctx.layout, tokens, local)
            if mode is LoadMode.ASYNC:
                self._landing[tr.req_id] = (answered, now, nbytes)  # and until it is loaded
            else:  # runs in this step
                self.costs.restored(answered, nbytes, in_step=True)
        r.load()
        tr.saved = max(tr.saved, tokens // self.block_size * self.block_size)  # (a parent is block-aligned)
        self.counters.add(hit_tokens=num_external_tokens)
        log.info("prefixvault: request %s restores %d tokens from the store (%d local)%s", tr.req_id,
                 num_external_tokens, local, ", in this step" if mode is not LoadMode.ASYNC else "")

    def _answered_after(self, r: Restore, now: float) -> float:
        """When the restore's answer counts as taken: when a step took it, but no later than a
        busy step after the lookup replied. Waiting for the step that takes an answer is a
        restore's own cost (a request computed would have run in the step that asked); a
        longer wait is for the step's token budget, taken by other requests, which a request
        computed instead would wait for as well."""
        taken = r.answered_at or now
        step = self.costs.estimates().step_s
        if r.replied_at is not None and step is not None:
            taken = min(taken, r.replied_at + step)
        return taken

    def fail_load(self, tr: TrackedRequest | None, req_id: str, num_external_tokens: int,
                  blocks: Any) -> None:
        """After an error of ours in ``update_state_after_alloc``: vLLM waits for a load it
        was promised, so queue one that fails; the worker reports it and vLLM recomputes. vLLM
        cannot recompute a synchronous one on a hybrid: that one is queued whole, its bytes
        read from the store in the step where they were not handed over for it."""
        if num_external_tokens <= 0 or any(load.req_id == req_id for load in self._pending):
            return
        phase = tr.restore.phase if tr is not None else None
        if tr is not None and isinstance(phase, HandedOver):
            tables: tuple[list[int], ...] = ()
            hashes: list[bytes] = []
            with contextlib.suppress(Exception):  # (the worker then finds no blocks: reported unwritten)
                tables = tuple(list(b) for b in blocks.get_block_ids())
                hashes = self.ctx.chain(tr, phase.hit)
            local = phase.hit - num_external_tokens
            handed = local == phase.start
            self._pending.append(LoadSpec(req_id, hashes, phase.hit, local, tables,
                                          mode=LoadMode.HANDED_OVER if handed else LoadMode.READ_IN_STEP,
                                          token=phase.token if handed else 0, salt=tr.extra.cache_salt))
        else:
            self._pending.append(LoadSpec(req_id, [], num_external_tokens, 0, ()))
        if tr is not None:  # asked again, it is computed: no loop of failing loads
            tr.restore.give_up()
            tr.saved = tr.saved_tail = 0

    def forget(self, tr: TrackedRequest) -> None:
        """Nothing of the request's restore lands from now on (the engine's cache was reset
        under it): a lookup in flight is dropped, bytes handed over are taken back, and asked
        again it is computed. A load vLLM allocated already lands (vLLM keeps its blocks)."""
        self._landing.pop(tr.req_id, None)
        if tr.restore.take_back():
            self.handover.take_back(tr.req_id)
        if not isinstance(tr.restore.phase, Loading | Computed):
            lookup = tr.restore.lookup
            if lookup is not None:
                lookup.cancel()  # (one not started never starts)
            tr.restore.give_up()

    def finished(self, tr: TrackedRequest) -> None:
        """The request finished (or was aborted): nothing of its restore is kept."""
        self.divergent.answered(tr.req_id)
        self._landing.pop(tr.req_id, None)
        if tr.restore.take_back():
            self.handover.take_back(tr.req_id)
        tr.restore.finish()
