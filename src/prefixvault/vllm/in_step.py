"""Synchronous loads: a restore written before the forward of the step that restores it.

This module is the one owner of synchronous loads (``LoadMode.HANDED_OVER``,
``LoadMode.READ_IN_STEP``), both sides: the scheduler's (``InStepHandover``: the read-ahead
budget, finding the worker's mailbox, handing a load's bytes over before its hit is answered,
taking them back, naming the running state blocks) and the worker's (``InStepWrites``). An
asynchronous load is reported after the forward, so its request's first
chunk runs a step later; a synchronous one is written before the forward of the step that
schedules that chunk. vLLM has no way back from a failed synchronous load on a hybrid model
(0.32-0.34), so a load is synchronous only where it cannot fail on the store's side: the
lookup read and verified its objects ahead, and the scheduler handed them to the worker of its
own process through a ``Mailbox`` (``vllm/mailbox.py``).

The bytes read ahead for a hit (``ReadAhead``) count against ``ReadAheadBudget`` until let go
of: a request's restore holds them only while it is answered or handed over
(``vllm/request.py``). Where the mailbox cannot take them (shared memory full) the answer is
asynchronous: no synchronous load is ever promised without its bytes in hand.

The worker's side writes such a load in the engine's thread, from the objects handed over
under the load's token, each verified again first by the rules of every read (a byte changed
in the mailbox is refused as one changed in the store); objects not handed over after all (an
error of ours) or refused are read from the store on the in-step lane, which the engine's
thread waits for up to the load's deadline and no longer. Align mode's pre-copy ran before
``start_load_kv``, so the state also goes into every running block ``LoadSpec.state_copies``
names; a load naming none is refused. A load not written is reported as vLLM asks (``take_unloaded``, vLLM's
``get_block_ids_with_load_errors``): its blocks unloaded. vLLM then recomputes from the first,
or, on a model of several cache groups, stops rather than compute on a state never written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prefixvault.codec import IntegrityError, ObjectKind
from prefixvault.guard import Guard
from prefixvault.lane import Failure, Lane, report
from prefixvault.layout import CacheLayout
from prefixvault.vault import Loaded, ObjectRef
from prefixvault.vllm.compat import step_starts
from prefixvault.vllm.loads import LOAD_FAILED, LoadFailure, Measured, failed_reads, load_targets
from prefixvault.vllm.mailbox import Mailbox, Mailboxes, Objects
from prefixvault.vllm.metadata import LoadMode, LoadSpec
from prefixvault.vllm.worker_context import WorkerContext

log = logging.getLogger("vllm.prefixvault")

#: Bytes read ahead for synchronous loads that the scheduler holds at most, for requests not yet
#: allocated their blocks (past it, lookups do not read ahead: those restores load asynchronously).
READ_AHEAD_BYTES = 256 << 20


# -- the scheduler's side ---------------------------------------------------------------------------


class ReadAheadBudget:
    """Bytes read ahead and not yet handed to a worker or let go of, at most ``limit``: a hit
    whose objects would pass it is not read ahead (its load is asynchronous)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0  # under _lock (the lookup lane takes, the scheduler's thread gives back)
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self._held + n > self.limit:
                return False
            self._held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._held -= n

    @property
    def held(self) -> int:
        with self._lock:
            return self._held


@dataclass(kw_only=True, eq=False)
class ReadAhead:
    """The objects a lookup read and verified for its hit's load (rank 0), whole as stored (the
    worker verifies them again), counted in ``budget`` until ``release``d (once: a second
    release gives nothing back)."""

    objects: Mapping[ObjectRef, memoryview]
    nbytes: int
    budget: ReadAheadBudget
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.give(self.nbytes)


class InStepLoss(StrEnum):
    """Why a restore lost its synchronous load (it loads one step later): ``in_step_lost``."""

    HANDOVER_FAILED = "handover_failed"  # its bytes could not be written (shared memory full)
    MAILBOX_GONE = "mailbox_gone"  # the worker's mailbox disappeared (said once, when found gone)


