"""A worker's loads beside the engine: the load lane, each load's deadline, the writes into its blocks.

``start_load_kv`` queues each asynchronous load on the load lane, which reads every load queued
by then from the store in one batch (an object two loads need is read once), verifies the
objects and writes them into each request's blocks while the engine goes on with other
requests. A request is reported finished (``take_finished``, for vLLM's ``get_finished``) only
after its objects landed, and vLLM schedules its first chunk only then; its blocks are fresh
(vLLM caches them only once loaded), so nothing else reads or writes them meanwhile.

Each load has a deadline scaled to its bytes (``load_timeout`` plus ``LOAD_FLOOR_BYTES_PER_S``):
past it the load is reported failed (vLLM recomputes it), its late bytes are never written, and
the store's breaker counts a failure. Over a local store (``restore_in_step``) ``take_finished``
waits for the step's loads up to ``IN_STEP_WAIT_S``: one that lands by then is reported in the
step it was planned in, and its first chunk runs in the next (waiting, the engine's thread
leaves the load lane the interpreter lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from prefixvault.codec import ObjectKind
from prefixvault.lane import Failure, Lane, report
from prefixvault.stores.breaker import BreakerStore
from prefixvault.vault import ObjectRef
from prefixvault.vllm.config import IN_STEP_WAIT_S
from prefixvault.vllm.metadata import LoadSpec
from prefixvault.vllm.worker_context import WorkerContext

log = logging.getLogger("vllm.prefixvault")

#: How long a stopping worker waits for a load already running (loads queued are dropped: the
#: engine they were for is stopping).
LOAD_DRAIN_S = 5.0
#: How long the engine's thread sleeps in a step that computes nothing while a load runs beside
#: it (``take_finished``).
LOAD_YIELD_S = 0.0005
#: A load's deadline is ``load_timeout`` plus its bytes at this rate (a store slower than this
#: is no faster than recomputing on any engine worth restoring for).
LOAD_FLOOR_BYTES_PER_S = 64 << 20
#: Loads the load lane queues at most; past it a load fails at once (recomputed).
LOAD_QUEUE = 4096


class LoadFailure(StrEnum):
    """Why a load failed (its request is recomputed): one reason per failed load."""

    MISSING = "missing"  # an object it needs is gone from the store
    REJECTED = "rejected"  # an object failed verification (by why: ``rejected{reason}``)
    NO_BLOCK = "no_block"  # vLLM gave no block for an object
    TIMEOUT = "timeout"  # past its deadline (load_timeout plus its bytes)
    STORE_ERROR = "store_error"
    BREAKER_OPEN = "breaker_open"
    INTERNAL_ERROR = "internal_error"  # an error of ours (logged with its traceback)
    BUSY = "busy"  # the load lane was full
    SHUTDOWN = "shutdown"  # the engine was stopping
    DISABLED = "disabled"  # the worker could not use the engine's caches


#: What the load lane's failures count as.
LOAD_FAILED = {Failure.STORE_ERROR: LoadFailure.STORE_ERROR, Failure.BREAKER_OPEN: LoadFailure.BREAKER_OPEN,
               Failure.INTERNAL_ERROR: LoadFailure.INTERNAL_ERROR, Failure.TIMEOUT: LoadFailure.TIMEOUT,
               Failure.FULL: LoadFailure.BUSY, Failure.CLOSED: LoadFailure.SHUTDOWN}


def failed_reads(reasons: set[str]) -> LoadFailure:
    """Why a load whose objects could not all be read failed (the vault counted each object's
    reason): one missing makes it ``missing``, else it is ``rejected``."""
    return LoadFailure.MISSING if "missing" in reasons else LoadFailure.REJECTED


def kept_before(spec: LoadSpec, bad: Sequence[ObjectRef], block_size: int) -> int:
    """The most tokens a load's request may still restore once the objects ``bad`` failed: a
    boundary short of the first KV block that failed (it needs none of it), and short of the
    load's own boundary if its state failed; never less than what the engine held."""
    cap = spec.tokens
    for r in bad:
        cap = min(cap, spec.tokens - 1 if r.kind is ObjectKind.STATE else r.block_index * block_size)
    return max(spec.local_tokens, cap)


def load_targets(ctx: WorkerContext, spec: LoadSpec) -> tuple[list[ObjectRef], list[int]] | None:
    """The objects a load reads on this worker's rank and the block each is written into (a
    state: the boundary's block); None if vLLM gave no block for one."""
    assert ctx.vault is not None
    bs = ctx.layout.block_size
    refs = ctx.vault.needed(spec.hashes, spec.tokens, ranks=[ctx.rank], since=spec.local_tokens,
                            salt=spec.salt)
    targets = []
    for r in refs:
        table = spec.block_ids[r.group]
        idx = (spec.tokens - 1) // bs if r.kind is ObjectKind.STATE else r.block_index
        block_id = table[idx] if idx < len(table) else 0
        if block_id == 0:
            log.warning("prefixvault: no block allocated for %s", r.key)
            return None
        targets.append(block_id)
    return refs, targets


