"""Scheduler side of the connector: the requests it tracks, and who answers each of vLLM's calls.

Everything here runs in vLLM's engine-core process, inside the scheduler's step; store round
trips run on lanes beside it (``prefixvault.lane``). ``SchedulerSide`` tracks one
``TrackedRequest`` per request (``vllm/request.py``) and dispatches:

- a restore, from vLLM's first ask to the load it allocates: ``Restores`` (``vllm/restores.py``,
  with the synchronous loads' hand-over in ``vllm/in_step.py`` and divergent hits in
  ``vllm/restored.py``);
- what each step saves, holds and releases: ``SavePlans`` (``vllm/save_plans.py``);
- verification samples of restored requests: ``SampleWriter`` (``vllm/verify_samples.py``).

Every entry point vLLM calls goes through the ``Guard``: an error of ours is a miss, a skipped
save, or a load that fails and is recomputed, never an exception into the engine.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Collection, Sequence
from typing import Any

from prefixvault.admission import Admission, Policy
from prefixvault.costs import RestoreCosts
from prefixvault.guard import Guard
from prefixvault.lane import Lane
from prefixvault.layout import CacheLayout
from prefixvault.samples import SAMPLE_TOKENS, VerifySample
from prefixvault.vault import Miss, Vault, producer_id
from prefixvault.vllm.compat import InternalCheckpoints, skips_external
from prefixvault.vllm.config import ConnectorSettings, RestoreWhen
from prefixvault.vllm.in_step import READ_AHEAD_BYTES, InStepHandover, ReadAheadBudget
from prefixvault.vllm.ledger import SavesInFlight
from prefixvault.vllm.metadata import PrefixVaultMetadata, SavesSettled
from prefixvault.vllm.request import TrackedRequest
from prefixvault.vllm.restored import DivergentHits
from prefixvault.vllm.restores import Restores
from prefixvault.vllm.save_plans import HoldDrop, SavePlans
from prefixvault.vllm.scheduler_context import SchedulerContext, SchedulerCounters
from prefixvault.vllm.verify_samples import SampleWriter

log = logging.getLogger("vllm.prefixvault")

#: How long closing the connector waits for samples still being written.
SAMPLE_DRAIN_S = 5.0


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, layout: CacheLayout, vault: Vault | None,
                 load: bool, save: bool, guard: Guard | None = None, in_step: bool = False,
                 engine_id: str | None = None, checkpoints: InternalCheckpoints | None = None,
                 overlapped: bool = False, sync_loads: bool | None = None,
                 step_budget: int | None = None) -> None:
        """``in_step``: a step waits for new lookups up to ``IN_STEP_WAIT_S`` (``restore_in_step``).
        ``sync_loads`` (as ``in_step`` if None): with one rank, lookups read their hits' objects
        ahead for synchronous loads into the worker serving ``engine_id``'s mailbox
        (``hands_over_loads``). ``checkpoints``: vLLM's rule for states
        exported inside a chunk, where this platform's kernels export them. ``overlapped``: the
        engine overlaps its steps (async scheduling, a GPU): no step waits for lookups.
        ``step_budget``: the most tokens a step schedules (``max_num_batched_tokens``), for the
        prefill estimate (``RestoreCosts``)."""
        self.settings = settings
        self.guard = guard or Guard()
        self.layout = layout
        self.vault = vault
        self.load_enabled = load
        self.save_enabled = save
        # Why no hit is offered nor save planned any more (a worker went off), or None.
        self.off: Miss | None = None
        # The epoch of the keys of requests tracked from now on: None until the engine's cache
        # is reset (new weights), then a random token per reset (``reset``).
        self.epoch: str | None = None
        self.counters = SchedulerCounters()
        self._reqs: dict[str, TrackedRequest] = {}
        self._step = 0
        # Which candidate boundaries to store: the same code the policy simulator replays.
        self.admission = Admission(Policy(settings.capture.value), settings.capture_interval, observes=load)
        self.divergent = DivergentHits(layout, completes=load and vault is not None)
        sync = in_step if sync_loads is None else sync_loads
        budget = ReadAheadBudget(READ_AHEAD_BYTES) if sync and layout.world_size == 1 else None
        self.handover = InStepHandover(layout, budget, engine_id,
                                       lambda why: self.counters.tally("in_step_lost", why.value))
        # what a restore costs against computing, measured (``restore_when``)
        self.costs = RestoreCosts(judge=settings.restore_when is RestoreWhen.FASTER, step_budget=step_budget)
        self.restores: Restores | None = None
        self.saves: SavePlans | None = None
        self._samples: SampleWriter | None = None
        if vault is not None:
            # saves planned, not yet settled by every rank: shared by both parts
            ctx = SchedulerContext(settings=settings, layout=layout, vault=vault, guard=self.guard,
                                   counters=self.counters, admission=self.admission,
                                   in_flight=SavesInFlight(layout.world_size))
            self.restores = Restores(ctx, self.handover, self.divergent, in_step, self.costs, overlapped)
            self.saves = SavePlans(ctx, checkpoints)
            self._samples = SampleWriter(vault, self.guard, lambda n: self.counters.add(sample_errors=n))

    @property
    def completes_divergent_hits(self) -> bool:
        return self.divergent.completes

    @property
    def offers_divergent_hits(self) -> bool:
        """What the connector tells vLLM now (``supports_divergent_local_hybrid_hits``)."""
        return self.divergent.offered

    @property
    def read_ahead_held(self) -> int:
        """Bytes read ahead and held for requests not yet allocated their blocks."""
        return self.handover.held

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's cache manager (``bind_kv_cache_manager``), for divergent hits."""
        self.divergent.bind(kv_cache_manager)

    def close(self) -> bool:
        """Drop lookups still queued and wait for a running one up to ``lookup_timeout`` (its
        request is a miss by then); give samples ``SAMPLE_DRAIN_S`` to land (those left are
        dropped). Whether both lanes are idle: if not, a call is in the store's hands, and the
        store must stay open under it."""
        lookups_done = self.restores.close() if self.restores is not None else True
        samples_done = self._samples.close(SAMPLE_DRAIN_S) if self._samples is not None else True
        return lookups_done and samples_done

    @property
    def lanes(self) -> list[Lane[Any]]:
        return [*(self.restores.lanes if self.restores is not None else []),
                *([self._samples.lane] if self._samples is not None else [])]

    def tracked(self, req_id: str) -> TrackedRequest | None:
        return self._reqs.get(req_id)

    # The entry points vLLM calls never raise (``Guard``): an error of ours is a miss, a skipped
    # save, or a load that fails and is recomputed.

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        def miss() -> tuple[int | None, bool]:
            self.divergent.answered(getattr(request, "request_id", ""))  # (an error: asked no more)
            return 0, False
        return self.guard.call("get_num_new_matched_tokens",
                               lambda: self._matched(request, num_computed_tokens), miss)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.guard.call("update_state_after_alloc",
                        lambda: self._allocated(request, blocks, num_external_tokens),
                        lambda: self.fail_load(request, num_external_tokens, blocks))

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]] = ()) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report it sent (its
        held output boundary is stored from them)."""
        return bool(self.guard.call("request_finished", lambda: self._finished(request, block_ids),
                                    lambda: False))

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tr = self._reqs.get(request.request_id)
        if tr is None:
            tr = TrackedRequest.of(request, self.epoch)
            if tr is None:
                return 0, False
            self._reqs[tr.req_id] = tr
        if tr.hold is not None and self.saves is not None:  # asked again after decoding: preempted
            self.saves.drop_hold(tr, HoldDrop.PREEMPTED)
        if not self.load_enabled or self.restores is None or skips_external(request):
            return 0, False  # (vLLM would not load it: no lookup, nothing counted)
        off = Miss.RESET if tr.stale else self.off
        if off is not None:
            if tr.stale:  # its lookup, or bytes handed over, are of the old epoch: none of it lands
                self.restores.forget(tr)
            if not tr.counted and self.vault is not None:
                tr.counted = True
                self.vault.counters.tally("misses", off.value)
            return 0, False
        return self.restores.answer(tr, request, num_computed_tokens)

    def _allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tr = self._reqs.get(request.request_id)
        if tr is not None and self.restores is not None:
            self.restores.allocated(tr, request, blocks, num_external_tokens)

    def fail_load(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        """After an error of ours in ``update_state_after_alloc``: a load that fails is queued
        (``Restores.fail_load``)."""
        if self.restores is not None:
            req_id = str(getattr(request, "request_id", ""))
            self.restores.fail_load(self._reqs.get(req_id), req_id, num_external_tokens, blocks)

    def _finished(self, request: Any, block_ids: Sequence[Sequence[int]] = ()) -> bool:
        tr = self._reqs.pop(request.request_id, None)
        self.divergent.answered(request.request_id)
        if tr is None:
            return False
        loaded = tr.restore.loaded
        if self.restores is not None:
            self.restores.finished(tr)
        delay = self.saves.finished(tr, request, block_ids) if self.saves is not None else False
        self.guard.call("request_finished", lambda: self._sample(request, tr, loaded), lambda: None)
        return delay

    def build_connector_meta(self, scheduler_output: Any) -> PrefixVaultMetadata:
        self._step += 1
        self.counters.add(steps=1)
        self.guard.call("build_connector_meta", lambda: self._measure_step(scheduler_output), lambda: None)
        meta = PrefixVaultMetadata(step=self._step,
                                   idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        if self.restores is None or self.saves is None:
            return meta
        meta.loads = self.restores.next_step(self._step)  # loads are handed over whatever happens below
        self.handover.name_state_copies(meta.loads, scheduler_output, self.guard)
        now = time.monotonic()
        self.saves.in_flight.forget_older_than(now)
        if self.save_enabled and self.off is None:
            saves = self.saves
            meta.saves = self.guard.call("build_connector_meta",
                                         lambda: saves.plan(scheduler_output, self._step, self._reqs), list)
        # (after planning: a running request's hold released there is read in this step, the
        # one step its blocks are known to be its own)
        meta.releases = self.saves.take_releases(self._step, now)
        return meta

    def _measure_step(self, scheduler_output: Any) -> None:
        """The engine's step time and prefill rate, for ``costs``: tokens scheduled, and of them
        those in chunks of more than one (prefill), of how many requests."""
        per_request = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        chunks = [int(n) for n in per_request.values() if n > 1]
        self.costs.step_planned(tokens, sum(chunks), len(chunks))

    def loads_done(self, req_ids: Collection[str]) -> None:
        """vLLM reports these requests' loads beside the steps done (every worker's
        ``finished_recving``): each can be scheduled next, so its restore's time is measured."""
        if self.restores is not None:
            self.restores.landed(req_ids)

    def settle(self, report: SavesSettled) -> None:
        """Workers' reports of saves stored or dropped (``SavePlans.settle``), of failed loads
        (how deep each request may still restore: ``Restore.capped``), and of workers gone
        off: a worker that writes no load would make every hit a load that fails, is
        recomputed and looked up again, slower than no connector; so hits stop being offered
        (each request a miss, ``worker_off``) and saves stop being planned."""
        if report.load_bytes:
            self.costs.loaded(report.load_bytes, report.load_s)
        if report.in_step_s:
            self.costs.loaded_in_step(report.in_step_bytes, report.in_step_s)
        for req_id, cap in report.caps.items():  # (in the output that reports the load failed)
            tr = self._reqs.get(req_id)
            if tr is not None:
                tr.restore.capped(cap)
        if self.saves is not None:
            self.saves.settle(report, self._reqs)
        if report.off and self.off is None:
            self.off = Miss.WORKER_OFF
            log.warning("prefixvault: %d worker(s) of this engine went off (their caches could not be used; "
                        "logged by the worker): no request is restored or saved from now on", report.off)

    def reset(self) -> bool:
        """vLLM resets the engine's prefix cache (``/reset_prefix_cache`` with the connector's
        part, as after an in-place weight update): everything stored so far was computed with
        the weights before, so nothing of it is restored from now on. The engine moves to a new
        epoch (``ExtraKeys.epoch``, a random token): requests it tracks from now on are keyed
        in it, so it restores what it computes itself after the reset and nothing from before,
        nor from any other engine; requests tracked before restore and save nothing more. The
        store is not emptied: engines of the old weights keep using it. Engines that share the
        new weights' cache are started with a namespace of their own (docs/operations.md,
        "Updating the model's weights")."""
        self.epoch = secrets.token_hex(16)
        for tr in self._reqs.values():
            tr.stale = True
        log.warning("prefixvault: the engine's prefix cache was reset: nothing in the store from before "
                    "is restored (namespace %s); from now on this engine restores what it computes "
                    "itself, under keys no other engine shares; start engines of the new weights with "
                    "a namespace of their own to share their cache", self.settings.namespace)
        return True

    def _sample(self, request: Any, tr: TrackedRequest, loaded: int) -> None:
        """Maybe take a verification sample of a restored greedy request (``verify_sample``):
        read here, written to the store on the sample thread (a store round trip never runs
        in the engine's step)."""
        rate = self.settings.verify_sample
        # (after a reset no sample: a verifier's cold run is of the weights it loads, not these)
        if not loaded or rate <= 0 or self.vault is None or self.epoch is not None or random.random() >= rate:
            return
        params = getattr(request, "sampling_params", None)
        output = list(getattr(request, "output_token_ids", None) or [])[:SAMPLE_TOKENS]
        if params is None or getattr(params, "temperature", 1.0) != 0 or not output:
            return  # only greedy requests can be checked against a cold run
        self.counters.add(samples=1)
        try:
            named = tr.chain(loaded, self.layout.block_size, self.vault.prefix_hashes)
            record = self.vault.record_key(named[-1], tr.extra.cache_salt)
            sample = VerifySample(tr.prompt, loaded, record, output, time.time(), producer_id())
        except Exception as e:  # a sample is best effort, never an error in the engine
            self.counters.add(sample_errors=1)
            self.guard.failed("sample", e)
            return
        assert self._samples is not None
        self._samples.put(sample, request.request_id, tr.extra.cache_salt)