class InStepHandover:
    """The scheduler's side of synchronous loads: whether lookups read ahead, handing a load's
    bytes to the worker's mailbox before the hit is answered, taking them back when vLLM does
    not allocate the load, and naming the running state blocks the load must also fill.

    ``budget`` is set for an engine of one rank with ``restore_in_step`` (None: every load is
    asynchronous); ``engine_id`` names the engine whose worker's mailbox is looked for
    (``Mailboxes.find``: in this process, or a child of it)."""

    def __init__(self, layout: CacheLayout, budget: ReadAheadBudget | None, engine_id: str | None,
                 lost: Callable[[InStepLoss], None] = lambda why: None) -> None:
        """``lost``: told each time a restore loses its synchronous load (counted)."""
        self.layout = layout
        self._lost = lost
        self.budget = budget
        self.engine_id = engine_id
        self.state_groups = [i for i, g in enumerate(layout.groups) if g.is_state]
        self._found = False  # a worker's mailbox was found once (its loss is then said, once)
        # The mailbox as last looked for, until the next step (``next_step``): looking for it
        # reads shared memory and ``/proc`` (a dozen system calls, each letting another thread
        # take the interpreter lock), which every ask of a step would otherwise repeat several
        # times. Invariant: a mailbox withdrawn since refuses a put (``OSError``: its directory
        # is gone, or ``MemoryMailbox`` was withdrawn), so a cached one never gets a load
        # promised synchronous that no worker takes; ``hand_over`` then looks again.
        self._cached: tuple[Mailbox | None] | None = None

    def next_step(self) -> None:
        """A new step is being asked about: the mailbox is looked for again, once."""
        self._cached = None

    def mailbox(self) -> Mailbox | None:
        if self._cached is None:
            self._cached = (self._find(),)
        return self._cached[0]

    def _find(self) -> Mailbox | None:
        """Look for the worker's mailbox; found gone after it was found, that is said once."""
        found = Mailboxes.find(self.engine_id)
        if found is not None:
            self._found = True
        elif self._found:
            self._found = False
            self._lost(InStepLoss.MAILBOX_GONE)
            log.warning("prefixvault: the worker's mailbox for synchronous loads is gone (the worker stopped "
                        "taking them, or its directory in shared memory was removed): restores load one "
                        "step later from now on")
        return found

    @property
    def held(self) -> int:
        """Bytes read ahead and held for requests not yet allocated their blocks."""
        return self.budget.held if self.budget is not None else 0

    def reads_ahead(self) -> bool:
        """Whether a lookup now also reads the objects of its hit, for a synchronous load."""
        return self.budget is not None and self.mailbox() is not None

    def hand_over(self, req_id: str, read_ahead: ReadAhead | None, refs: Sequence[ObjectRef],
                  step: int) -> int:
        """Hand the worker the bytes of a load whose objects are ``refs``, for the load of
        ``step``, if those read ahead hold every one of them and a worker takes them: the
        mailbox token (0: none handed over, the load is asynchronous)."""
        mailbox = self.mailbox()
        if read_ahead is None or mailbox is None or not all(r in read_ahead.objects for r in refs):
            return 0
        try:
            return mailbox.put(req_id, {r.key: read_ahead.objects[r] for r in refs}, step)
        except OSError as e:  # asynchronous: the mailbox withdrawn (gone), or shared memory full
            self._cached = None
            if self.mailbox() is not None:  # (gone: counted and said once, as ``mailbox_gone``)
                self._lost(InStepLoss.HANDOVER_FAILED)
                log.warning("prefixvault: request %s: its bytes could not be handed to the worker (%s); "
                            "it restores one step later", req_id, e)
            return 0

    def take_back(self, req_id: str) -> None:
        """Bytes handed over for a synchronous load vLLM did not allocate: out of the mailbox.
        (Between steps too, an abort say: it looks without keeping what it found for the next
        step's asks.)"""
        mailbox = self._cached[0] if self._cached is not None else Mailboxes.find(self.engine_id)
        if mailbox is not None:
            mailbox.drop(req_id)

    def name_state_copies(self, loads: list[LoadSpec], out: Any, guard: Guard) -> None:
        """Name, for each synchronous load of this step, every running state block its state
        must also be written into (``LoadSpec.state_copies``; an error here leaves the worker
        to find a running block unnamed and refuse the load)."""
        sync = [load for load in loads if load.in_step]
        if not (sync and self.state_groups):
            return
        none: dict[tuple[int, int], LoadSpec] = {}
        fills = guard.call("build_connector_meta", lambda: self._own_state_copies(sync, out), lambda: none)
        guard.call("build_connector_meta", lambda: self._other_state_copies(fills, out), lambda: None)

    def _own_state_copies(self, loads: list[LoadSpec], out: Any) -> dict[tuple[int, int], LoadSpec]:
        """Name, for each synchronous load, its request's running state block in each state
        group, from its own block table: align mode's pre-copy (from the state block at a
        request's start into the block at its chunk's end) runs before vLLM calls
        ``start_load_kv`` (0.32-0.34, both model runners), so the state is written there too
        (the worker refuses a load that names none). The state blocks the loads fill, by
        (group, block)."""
        bs = self.layout.block_size
        fills: dict[tuple[int, int], LoadSpec] = {}
        for load in loads:
            n = int(out.num_scheduled_tokens.get(load.req_id, 0))
            for g in self.state_groups:
                table = load.block_ids[g] if g < len(load.block_ids) else []
                hit, running = (load.tokens - 1) // bs, (load.tokens + n - 1) // bs
                # (a tail boundary's first chunk may end in its own block: then that block is
                # the running one, named as such)
                if n and running < len(table) and table[running]:
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
        bs = self.layout.block_size
        state = getattr(out, "kv_connector_block_state", None)
        new_tables = {r.req_id: r.block_ids for r in out.scheduled_new_reqs}
        starts = step_starts(out)
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


