"""Scheduler side of the connector: look up hits, and turn engine reports into save plans.

Everything here runs in vLLM's engine-core process, inside the scheduler's step. Lookups
(hashing the prompt, then one or two store round trips) run on the lookup lane
(``prefixvault.lane``), every lookup queued by then as one batch: the scheduler
waits for new ones at most ``LOOKUP_WAIT_S`` per step (``IN_STEP_WAIT_S`` over a local store,
``restore_in_step``: the answer, and the request's load, then come in the step that asked), and
once per step ``LOOKUP_YIELD_S`` for one already in flight (to hand the lookup lane the
interpreter lock); until it answers the request is reported undetermined
(``None``: vLLM keeps it waiting and asks again next step)
while every other request goes on, and a lookup that takes longer than ``lookup_timeout`` is a
miss. A store error is a miss, never a failed request.

Saves are stored by the workers after the step that planned them. A request whose prompt
continues a prefix with a save still in flight (the previous turn of a conversation, a system
prompt another request is storing) is held, up to ``lookup_timeout``, until the workers report
that save settled, and looked up then: what the store is about to hold is not computed again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from functools import partial
from typing import Any

from prefixvault.admission import Admission, Kind, Policy
from prefixvault.boundary import StateCapture, StepChunk, max_resume_tokens, plan_saves, step_end_captures
from prefixvault.counters import Counters
from prefixvault.guard import Guard
from prefixvault.identity import content_digest
from prefixvault.keys import ExtraKeys, MultimodalItem
from prefixvault.lane import Lane, failure_of
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.samples import SAMPLE_TOKENS, VerifySample
from prefixvault.vault import Miss, Vault, producer_id
from prefixvault.vllm.compat import InternalCheckpoints, keep_restored_state, per_group_hits, skips_external
from prefixvault.vllm.config import IN_STEP_WAIT_S, ConnectorSettings, OutputBoundaries
from prefixvault.vllm.ledger import SavesInFlight
from prefixvault.vllm.lookups import LOOKUP_MISS, Answer, LaneFailed, Lookups, ReadAheadBudget
from prefixvault.vllm.mailbox import Mailbox, Payloads
from prefixvault.vllm.metadata import (
    LoadMode,
    LoadSpec,
    PrefixVaultMetadata,
    Release,
    SaveSpec,
    SavesSettled,
    save_id,
)
from prefixvault.vllm.planner import StepView, plan_step
from prefixvault.vllm.restored import RestoredBlocks
from prefixvault.vllm.verify_samples import SampleWriter

log = logging.getLogger("vllm.prefixvault")

#: How long closing the connector waits for samples still being written.
SAMPLE_DRAIN_S = 5.0
#: After this many loads for one request, it is computed without the store.
MAX_LOADS_PER_REQUEST = 2
#: Bytes read ahead for synchronous loads that the scheduler holds at most, for requests not yet
#: allocated their blocks (past it, lookups do not read ahead: those restores load asynchronously).
READ_AHEAD_BYTES = 256 << 20
#: How long the scheduler waits for a lookup before it lets the step go on without it.
LOOKUP_WAIT_S = 0.005
#: How long it waits once per step, within that, for lookups already in flight: an engine with
#: nothing else to run spins through empty steps holding the interpreter lock, which the lookup
#: lane then got back only at the 5 ms switch interval after each store call.
LOOKUP_YIELD_S = 0.0005
#: How a request may end for its held output boundary to be stored (vLLM's ``RequestStatus``
#: names): a stop token, its length limit, a repetition stop, or an abort — which is also how
#: vLLM ends a request at a stop *string* (the frontend finds it and aborts the request); the
#: boundary held is complete and exact whatever came after it. Failed: dropped.
STORED_AT_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION",
                              "FINISHED_ABORTED"})


def lora_key(lora: Any) -> str:
    """An adapter named by its files' content, so an adapter replaced in place gets new keys;
    by name and path where its files cannot be read."""
    path = str(getattr(lora, "lora_path", "") or "")
    try:
        return f"content:{content_digest(path)}"
    except OSError:
        return f"{lora.lora_name}:{path}"


def extra_keys(request: Any) -> ExtraKeys:
    """LoRA, cache salt and multimodal inputs of a request: all change its cache."""
    lora = getattr(request, "lora_request", None)
    lora_key_ = lora_key(lora) if lora is not None else None
    mm = []
    for f in getattr(request, "mm_features", None) or []:
        pos = f.mm_position
        mm.append(MultimodalItem(str(f.identifier), int(pos.offset), int(pos.length)))
    return ExtraKeys(lora=lora_key_, cache_salt=getattr(request, "cache_salt", None), multimodal=tuple(mm))


class Phase(Enum):
    """Where a request's lookup stands (``_Request.phase``)."""

    NEW = "new"  # not looked up yet, or to look up afresh (after a load, or a failed one)
    LOOKING_UP = "looking_up"  # its lookup is queued or running (``lookup``)
    WAITING_FOR_SAVE = "waiting_for_save"  # a save of its prefix is in flight: asked again once it settled
    ANSWERED = "answered"  # ``hit`` is known