class LoadState(Enum):
    QUEUED = "queued"  # waiting for the load lane, or being read from the store
    WRITING = "writing"  # its bytes are being written into the request's blocks
    DONE = "done"  # reported finished (loaded or failed)


@dataclass(eq=False, kw_only=True)
class LoadJob:
    """One request's load, from the engine's thread to the load lane. ``state`` changes only
    under the loads' lock: QUEUED -> WRITING -> DONE, or QUEUED -> DONE (failed, or past its
    deadline); a job DONE before its bytes are written never writes them."""

    spec: LoadSpec
    marks: Sequence[Any]  # per cache group: the engine's work the writes wait for
    state: LoadState = LoadState.QUEUED


class Measured:
    """Bytes loads wrote and the seconds they took, summed until taken (the workers' reports
    of what a restore costs: ``prefixvault.costs``). Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum = (0, 0.0)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._sum = (self._sum[0] + nbytes, self._sum[1] + seconds)

    def take(self) -> tuple[int, float]:
        """The sums since the last call."""
        with self._lock:
            out, self._sum = self._sum, (0, 0.0)
        return out


class Loads:
    """The load lane of one worker, and the loads finished since vLLM last asked."""

    def __init__(self, ctx: WorkerContext, *, load_timeout: float, wait_in_step: bool) -> None:
        """``load_timeout``: the fixed part of a load's deadline (its bytes add to it).
        ``wait_in_step``: ``take_finished`` waits for the loads queued since the last call up
        to ``IN_STEP_WAIT_S`` (``restore_in_step``)."""
        self._ctx = ctx
        self._load_timeout = load_timeout
        self._wait_in_step = wait_in_step
        self._lock = threading.Lock()  # the jobs' states, and the loads finished and failed
        self._landed = threading.Condition(self._lock)  # notified as each load ends
        self._finished: set[str] = set()  # since the last take_finished; the load lane adds to them
        self._failed: set[str] = set()
        # Failed loads since the last ``take_caps``, by request: the most tokens its next lookup
        # may restore, short of every object that failed (``LoadFailure`` decides which).
        self._caps: dict[str, int] = {}
        # With wait_in_step: loads queued since the last take_finished (the engine's thread only).
        self._step_loads: list[LoadJob] = []
        # Bytes written by loads and the seconds their batches took from the store call to the
        # last write: what a restore costs, for the scheduler's estimates.
        self.measured = Measured()
        self._bs = ctx.layout.block_size
        self.lane: Lane[LoadJob] = Lane("load", self._load_batch, self._fail_jobs, capacity=LOAD_QUEUE,
                                        guard=ctx.guard, on_start=ctx.caches.on_lane_thread)

    def queue(self, specs: Sequence[LoadSpec], marks: Sequence[Any]) -> None:
        """Queue loads on the load lane, each reported by ``take_finished`` once done; one the
        lane refuses is reported failed at once. Never raises: a load queued is reported by its
        job alone."""
        for spec in specs:
            job = LoadJob(spec=spec, marks=marks)
            if self._wait_in_step:
                self._step_loads.append(job)
            try:
                refused = self.lane.put(job, timeout=self.deadline(spec))
            except Exception as e:
                refused = report(self._ctx.guard, "load", e)
            if refused is not None:  # queue full, shutting down, or ours: recomputed
                self._end_load(job, False, LOAD_FAILED[refused])

    def deadline(self, spec: LoadSpec) -> float:
        """Seconds a load may take: ``load_timeout`` plus its bytes at ``LOAD_FLOOR_BYTES_PER_S``."""
        layout, rank = self._ctx.layout, self._ctx.rank
        blocks = max(0, spec.tokens - spec.local_tokens) // layout.block_size
        nbytes = sum(g.nbytes(rank) * (1 if g.is_state else blocks) for g in layout.groups)
        return self._load_timeout + nbytes / LOAD_FLOOR_BYTES_PER_S

    def fail(self, specs: Sequence[LoadSpec], reason: LoadFailure = LoadFailure.INTERNAL_ERROR) -> None:
        """Report loads that could not run (an error of ours, the worker off): vLLM recomputes them."""
        for spec in specs:
            self._end_load(LoadJob(spec=spec, marks=()), False, reason)

    def take_finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Loads finished (and of them, failed) since the last call; loads past their deadline
        are failed first. ``wait_in_step``: the loads queued since the last call are waited for
        up to ``IN_STEP_WAIT_S`` first. Else, in an ``idle`` step (no token computed) while a
        load runs, the engine's thread sleeps ``LOAD_YIELD_S``: an engine with nothing else to
        run spins through empty steps holding the interpreter lock, which the load lane then got
        back only at the 5 ms switch interval after each of its store and copy calls."""
        step, self._step_loads = self._step_loads, []
        if step:
            with self._lock:
                self._landed.wait_for(lambda: all(j.state is LoadState.DONE for j in step), IN_STEP_WAIT_S)
        elif idle and self.lane.busy:
            time.sleep(LOAD_YIELD_S)
        self._expire()
        with self._lock:
            done, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return done, failed

    def take_caps(self) -> dict[str, int]:
        """Requests whose loads failed since the last call, each with the most tokens its next
        lookup may restore (the scheduler asks the store for no deeper hit): a failed load
        never restarts at the depth that failed, only from the deepest boundary whose objects
        the load did not find wanting."""
        with self._lock:
            out, self._caps = self._caps, {}
        return out

    def close(self, drain_timeout: float) -> bool:
        """Drop the loads not started; wait for a running one (up to ``LOAD_DRAIN_S``). Whether
        the lane is idle: if not, it is still inside a store call."""
        return self.lane.close(min(LOAD_DRAIN_S, drain_timeout))

    # -- the load lane ----------------------------------------------------------------------------

    def _load_batch(self, jobs: list[LoadJob]) -> None:
        """On the load lane: every load queued by now read from the store in one batch (an
        object several loads need is read once), then each written into its request's blocks.
        A load whose objects cannot all be read fails alone; a store error fails the batch."""
        assert self._ctx.vault is not None
        wanted: list[tuple[LoadJob, list[ObjectRef], list[int]]] = []
        refs: dict[ObjectRef, None] = {}  # every object of the batch, once, in order
        for job in jobs:
            try:
                targets = load_targets(self._ctx, job.spec)
            except Exception as e:  # ours (a block table we misread): this load only
                self._end_load(job, False, LOAD_FAILED[report(self._ctx.guard, "load", e)])
                continue
            if targets is None:
                self._end_load(job, False, LoadFailure.NO_BLOCK)
                continue
            wanted.append((job, *targets))
            refs.update(dict.fromkeys(targets[0]))
        if not wanted:
            return
        t0, written = time.monotonic(), 0
        loaded = self._ctx.vault.load(list(refs), borrow=False)  # never memory the store lends the save path
        for job, job_refs, blocks in wanted:
            reasons = {loaded.failed[r] for r in job_refs if r in loaded.failed}
            if reasons:  # object by object, the vault counted why (``rejected{reason}``)
                bad = [r for r in job_refs if r in loaded.failed]
                self._end_load(job, False, failed_reads(reasons), keep=kept_before(job.spec, bad, self._bs))
                continue
            if not self._begin_write(job):
                continue  # past its deadline: already reported failed, its blocks are not ours
            try:
                self._ctx.caches.write(job_refs, [loaded.payloads[r] for r in job_refs], blocks, job.marks)
            except Exception as e:  # ours, or the device's: this load only
                self._end_load(job, False, LOAD_FAILED[report(self._ctx.guard, "load", e)])
                continue
            self._end_load(job, True)
            written += sum(len(loaded.payloads[r]) for r in job_refs)
        if written:
            self.measured.add(written, time.monotonic() - t0)

    def _fail_jobs(self, jobs: list[LoadJob], reason: Failure, error: BaseException | None) -> None:
        """Loads the lane could not finish (a store error, a shutdown): recomputed."""
        for job in jobs:
            self._end_load(job, False, LOAD_FAILED[reason])

    # -- a load's state ---------------------------------------------------------------------------

    def _begin_write(self, job: LoadJob) -> bool:
        with self._lock:
            if job.state is not LoadState.QUEUED:
                return False
            job.state = LoadState.WRITING
            return True

    def _end_load(self, job: LoadJob, ok: bool, reason: LoadFailure | None = None,
                  only: LoadState | None = None, keep: int | None = None) -> bool:
        """Report a load finished (once: a job already done is left as it is; with ``only``, a
        job in another state too, checked and changed in one hold of the lock); a failure is
        counted by ``reason``, and caps its request's next lookup at ``keep`` tokens (by
        default what the engine held before the load: no object of it was proved good).
        Whether this call reported it."""
        spec = job.spec
        with self._lock:
            if job.state is LoadState.DONE or (only is not None and job.state is not only):
                return False
            job.state = LoadState.DONE
            self._landed.notify_all()
            self._ctx.counters.add(loads=1)
            if ok:
                self._ctx.counters.add(loaded_tokens=spec.tokens - spec.local_tokens)
            else:
                self._ctx.counters.add(load_failures=1)
                self._ctx.counters.tally("failure_reasons", reason or LoadFailure.INTERNAL_ERROR)
                self._failed.add(spec.req_id)
                cap = spec.local_tokens if keep is None else keep
                self._caps[spec.req_id] = min(cap, self._caps.get(spec.req_id, cap))
            self._finished.add(spec.req_id)
        return True

    def _expire(self) -> None:
        """Loads past their deadline that have not started writing are reported failed now (vLLM
        recomputes them); their late bytes are never written. The store's breaker counts it: a
        store that hangs without an error is as unavailable as one that errs."""
        late = 0
        for job in self.lane.overdue():  # (one that started writing is left to land)
            if self._end_load(job, False, LoadFailure.TIMEOUT, only=LoadState.QUEUED):
                late += 1
        if late:
            log.warning("prefixvault: %d loads past their deadline: recomputed instead", late)
            store = self._ctx.vault.store if self._ctx.vault is not None else None
            if isinstance(store, BreakerStore):
                store.breaker.failure(f"{late} loads past their deadline")