# -- the worker's side ------------------------------------------------------------------------------



@dataclass(eq=False)
class _Read:
    """Objects a synchronous load reads from the store in the step, on the in-step lane."""

    refs: Sequence[ObjectRef]
    done: threading.Event = field(default_factory=threading.Event)
    loaded: Loaded | None = None
    failure: Failure | None = None


class InStepWrites:
    """A worker's synchronous loads: written in the engine's thread, or reported unloaded.

    Every object is verified before it is written: handed over, by the rules of every read
    (``Vault.open_sealed``: a mailbox file changed since the scheduler wrote it is refused like
    a changed object in the store); objects not handed over, or refused, are read from the store
    on a lane of their own, which the engine's thread waits for only up to the load's deadline
    (``deadline``: ``load_timeout`` plus its bytes), never longer (a store stuck on a lock never
    holds the engine)."""

    def __init__(self, ctx: WorkerContext, deadline: Callable[[LoadSpec], float]) -> None:
        self._ctx = ctx
        self._deadline = deadline
        # Where the scheduler of this process hands the objects of synchronous loads (set by the
        # connector once the caches are registered; None: every synchronous load reads the store).
        self.mailbox: Mailbox | None = None
        # Blocks of synchronous loads not written since the last take_unloaded (the engine's
        # thread only).
        self._unloaded: set[int] = set()
        # Bytes written by synchronous loads and the seconds the engine's thread spent on them,
        # written or not (their step's, not its forward's; reading any not handed over too).
        self.measured = Measured()
        # One read at a time: one still stuck in the store past its deadline refuses the next
        # (``FULL``) rather than queue it behind.
        self.lane: Lane[_Read] = Lane("in_step", self._read_batch, self._fail_reads, capacity=1,
                                      guard=ctx.guard)

    def write(self, spec: LoadSpec, marks: Sequence[Any], step: int) -> None:
        """Write a synchronous load of ``step`` now, its state also into the running blocks its
        ``state_copies`` name, once the engine's work ``marks`` names ran. Never raises: one
        that cannot be written is reported unloaded. Its time in the step is measured either
        way (``measured``)."""
        t0 = time.monotonic()
        written = self._load(spec, marks, step)
        self.measured.add(written, time.monotonic() - t0)

    def _load(self, spec: LoadSpec, marks: Sequence[Any], step: int) -> int:
        """``write``'s work: the payload bytes written, 0 where the load was not."""
        try:
            handed = (self.mailbox.take(spec.req_id, spec.token, step)
                      if spec.mode is LoadMode.HANDED_OVER and self.mailbox is not None else None)
            targets = load_targets(self._ctx, spec) if spec.hashes else None
            if targets is None:
                self.unwritten(spec, LoadFailure.NO_BLOCK)
                return 0
            refs, blocks = targets
            named = {g for g, _ in spec.state_copies}
            if any(g.is_state and i not in named for i, g in enumerate(self._ctx.layout.groups)):
                raise RuntimeError(f"request {spec.req_id}: a synchronous load naming no running state block")
            payloads = self._open_handed_over(spec, refs, handed or {})
            missing = [r for r in refs if r not in payloads]
            if missing:
                failure = self._read(spec, missing, payloads)
                if failure is not None:
                    self.unwritten(spec, failure)
                    return 0
            self._write(spec, refs, blocks, payloads, marks)
        except Exception as e:
            ours = report(self._ctx.guard, "worker", e, f"request {spec.req_id}'s synchronous load")
            self.unwritten(spec, LoadFailure.INTERNAL_ERROR if ours is Failure.INTERNAL_ERROR
                           else LoadFailure.STORE_ERROR)
            return 0
        self._ctx.counters.add(loads=1, loads_in_step=1, loads_in_step_read=int(bool(missing)),
                               loaded_tokens=spec.tokens - spec.local_tokens)
        return sum(len(payloads[r]) for r in refs)

    def _open_handed_over(self, spec: LoadSpec, refs: Sequence[ObjectRef],
                          handed: Objects) -> dict[ObjectRef, memoryview]:
        """The payloads of the objects handed over that verify (each one refused is counted
        under ``rejected{reason}`` and read from the store instead)."""
        assert self._ctx.vault is not None
        payloads: dict[ObjectRef, memoryview] = {}
        for ref in refs:
            data = handed.get(ref.key)
            if data is None:
                continue
            try:
                payloads[ref] = self._ctx.vault.open_sealed(ref, data)
            except IntegrityError as e:
                log.warning("prefixvault: request %s: an object handed over for its synchronous load does "
                            "not verify (%s); it is read from the store", spec.req_id, e.reason)
        return payloads

    def _read(self, spec: LoadSpec, refs: Sequence[ObjectRef],
              payloads: dict[ObjectRef, memoryview]) -> LoadFailure | None:
        """Read ``refs`` from the store into ``payloads``, waiting up to the load's deadline;
        why not, if they could not all be."""
        job = _Read(refs)
        refused = self.lane.put(job)
        if refused is not None:
            return LOAD_FAILED[refused]
        if not job.done.wait(self._deadline(spec)):
            log.warning("prefixvault: request %s: the store did not answer its synchronous load within "
                        "%.1f s", spec.req_id, self._deadline(spec))
            return LoadFailure.TIMEOUT  # (its late bytes are never written: the job is let go)
        if job.failure is not None:
            return LOAD_FAILED[job.failure]
        assert job.loaded is not None
        if job.loaded.failed:
            return failed_reads(set(job.loaded.failed.values()))
        payloads.update(job.loaded.payloads)
        return None

    def _read_batch(self, jobs: list[_Read]) -> None:
        assert self._ctx.vault is not None
        for job in jobs:
            job.loaded = self._ctx.vault.load(job.refs, borrow=False)
            job.done.set()

    def _fail_reads(self, jobs: list[_Read], reason: Failure, error: BaseException | None) -> None:
        for job in jobs:
            if not job.done.is_set():
                job.failure = reason
                job.done.set()

    def close(self, timeout: float) -> bool:
        """Whether the in-step lane is idle (if not, a read is still inside a store call)."""
        return self.lane.close(timeout)

    def _write(self, spec: LoadSpec, refs: Sequence[ObjectRef], blocks: Sequence[int],
               payloads: Mapping[ObjectRef, memoryview], marks: Sequence[Any]) -> None:
        """Each object into its block, and a state also into the running blocks named for its group."""
        all_refs, all_blocks, data = [], [], []
        for ref, block in zip(refs, blocks, strict=True):
            state = ref.kind is ObjectKind.STATE
            extra = [b for g, b in spec.state_copies if g == ref.group] if state else []
            for b in dict.fromkeys([block, *extra]):  # (the running block may be the boundary's own)
                all_refs.append(ref)
                all_blocks.append(b)
                data.append(payloads[ref])
        self._ctx.caches.write(all_refs, data, all_blocks, marks)

    def unwritten(self, spec: LoadSpec, reason: LoadFailure) -> None:
        """A synchronous load not written: its blocks are reported unloaded (vLLM recomputes
        from the first, or, for a model of several cache groups, stops: 0.32-0.34 cannot
        recompute those, and a forward on a state never written would be wrong)."""
        if self.mailbox is not None:
            self.mailbox.drop(spec.req_id)  # (handed over for this load, if at all: taken by none)
        bs = self._ctx.layout.block_size
        for g, table in enumerate(spec.block_ids):
            last = (spec.tokens - 1) // bs
            first = last if self._ctx.layout.groups[g].is_state else spec.local_tokens // bs
            self._unloaded.update(b for b in table[first : last + 1] if b)
        self._ctx.counters.add(loads=1, load_failures=1)
        self._ctx.counters.tally("failure_reasons", reason.value)
        log.error("prefixvault: request %s: its synchronous load could not be written (%s); reported to "
                  "vLLM as unloaded blocks", spec.req_id, reason.value)

    def take_unloaded(self) -> set[int]:
        """Blocks of synchronous loads not written since the last call (vLLM's
        ``get_block_ids_with_load_errors``)."""
        out, self._unloaded = self._unloaded, set()
        return out