@dataclass
class _Request:
    prompt: list[int]  # what the request's lookup is for
    extra: ExtraKeys
    # Token ids the engine has computed or will compute, prompt first, then generated tokens
    # as vLLM appends them (read from ``source``, vLLM's own request): decode boundaries are
    # keyed by these, so the next turn of a conversation finds them.
    tokens: list[int] = field(default_factory=list)
    source: Any = None
    hashes: list[bytes] = field(default_factory=list)
    phase: Phase = Phase.NEW
    hit: int = 0  # external hit found by lookup (tokens), when ANSWERED
    loaded: int = 0  # tokens restored from the store
    saved: int = 0  # highest boundary already handed to workers to save
    loads: int = 0  # loads issued; a request reset after a load looks up afresh
    last_capture: int = 0
    lookup: Future[Answer] | None = None  # while LOOKING_UP: queued for, or running on, the lookup lane
    lookup_since: float = 0.0
    waited_for_save: bool = False  # its lookup found a save of its prefix in flight; it waits once
    local: int = 0  # tokens vLLM's own prefix cache had when the request was looked up
    counted: bool = False  # told the admission policy whether it shares a prefix (once)
    # Asked again for vLLM's agreed hit (``_matched``), once until vLLM allocates it blocks: the
    # divergent hit it was offered.
    asked_agreed: int = 0
    # The verified payloads its lookup read ahead (one rank), until its load is planned; and,
    # where its hit was answered for a synchronous load (``_matched``), the mailbox token its
    # bytes were handed over under (0: none), for a load from ``handed_from`` tokens.
    read_ahead: Payloads | None = None
    handed: int = 0
    handed_from: int = 0
    # Its last output boundary, held by the workers until it finishes (output_boundaries: last);
    # its plans' KV blocks are checked against the request's blocks then.
    hold: SaveSpec | None = None

    @property
    def sync(self) -> bool:
        """Whether its hit was answered for a synchronous load (its bytes handed over)."""
        return self.handed > 0


class Offer(StrEnum):
    """What vLLM offers a request as its local hit (``SchedulerSide._offer``)."""

    AGREED = "agreed"  # every cache group holds it, a state included
    ON_RESTORED_KV = "on restored KV"  # divergent: no state there; every KV block below it a load wrote
    ON_COMPUTED_KV = "on computed KV"  # divergent, and some KV block below it this engine computed


class HoldDrop(StrEnum):
    """Why a held output boundary (``output_boundaries: last``) was dropped unstored."""

    PREEMPTED = "preempted"  # the request was preempted: it is computed again
    REQUEST_FAILED = "request_failed"  # it ended in a way that keeps no output (not ``STORED_AT_FINISH``)
    BLOCKS_MOVED = "blocks_moved"  # a KV block the boundary needs was let go (a sliding window, say)
    INTERNAL_ERROR = "internal_error"  # an error of ours (logged with its traceback)


@dataclass
class SchedulerCounters(Counters):
    """What the scheduler side did (its thread, the lookup and sample lanes all count here)."""

    lookups: int = 0  # requests looked up (a lookup held for a save in flight counts once)
    lookup_errors: int = 0
    hit_tokens: int = 0  # tokens vLLM allocated to load from the store
    refused: dict[str, int] = field(default_factory=dict)  # boundaries not saved, by ``Refusal``
    holds_dropped: dict[str, int] = field(default_factory=dict)  # by ``HoldDrop``
    plans: int = 0
    samples: int = 0
    sample_errors: int = 0


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, layout: CacheLayout, vault: Vault | None,
                 load: bool, save: bool, guard: Guard | None = None, in_step: bool = False) -> None:
        """``in_step``: a step waits for new lookups up to ``IN_STEP_WAIT_S`` (``restore_in_step``)."""
        self.settings = settings
        self.guard = guard or Guard()
        self.layout = layout
        self.vault = vault
        self.load_enabled = load
        self.save_enabled = save
        self.block_size = layout.block_size
        self.state_groups = [i for i, g in enumerate(layout.groups) if g.is_state]
        self.attn_groups = [i for i, g in enumerate(layout.groups) if not g.is_state]
        # vLLM may then offer the full-attention groups' local hit even where no state was kept
        # at it (``supports_divergent_local_hybrid_hits``): a load from there brings the state
        # at its own boundary and the KV past the local hit, which is every object a resume
        # needs when the other groups are full attention (a sliding window's blocks before the
        # local hit might not be in the engine's cache: then vLLM is not told we can).
        self.completes_divergent_hits = (load and vault is not None and bool(self.state_groups)
                                         and all(g.kind is GroupKind.FULL_ATTENTION for g in layout.groups
                                                 if not g.is_state))
        # Requests asked again for vLLM's agreed hit: while any waits, vLLM is not offered
        # divergent hits.
        self._want_agreed: set[str] = set()
        # Which of vLLM's blocks a load wrote: a divergent hit is completed only on those
        # (``vllm/restored.py``). vLLM's cache manager tells a divergent hit (``bind``).
        self._restored = RestoredBlocks()
        self._cache_manager: Any = None
        self._reqs: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        # Synchronous loads (``vllm/mailbox.py``): the mailbox of the engine's worker, in this
        # process or a child of it (None: every load is asynchronous); the bytes read ahead for
        # them are bounded by the lookups' ``ReadAheadBudget`` (one rank, ``restore_in_step`` only).
        self.handoff: Callable[[], Mailbox | None] = lambda: None
        self._step = 0
        self.counters = SchedulerCounters()
        # Which candidate boundaries to store: the same code the policy simulator replays.
        self.admission = Admission(Policy(settings.capture.value), settings.capture_interval, observes=load)
        budget = ReadAheadBudget(READ_AHEAD_BYTES) if in_step and layout.world_size == 1 else None
        self._lookups = Lookups(vault, self.guard, budget=budget) if vault is not None else None
        self._samples = SampleWriter(vault, self.guard, lambda n: self.counters.add(sample_errors=n)) \
            if vault is not None else None
        self._wait_budget = IN_STEP_WAIT_S if in_step else LOOKUP_WAIT_S
        self._wait_left = self._wait_budget  # what this step may still wait for lookups
        self._yielded = False  # whether this step waited for a lookup in flight
        self._in_flight = SavesInFlight(layout.world_size)  # saves planned, not yet settled by every rank
        # Held saves to store or drop, for the next step's workers (a store: with its boundaries).
        self._releases: list[tuple[Release, list[bytes]]] = []
        self._hold_last = settings.capture_outputs and settings.output_boundaries is OutputBoundaries.LAST
        # vLLM's rule for states its layers export from inside a prompt's last chunk, where this
        # platform's kernels do (None: every offer strictly inside a chunk is refused).
        self.checkpoints: InternalCheckpoints | None = None

    @property
    def offers_divergent_hits(self) -> bool:
        """What the connector tells vLLM now (``supports_divergent_local_hybrid_hits``)."""
        return self.completes_divergent_hits and self._restored.watching and not self._want_agreed

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's cache manager (``bind_kv_cache_manager``): which blocks a hit names, and the
        pool whose hand-outs end a block's restored bytes."""
        if self.completes_divergent_hits:
            self._cache_manager = kv_cache_manager
            self._restored.watch(kv_cache_manager.block_pool)

    def close(self) -> bool:
        """Drop lookups still queued and wait for a running one up to ``lookup_timeout`` (its
        request is a miss by then); give samples ``SAMPLE_DRAIN_S`` to land (those left are
        dropped). Whether both lanes are idle: if not, a call is in the store's hands, and the
        store must stay open under it."""
        lookups_done = self._lookups.close(self.settings.lookup_timeout) if self._lookups else True
        samples_done = self._samples.close(SAMPLE_DRAIN_S) if self._samples else True
        return lookups_done and samples_done

    @property
    def lanes(self) -> list[Lane[Any]]:
        return [x.lane for x in (self._lookups, self._samples) if x is not None]

    # -- requests -------------------------------------------------------------------------------

    def _track(self, request: Any) -> _Request | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            prompt = getattr(request, "prompt_token_ids", None)
            if prompt is None:  # prompt embeddings: no token ids to key on
                return None
            st = self._reqs[request.request_id] = _Request(list(prompt), extra_keys(request), list(prompt),
                                                           request)
        return st

    def _known(self, st: _Request, upto: int) -> int:
        """How many of the request's tokens are known, read up to ``upto`` (the prompt, then
        the generated tokens vLLM has appended; with async scheduling the last one may not be
        known yet when the step that computes it is planned: then it is not counted)."""
        if len(st.tokens) < upto and st.source is not None:
            all_ids = getattr(st.source, "all_token_ids", None)
            if all_ids is not None and len(all_ids) > len(st.tokens):
                st.tokens.extend(int(t) for t in all_ids[len(st.tokens) : upto])
        return len(st.tokens)

    def _hashes(self, st: _Request, upto_tokens: int) -> list[bytes]:
        n = upto_tokens // self.block_size
        if len(st.hashes) < n:
            st.hashes = self.vault.hashes(st.tokens[: n * self.block_size], st.extra, st.hashes) \
                if self.vault else []
        return st.hashes[:n]

    # The entry points vLLM calls never raise (``Guard``): an error of ours is a miss, a skipped
    # save, or a load that fails and is recomputed.

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        def miss() -> tuple[int | None, bool]:
            self._want_agreed.discard(getattr(request, "request_id", None))  # (an error: asked no more)
            return 0, False
        return self.guard.call("get_num_new_matched_tokens",
                               lambda: self._matched(request, num_computed_tokens), miss)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.guard.call("update_state_after_alloc",
                        lambda: self._after_alloc(request, blocks, num_external_tokens),
                        lambda: self.fail_load(request, num_external_tokens, blocks))

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]] = ()) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report it sent (its
        held output boundary is stored from them)."""
        return bool(self.guard.call("request_finished", lambda: self._finished(request, block_ids),
                                    lambda: False))

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._track(request)
        if st is not None and st.hold is not None:  # asked again after decoding: preempted
            self._drop_hold(st, HoldDrop.PREEMPTED)
        if st is None or not self.load_enabled or self.vault is None:
            return 0, False
        if skips_external(request):  # vLLM would not load it: no lookup, nothing counted
            return 0, False
        if st.phase in (Phase.NEW, Phase.WAITING_FOR_SAVE) and st.loads:
            # Asked again after a load: it failed (a bad object was removed) or the request was
            # preempted. Plan saves from the first block again, so what went missing is written
            # again rather than trusted to the record it was loaded from; and until a load
            # succeeds again, it is not a restored request.
            st.saved = 0
            st.loaded = 0
        if st.loads >= MAX_LOADS_PER_REQUEST:
            return 0, False  # its loads keep failing: compute it
        if st.phase is not Phase.ANSWERED:
            if st.phase is not Phase.LOOKING_UP:
                if st.waited_for_save:  # for a save of its prefix: until it settles, or for lookup_timeout
                    if (self._in_flight.names_any(st.hashes)
                            and time.monotonic() - st.lookup_since < self.settings.lookup_timeout):
                        return None, False
                else:
                    self.counters.add(lookups=1)
                st.local = num_computed_tokens
                assert self._lookups is not None
                saving = None if st.waited_for_save else self._in_flight.hashes
                # from the hit every cache group holds: past a divergent offer the store may not
                # complete, it may hold a boundary past that one (asked again for it, below)
                offer, since = self._offer(request, num_computed_tokens)
                # a load starts at the offer where it is on KV loads wrote, else at the agreed hit
                # (asked again for it); should the offer have moved when the answer is taken,
                # ``_hand_over`` finds out and the load is asynchronous
                read_from = ((num_computed_tokens if offer is Offer.ON_RESTORED_KV else since)
                             if self._reads_ahead() else None)
                st.lookup = self._lookups.submit(list(st.prompt), st.extra, list(st.hashes),
                                                 request.num_tokens, since, saving, read_from)
                st.phase = Phase.LOOKING_UP
                st.lookup_since = time.monotonic()
                wait = self._wait_left  # one budget per step, however many requests are new
            else:  # asked again: hold the step only to hand the lookup lane the interpreter lock
                wait = 0.0 if self._yielded else min(LOOKUP_YIELD_S, self._wait_left)
                self._yielded = True
            t0 = time.monotonic()
            done = self._finish_lookup(st, request.request_id, wait)
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - t0))
            if not done:
                return None, False  # still in flight: vLLM asks again next step
        self._want_agreed.discard(request.request_id)
        self._take_back(request.request_id, st)  # (asked again: handed over for an earlier answer)
        offer, agreed = self._offer(request, num_computed_tokens)
        if st.hit > num_computed_tokens and offer is not Offer.ON_COMPUTED_KV:
            # handed over before the answer: a load promised synchronous has its bytes in the
            # worker's mailbox (or none is promised)
            st.handed = self._hand_over(request.request_id, st, num_computed_tokens)
            st.handed_from = num_computed_tokens
            if st.sync and self.state_groups:
                # vLLM caches a synchronous load's blocks as it allocates them, before
                # ``update_state_after_alloc``: the state it lands in is kept only if named now
                keep_restored_state(request, st.hit)
            if not st.sync:
                self._hold_read_ahead(st, None)  # loaded asynchronously: its worker reads them
            return st.hit - num_computed_tokens, not st.sync
        if offer is Offer.AGREED or st.hit <= agreed or st.asked_agreed:
            self._hold_read_ahead(st, None)  # nothing to load
            return 0, False  # vLLM computes from the hit every group holds (it reconciles to it)
        # The store holds a boundary past vLLM's agreed hit that this divergent offer cannot
        # use (on KV this engine computed, or past the boundary): asked again, once, with
        # divergent hits not offered meanwhile (one step later), vLLM offers its agreed hit, and
        # the request is answered from the same lookup.
        log.debug("prefixvault: request %s: divergent hit at %d (%s); asked again for vLLM's agreed hit %d",
                  request.request_id, num_computed_tokens, offer.value, agreed)
        st.asked_agreed = num_computed_tokens
        self._want_agreed.add(request.request_id)
        return None, False

    @property
    def read_ahead_held(self) -> int:
        """Bytes read ahead and held for requests not yet allocated their blocks."""
        budget = self._lookups.budget if self._lookups is not None else None
        return budget.held if budget is not None else 0

    def _reads_ahead(self) -> bool:
        """Whether a lookup now also reads the objects of its hit, for a synchronous load (the
        lookups' budget, set for one rank with ``restore_in_step``, bounds the bytes)."""
        return self._lookups is not None and self._lookups.budget is not None and self.handoff() is not None

    def _hand_over(self, req_id: str, st: _Request, local: int) -> int:
        """Hand the worker the bytes of the request's load from ``local`` tokens, if the payloads
        read ahead hold every object it needs and a worker takes handoffs: the mailbox token
        (0: none handed over, the load is asynchronous)."""
        mailbox = self.handoff()
        if st.read_ahead is None or self.vault is None or mailbox is None:
            return 0
        refs = self.vault.needed(self._hashes(st, st.hit), st.hit, ranks=[0], since=local)
        if not all(r in st.read_ahead for r in refs):
            return 0
        try:
            # (for the step being built)
            return mailbox.put(req_id, {r: st.read_ahead[r] for r in refs}, self._step + 1)
        except OSError as e:  # (a worker in a child process: shared memory full) asynchronous
            log.warning("prefixvault: request %s: its bytes could not be handed to the worker (%s); "
                        "it restores one step later", req_id, e)
            return 0

    def _take_back(self, req_id: str, st: _Request) -> None:
        """Bytes handed over for a synchronous load vLLM did not allocate: out of the mailbox."""
        if st.handed:
            mailbox = self.handoff()
            if mailbox is not None:
                mailbox.drop(req_id)
        st.handed = 0

    def _hold_read_ahead(self, st: _Request, payloads: Payloads | None) -> None:
        """Keep the payloads a request's lookup read ahead, or (None) let go of those it kept
        (handed to the worker, or no synchronous load will use them): their bytes go back to
        the lookups' budget."""
        if st.read_ahead is not None and st.read_ahead is not payloads:
            budget = self._lookups.budget if self._lookups is not None else None
            if budget is not None:
                budget.give(sum(len(p) for p in st.read_ahead.values()))
        st.read_ahead = payloads

    def _offer(self, request: Any, offered: int) -> tuple[Offer, int]:
        """What vLLM's offer ``offered`` is, and the hit every cache group holds up to it: a hit
        every group holds (with the connector unbound, vLLM offers only those), or a divergent
        hit (a state group holds less), on KV that loads wrote or on KV this engine computed
        (``vllm/restored.py``)."""
        if not (self.completes_divergent_hits and offered and self._cache_manager is not None):
            return Offer.AGREED, offered
        blocks, hits = per_group_hits(self._cache_manager, request, offered)
        agreed = min(hits)
        if agreed >= offered:
            return Offer.AGREED, offered
        n = offered // self.block_size
        restored = all(len(blocks[g]) >= n and self._restored.all_loaded(g, blocks[g][:n])
                       for g in self.attn_groups)
        return (Offer.ON_RESTORED_KV if restored else Offer.ON_COMPUTED_KV), agreed

    def settle(self, report: SavesSettled) -> None:
        """Workers' reports of saves stored or dropped: lookups they held may go on. A save not
        published makes its request plan the next one from that save's parent again (its later
        boundaries would otherwise name a parent record that never came)."""
        for req_id, parent in self._in_flight.settle(report):
            st = self._reqs.get(req_id)
            if st is not None:
                st.saved = min(st.saved, parent)

    def _finish_lookup(self, st: _Request, req_id: str, wait: float) -> bool:
        """Take the lookup's answer if it is in (waiting up to ``wait`` s for it); a lookup
        past ``lookup_timeout`` is a miss. False while it is still undetermined."""
        assert st.lookup is not None and self.vault is not None
        if not futures_wait([st.lookup], timeout=wait).done:
            if time.monotonic() - st.lookup_since < self.settings.lookup_timeout:
                return False
            st.lookup.cancel()  # if it has not started, it never will
            self.counters.add(lookup_errors=1)
            self.vault.counters.tally("misses", Miss.LOOKUP_TIMEOUT.value)
            log.debug("prefixvault: lookup for request %s took over %.1f s: computing it", req_id,
                      self.settings.lookup_timeout)
            st.hit, st.lookup, st.phase = 0, None, Phase.ANSWERED
            return True
        try:
            hashes, found, payloads = st.lookup.result()
        except Exception as e:  # fail closed: a miss (logged where it was caught: the lane, or hashing)
            self.counters.add(lookup_errors=1)
            miss = LOOKUP_MISS[e.reason if isinstance(e, LaneFailed) else failure_of(e)]
            self.vault.counters.tally("misses", miss.value)
            log.debug("prefixvault: lookup failed (%s), computing request %s: %s", miss.value, req_id, e)
            st.hit, st.lookup, st.phase = 0, None, Phase.ANSWERED
            return True
        if len(hashes) > len(st.hashes):
            st.hashes = hashes
        if found is None:  # a save of its prefix is in flight: ask again once it settled
            st.lookup, st.waited_for_save, st.phase = None, True, Phase.WAITING_FOR_SAVE
            log.debug("prefixvault: request %s waits for a save of its prefix in flight", req_id)
            return False
        st.hit, st.lookup, st.phase = found.hit, None, Phase.ANSWERED
        self._hold_read_ahead(st, payloads)
        if not st.counted:
            st.counted = True
            self.admission.arrived(bool(found.hit or st.local
                                        or getattr(st.source, "shared_prefix_boundary", 0)))
        if found.hit:
            self.admission.restored(hashes[found.hit // self.block_size - 1])
        if found.miss is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("prefixvault: request %s restores %d of %d block-aligned prompt tokens: %s",
                      req_id, found.hit, found.longest, found.miss.value)
        return True

    def _after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.asked_agreed = 0  # allocated: if vLLM asks again (a failed load, a preemption), afresh
        if num_external_tokens <= 0 or st.phase is not Phase.ANSWERED or not st.hit:
            self._hold_read_ahead(st, None)  # vLLM loads nothing for it (it may drop a hit)
            self._take_back(request.request_id, st)
            return
        tokens = st.hit
        local = tokens - num_external_tokens
        block_ids = blocks.get_block_ids()
        hashes = self._hashes(st, tokens)
        if self.state_groups:  # a restore is done once per engine: vLLM keeps the state it lands in
            keep_restored_state(request, tokens)
        if self.completes_divergent_hits:
            for g in self.attn_groups:  # handed out for this load just now: its bytes will be the store's
                self._restored.loaded(g, block_ids[g][local // self.block_size:tokens // self.block_size])
        mode, token = LoadMode.ASYNC, 0
        if st.sync:  # vLLM took the load as synchronous: the engine's worker writes it
            # from the bytes handed over when it was answered (for a load from there)
            handed = local == st.handed_from
            mode = LoadMode.HANDED_OVER if handed else LoadMode.READ_IN_STEP
            token = st.handed if handed else 0
        # Invariant: the load is queued last; nothing after it raises (``fail_load`` would
        # otherwise queue a second one for the request).
        self._pending_loads.append(LoadSpec(request.request_id, hashes, tokens, local,
                                            tuple(list(b) for b in block_ids), mode=mode, token=token))
        self._hold_read_ahead(st, None)
        st.loaded = tokens
        st.saved = max(st.saved, tokens)
        st.loads += 1
        # If vLLM asks again (the load failed and the request restarts, or it was preempted),
        # look up afresh: a rejected object has been removed by then.
        st.phase, st.hit, st.handed = Phase.NEW, 0, 0
        self.counters.add(hit_tokens=num_external_tokens)
        log.info("prefixvault: request %s restores %d tokens from the store (%d local)%s",
                 request.request_id, num_external_tokens, local,
                 ", in this step" if mode is not LoadMode.ASYNC else "")

    # -- saves ------------------------------------------------------------------------------------

    def fail_load(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        """After an error of ours in ``update_state_after_alloc``: vLLM waits for a load it
        was promised, so queue one that fails; the worker reports it and vLLM recomputes. vLLM
        cannot recompute a synchronous one on a hybrid: that one is queued whole, its bytes not
        handed over (the worker reads them from the store in the step)."""
        rid = str(getattr(request, "request_id", ""))
        if num_external_tokens > 0 and not any(load.req_id == rid for load in self._pending_loads):
            st = self._reqs.get(rid)
            if st is not None and st.sync:
                tables: tuple[list[int], ...] = ()
                hashes: list[bytes] = []
                with contextlib.suppress(Exception):
                    tables = tuple(list(b) for b in blocks.get_block_ids())
                    hashes = self._hashes(st, st.hit)
                local = st.hit - num_external_tokens
                handed = bool(st.handed) and local == st.handed_from
                mode = LoadMode.HANDED_OVER if handed else LoadMode.READ_IN_STEP
                self._pending_loads.append(LoadSpec(rid, hashes, st.hit, local, tables, mode=mode,
                                                    token=st.handed if handed else 0))
            else:
                self._pending_loads.append(LoadSpec(rid, [], num_external_tokens, 0, ()))
            if st is not None:  # asked again, it is computed: no loop of failing loads
                self._hold_read_ahead(st, None)
                st.loads, st.loaded, st.saved = MAX_LOADS_PER_REQUEST, 0, 0
                st.phase, st.hit, st.handed = Phase.NEW, 0, 0

    def build_connector_meta(self, scheduler_output: Any) -> PrefixVaultMetadata:
        self._step += 1
        self._wait_left, self._yielded = self._wait_budget, False  # the next step's may wait again
        meta = PrefixVaultMetadata(step=self._step, loads=self._pending_loads,
                                   idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        sync = [load for load in meta.loads if load.in_step]
        if sync and self.state_groups:  # (an error here: the worker finds a running block unnamed)
            none: dict[tuple[int, int], LoadSpec] = {}
            fills = self.guard.call("build_connector_meta",
                                    lambda: self._own_state_copies(sync, scheduler_output), lambda: none)
            self.guard.call("build_connector_meta", lambda: self._other_state_copies(fills, scheduler_output),
                            lambda: None)
        now = time.monotonic()
        self._in_flight.forget_older_than(now)
        self._pending_loads = []  # loads are handed over whatever happens below
        for release, boundaries in self._releases:
            meta.releases.append(release)
            if release.store:  # lookups of its prefix wait for it, as for any save in flight
                self._in_flight.add(save_id(self._step, release.req_id), boundaries, now)
        self._releases = []
        if self.save_enabled and self.vault is not None:
            meta.saves = self.guard.call("build_connector_meta", lambda: self._plan_saves(scheduler_output),
                                         list)
        return meta

    def _own_state_copies(self, loads: list[LoadSpec], out: Any) -> dict[tuple[int, int], LoadSpec]:
        """Name, for each synchronous load, its request's running state block in each state
        group, from its own block table: align mode's pre-copy (from the state block at a
        request's start into the block at its chunk's end) runs before vLLM calls
        ``start_load_kv`` (0.32-0.34, both model runners), so the state is written there too
        (the worker refuses a load that names none). The state blocks the loads fill, by
        (group, block)."""
        bs = self.block_size
        fills: dict[tuple[int, int], LoadSpec] = {}
        for load in loads:
            n = int(out.num_scheduled_tokens.get(load.req_id, 0))
            for g in self.state_groups:
                table = load.block_ids[g] if g < len(load.block_ids) else []
                hit, running = (load.tokens - 1) // bs, (load.tokens + n - 1) // bs
                if n and running < len(table) and table[running] and running != hit:
                    load.state_copies.append((g, table[running]))
                if hit < len(table) and table[hit]:
                    fills[(g, table[hit])] = load
        return fills

    def _other_state_copies(self, fills: dict[tuple[int, int], LoadSpec], out: Any) -> None:
        """vLLM caches a synchronous load's blocks as it allocates them: a request scheduled
        after it in the same step whose pre-copy reads a state block a load fills gets the state
        in its running block too. (vLLM 0.32-0.34 schedules none: ``MambaManager`` refuses a hit
        on a state block cached in the same step; this holds if it ever does.)"""
        if not fills:
            return
        bs = self.block_size
        state = getattr(out, "kv_connector_block_state", None)
        new_tables = {r.req_id: r.block_ids for r in out.scheduled_new_reqs}
        starts = self._starts(out)
        own = {load.req_id for load in fills.values()}
        for rid, n in out.num_scheduled_tokens.items():
            start = starts.get(rid, 0)
            tables = state.get_block_ids(rid) if state is not None else new_tables.get(rid)
            if rid in own or not (start and n) or tables is None:
                continue
            src, dst = (start - 1) // bs, (start + n - 1) // bs
            for g in self.state_groups:
                table = tables[g]
                filled = fills.get((g, table[src])) if src < len(table) else None
                if filled is not None and src != dst and dst < len(table) and table[dst] != 0:
                    filled.state_copies.append((g, table[dst]))

    def _starts(self, out: Any) -> dict[str, int]:
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return starts

    def _plan_saves(self, out: Any) -> list[SaveSpec]:
        state = getattr(out, "kv_connector_block_state", None)
        if state is None:
            return []
        offers: dict[str, list[tuple[int, int, int]]] = state.boundary_state_offloads or {}
        starts = self._starts(out)
        drafts = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        saves: list[SaveSpec] = []
        for req_id, n_new in out.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or req_id not in starts:
                continue
            start = starts[req_id]
            # One request's error skips its own saves only.
            saves += self.guard.call("build_connector_meta",
                                     partial(self._plan_request, req_id, st, start, n_new, state, offers,
                                             bool(drafts.get(req_id))),
                                     list)
        return saves

    def _plan_request(self, req_id: str, st: _Request, start: int, n_new: int, state: Any,
                      offers: dict[str, list[tuple[int, int, int]]], speculative: bool = False
                      ) -> list[SaveSpec]:
        """What one request's step lets it publish, as the boundary rule decides: a save, a
        hold, or both (a save of its other boundaries, and its prompt's end held)."""
        bs = self.block_size
        chunk = self._chunk(st, start, start + n_new)
        prompt_len = len(st.prompt)
        # Generated tokens: boundaries over them are kept with capture_outputs, from decode
        # steps that end on a block boundary and compute no draft tokens (a rejected draft
        # would leave a state past what the request keeps).
        outputs = self.settings.capture_outputs and not speculative
        if start >= prompt_len and (not outputs or chunk.end % bs):
            return []
        known = self._known(st, chunk.end) if outputs and chunk.end > prompt_len else prompt_len
        if start >= known:
            return []  # the tokens this step computes are not known yet (async scheduling)
        tables = state.get_block_ids(req_id)
        if tables is None:
            return []
        end = min(chunk.end, known)
        offered = [StateCapture(g, t, b, self._step) for g, b, t in offers.get(req_id, []) if t <= end]
        at_end = step_end_captures(self.layout, chunk, known, {g: tables[g] for g in self.state_groups},
                                   self._step)
        view = StepView(bs, prompt_len, start, chunk, known, st.saved, st.last_capture, self._hold_last,
                        bool(self.state_groups), tuple(offered), tuple(at_end))
        step = plan_step(view, self.admission.admits, self._kinds(st, prompt_len))
        st.last_capture = step.last_capture
        captures, end = list(step.captures), step.end
        specs = []
        if step.candidates:
            specs += self._plan(req_id, st, end, tables, captures, chunk, set(step.candidates), step.hold)
        if step.held_end:
            specs += self._plan(req_id, st, end, tables, captures, chunk, {step.held_end}, True)
        return specs

    def _chunk(self, st: _Request, start: int, end: int) -> StepChunk:
        """The request's chunk this step, with the checkpoint its layers exported inside it
        where vLLM's rule says they did (prefill end as vLLM's scheduler counts it: a resumed
        request replays its output tokens too)."""
        if self.checkpoints is None:
            return StepChunk(start, end)
        source = st.source
        prompt = int(getattr(source, "num_prompt_tokens", len(st.prompt)))
        prefill_end = max(prompt, int(getattr(source, "num_tokens", prompt)) - 1)
        return StepChunk(start, end, self.checkpoints.position(start, end, prefill_end))

    def _plan(self, req_id: str, st: _Request, end: int, tables: Any, captures: list[StateCapture],
              chunk: StepChunk, candidates: set[int], hold: bool) -> list[SaveSpec]:
        """Plan the saves of ``candidates`` since the request's last save: a save now, or its
        hold (``hold``: published, if at all, when the request finishes, ``_release_hold``)."""
        bs = self.block_size
        decision = plan_saves(self.layout, end, {g: tables[g] for g in self.attn_groups}, captures,
                              self._step, candidates, chunk, since=st.saved)
        for _, why in decision.refused:
            self.counters.tally("refused", why)
        if not decision.publishable:
            return []
        top = max(p.tokens for p in decision.publishable)
        if hold:
            st.hold = SaveSpec(req_id, self._hashes(st, top), list(decision.publishable), st.saved, hold=True)
            return [st.hold]
        self.counters.add(plans=len(decision.publishable))
        spec = SaveSpec(req_id, self._hashes(st, top), list(decision.publishable), st.saved)
        st.saved = max(st.saved, top)
        boundaries = [spec.hashes[p.tokens // bs - 1] for p in spec.plans]
        if self.state_groups:
            kinds = self._kinds(st, len(st.prompt))
            for p, h in zip(spec.plans, boundaries, strict=True):
                self.admission.admitted(h, kinds(p.tokens))
        self._in_flight.add(save_id(self._step, req_id), boundaries, time.monotonic(), req_id, spec.parent)
        return [spec]

    def _kinds(self, st: _Request, prompt_len: int) -> Callable[[int], Kind]:
        """What a boundary of this request is: vLLM's prompt checkpoint (the last block
        boundary that leaves a token to compute), the sequence end as far as the connector
        knows (the prompt's last block boundary: the last one before the request finishes is
        not known in time), or the junction vLLM found with an earlier request's tokens."""
        bs = self.block_size
        checkpoint, last = max_resume_tokens(prompt_len, bs), prompt_len // bs * bs
        junction = int(getattr(st.source, "shared_prefix_boundary", 0) or 0)

        def kinds(tokens: int) -> Kind:
            k = Kind(0)
            if tokens == checkpoint:
                k |= Kind.PROMPT_END
            if tokens == last:
                k |= Kind.SEQUENCE_END
            if tokens == junction:
                k |= Kind.JUNCTION
            return k
        return kinds

    def _drop_hold(self, st: _Request, why: HoldDrop) -> None:
        """The workers free a request's held save, unstored; counted by ``why``."""
        assert st.hold is not None
        self._releases.append((Release(st.hold.req_id, False), []))
        self.counters.tally("holds_dropped", why)
        st.hold = None

    def _release_hold(self, st: _Request, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """Store a finished request's held output boundary, unless it failed, if every KV block
        its plans read is still the request's, at the same place (blocks a sliding
        window let go of, or a preemption replaced, are not); whether vLLM must keep the
        blocks until the workers read them."""
        spec = st.hold
        assert spec is not None
        if getattr(getattr(request, "status", None), "name", "") not in STORED_AT_FINISH:
            self._drop_hold(st, HoldDrop.REQUEST_FAILED)
            return False

        def kept(g: int, i: int, b: int) -> bool:
            return g < len(block_ids) and i < len(block_ids[g]) and block_ids[g][i] == b
        if not all(kept(g, i, b) for p in spec.plans for g, i, b in p.blocks):
            self._drop_hold(st, HoldDrop.BLOCKS_MOVED)
            return False
        boundaries = [spec.hashes[p.tokens // self.block_size - 1] for p in spec.plans]
        for h in boundaries:
            self.admission.admitted(h, Kind.SEQUENCE_END)
        self.counters.add(plans=len(spec.plans))
        self._releases.append((Release(spec.req_id, True), boundaries))
        st.hold = None
        return True

    def _finished(self, request: Any, block_ids: Sequence[Sequence[int]] = ()) -> bool:
        st = self._reqs.pop(request.request_id, None)
        self._want_agreed.discard(request.request_id)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()  # aborted or finished while its lookup waits: drop the lookup
        if st is None:
            return False
        self._hold_read_ahead(st, None)
        self._take_back(request.request_id, st)
        delay = False
        if st.hold is not None:  # an error here still frees the workers' hold, and keeps no block
            def dropped() -> bool:
                if st.hold is not None:
                    self._drop_hold(st, HoldDrop.INTERNAL_ERROR)
                return False
            delay = self.guard.call("request_finished", lambda: self._release_hold(st, request, block_ids),
                                    dropped)
        self.guard.call("request_finished", lambda: self._sample(request, st), lambda: None)
        return delay

    def _sample(self, request: Any, st: _Request) -> None:
        """Maybe take a verification sample of a restored greedy request (``verify_sample``):
        read here, written to the store on the sample thread (a store round trip never runs
        in the engine's step)."""
        rate = self.settings.verify_sample
        if not st.loaded or rate <= 0 or self.vault is None or random.random() >= rate:
            return
        params = getattr(request, "sampling_params", None)
        output = list(getattr(request, "output_token_ids", None) or [])[:SAMPLE_TOKENS]
        if params is None or getattr(params, "temperature", 1.0) != 0 or not output:
            return  # only greedy requests can be checked against a cold run
        self.counters.add(samples=1)
        try:
            record = self.vault.keys.record(self._hashes(st, st.loaded)[-1])
            sample = VerifySample(st.prompt, st.loaded, record, output, time.time(),
                                  producer_id())
        except Exception as e:  # a sample is best effort, never an error in the engine
            self.counters.add(sample_errors=1)
            self.guard.failed("sample", e)
            return
        assert self._samples is not None
        self._samples.put(sample, request.request_id)
