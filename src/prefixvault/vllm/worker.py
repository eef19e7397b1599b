"""Worker side of the connector: gather objects out of vLLM's cache tensors, scatter them back.

One worker per tensor-parallel rank. Saves are copied, in ``wait_for_save`` right after the
forward that computed them, out of the engine's blocks into staging memory (a block may be
reused by the next step); the save lane (``prefixvault.lane``) then stores the objects
and publishes the records, every save queued by then as one batch, while the engine goes on.
Staging is a fixed budget: a save that does not fit is dropped and counted, never waited for.
Each save, stored or dropped, is reported back to the scheduler (``take_settled``), which holds
lookups of a prefix whose save is in flight.
Loads are handed, in ``start_load_kv``, to the load lane, which reads every load queued by then
from the store in one batch (an object two loads need is read once), verifies the objects and
writes them into each request's blocks while the engine goes on with other requests; the request
is reported finished (``get_finished``) only after its objects landed, and vLLM schedules its
first chunk only then. Its blocks are fresh (vLLM caches them only once loaded), so nothing else
reads or writes them meanwhile. Each load has a deadline scaled to its bytes (``load_timeout``
plus ``LOAD_FLOOR_BYTES_PER_S``): past it the load is reported failed (vLLM recomputes it), its
late bytes are never written, and the store's breaker counts a failure. Over a local store
(``restore_in_step``) ``get_finished`` waits for the step's loads up to ``IN_STEP_WAIT_S``:
one that lands by then is reported in the step it was planned in, and its first chunk runs in
the next (waiting, the engine's thread leaves the load lane the interpreter lock).

A held save (``output_boundaries: last``) copies only its states, into a slot of its own that
the request's next held save reuses; when the request finishes, its KV blocks (kept by vLLM
until this worker reports the request sent) are staged beside the held states and the save
goes to the save lane as any other.

Memory on a CUDA engine, all allocated when the caches are registered (vLLM has sized its KV
cache by then: an allocation that fails shows at start, and nothing grows later): the copy
buffers of ``prefixvault.blockio`` (``DEVICE_BUFFER_BYTES`` per direction, shared by the
groups), the pinned save staging (``save_staging_mib``) and one pinned load buffer of
``LOAD_STAGING_BYTES`` (32 MiB, or one object of the largest group where that is larger),
reused by every load: a load larger than it is written in pieces.

A worker whose caches cannot be used (``register_kv_caches`` raised) is ``disable``d by the
connector: every load fails at once (vLLM recomputes), every save is settled unpublished, every
held request is reported sent, and no cache tensor is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import numpy as np

from prefixvault.blockio import Done, GroupIO
from prefixvault.boundary import Refusal
from prefixvault.codec import ObjectKind
from prefixvault.counters import Counters
from prefixvault.guard import Guard
from prefixvault.lane import Failure, Lane
from prefixvault.layout import CacheLayout
from prefixvault.staging import Reservation, SlotPool, StagingRing
from prefixvault.stores.base import StoreError
from prefixvault.stores.breaker import BreakerOpen, BreakerStore
from prefixvault.vault import ObjectRef, RankAck, Vault
from prefixvault.vllm.config import IN_STEP_WAIT_S
from prefixvault.vllm.kernel_blocks import group_ios
from prefixvault.vllm.mailbox import Mailbox
from prefixvault.vllm.metadata import LoadMode, LoadSpec, Release, SaveSpec, save_id

log = logging.getLogger("vllm.prefixvault")

#: Pinned host memory one worker keeps for loads into CUDA caches (a larger load goes in pieces).
LOAD_STAGING_BYTES = 32 << 20
#: How long a stopping worker waits for a load already running (loads queued are dropped: the
#: engine they were for is stopping).
LOAD_DRAIN_S = 5.0
#: How long the engine's thread sleeps in a step that computes nothing while a load runs beside
#: it (``take_finished``).
LOAD_YIELD_S = 0.0005
#: A load's deadline is ``load_timeout`` plus its bytes at this rate (a store slower than this
#: is no faster than recomputing on any engine worth restoring for).
LOAD_FLOOR_BYTES_PER_S = 64 << 20
#: Jobs a lane queues at most; past it a save is dropped, a load fails at once (recomputed).
SAVE_QUEUE = 4096
LOAD_QUEUE = 4096


class SaveDrop(StrEnum):
    """Why a save was not stored (``save_dropped``); a store's failure is a ``save_error``."""

    STAGING_FULL = "staging_full"  # more bytes wait for the store than save_staging_mib holds
    TOO_LARGE = "too_large"  # one save is larger than save_staging_mib
    HOLD_FULL = "hold_full"  # every save_hold_mib slot is held by a decoding request
    HOLD_TOO_LARGE = "hold_too_large"  # one boundary's states are larger than save_hold_mib
    QUEUE_FULL = "queue_full"  # the save lane holds SAVE_QUEUE saves already
    SHUTDOWN = "shutdown"  # still queued when the engine stopped (save_drain_timeout)


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


#: What the save and load lanes' failures count as.
SAVE_DROPPED = {Failure.FULL: SaveDrop.QUEUE_FULL, Failure.CLOSED: SaveDrop.SHUTDOWN,
                Failure.TIMEOUT: SaveDrop.SHUTDOWN}
LOAD_FAILED = {Failure.STORE_ERROR: LoadFailure.STORE_ERROR, Failure.BREAKER_OPEN: LoadFailure.BREAKER_OPEN,
               Failure.INTERNAL_ERROR: LoadFailure.INTERNAL_ERROR, Failure.TIMEOUT: LoadFailure.TIMEOUT,
               Failure.FULL: LoadFailure.BUSY, Failure.CLOSED: LoadFailure.SHUTDOWN}

#: A save's objects copied into staging: its reservation, payloads by key, copies in flight.
Staged = tuple[Reservation, dict[str, memoryview], list[Done]]


@dataclass(frozen=True)
class StagedSave:
    """A save handed to the save lane: its staging goes back (and its hold slot, if any) once
    it is stored or dropped, and it is settled either way."""

    sid: str
    spec: SaveSpec
    reservation: Reservation
    payloads: dict[str, memoryview]
    copies: list[Done]
    slot: int | None


class LoadState(Enum):
    QUEUED = "queued"  # waiting for the load lane, or being read from the store
    WRITING = "writing"  # its bytes are being written into the request's blocks
    DONE = "done"  # reported finished (loaded or failed)


@dataclass(eq=False)
class LoadJob:
    """One request's load on the load lane. ``state`` changes only under the worker's lock:
    QUEUED -> WRITING -> DONE, or QUEUED -> DONE (failed, or past its deadline); a job DONE
    before its bytes are written never writes them."""

    spec: LoadSpec
    marks: Sequence[Any]  # per cache group: the engine's work the writes wait for
    state: LoadState = LoadState.QUEUED


@dataclass
class WorkerCounters(Counters):
    """What a worker did (the engine's thread, the save and load lanes all count here)."""

    saved_boundaries: int = 0
    published: int = 0
    save_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_tokens: int = 0
    loads_in_step: int = 0  # synchronous loads written (``vllm/mailbox.py``), among ``loads``
    loads_in_step_read: int = 0  # of those, read from the store in the step (not handed over)
    failure_reasons: dict[str, int] = field(default_factory=dict)  # failed loads, by ``LoadFailure``
    save_dropped: dict[str, int] = field(default_factory=dict)  # saves not stored, by ``SaveDrop``


class WorkerSide:
    def __init__(
        self, layout: CacheLayout, vault: Vault | None, rank: int, layer_groups: Sequence[Sequence[str]],
        staging_bytes: int = 0, drain_timeout: float = 30.0, hold_bytes: int = 0,
        num_blocks: int | None = None, guard: Guard | None = None, load_timeout: float = 5.0,
        load_in_step: bool = False,
    ) -> None:
        """``num_blocks``: the engine's manager blocks (``KVCacheConfig.num_blocks``); a layer
        with more (kernel blocks) is viewed as that many manager blocks. ``guard``: where errors
        of ours (not the store's) are counted and logged, the connector's own. ``load_timeout``:
        the fixed part of a load's deadline (its bytes add to it). ``load_in_step``:
        ``take_finished`` waits for the loads queued since the last call up to
        ``IN_STEP_WAIT_S`` (``restore_in_step``)."""
        self.guard = guard or Guard()
        self.layout = layout
        self.vault = vault
        self.rank = rank
        self.layer_groups = [list(g) for g in layer_groups]
        self._io: list[GroupIO] = []  # per cache group: copies between its layers' blocks and host bytes
        self._finished_loads: set[str] = set()  # guarded by _lock (the load lane adds to them)
        self._failed_loads: set[str] = set()
        # Saves settled since the last report, with whether every boundary was published (a
        # save dropped or failed is not: the scheduler then plans the next one from further
        # back); under _lock.
        self._settled: list[tuple[str, bool]] = []
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # notified as each load ends
        self.num_blocks = num_blocks
        self._disabled: str | None = None  # why the worker touches no cache tensor (``disable``)
        self._cuda_device: Any = None  # the caches' CUDA device, once registered
        # Loads into CUDA caches go through this pinned buffer, one load at a time (under the lock).
        self._load_host: Any = None
        self._load_lock = threading.Lock()
        self._load_timeout = load_timeout
        self._load_in_step = load_in_step
        # Where the scheduler of this process hands the payloads of synchronous loads (set by the
        # connector once the caches are registered), and the blocks of those that could not be
        # written, for vLLM (``take_unloaded``; the engine's thread only).
        self.handoff: Mailbox | None = None
        self._unloaded: set[int] = set()
        # With load_in_step: loads queued since the last take_finished (the engine's thread only).
        self._step_loads: list[LoadJob] = []
        self._loads: Lane[LoadJob] = Lane("load", self._load_batch, self._fail_load_jobs, capacity=LOAD_QUEUE,
                                          guard=self.guard, on_start=self._on_lane_thread)
        # No staging budget: saves are stored in the step, as they are copied. Allocated once the
        # cache tensors are known (pinned host memory, for a device's copies to overlap).
        self._staging_bytes = staging_bytes if vault is not None else 0
        self._staging: StagingRing | None = None
        self._saves: Lane[StagedSave] = Lane("save", self._store_batch, self._drop_saves, capacity=SAVE_QUEUE,
                                             guard=self.guard, on_start=self._on_lane_thread)
        # Held saves by request: (spec, slot, the held states' payloads by key). Only the
        # engine's thread (save, release) touches it; slots go back from the save lane.
        self._hold_bytes = hold_bytes if vault is not None else 0
        self._holds: SlotPool | None = None
        self._held: dict[str, tuple[SaveSpec, int | None, dict[str, memoryview]]] = {}
        self._sent: set[str] = set()  # requests whose held save's blocks were read; under _lock
        self._drain_timeout = drain_timeout
        self.counters = WorkerCounters()

    def close(self) -> bool:
        """Store the saves still queued (up to ``drain_timeout``; those left are dropped), drop
        the loads not started, wait for a running one (up to ``LOAD_DRAIN_S``). Returns whether
        both lanes are idle: if not, one is still inside a store call, and the store must stay
        open under it (the caller closes it only when every side drained)."""
        if self._saves.busy:
            log.info("prefixvault: storing the queued saves before shutting down (up to %.0f s)",
                     self._drain_timeout)
        saves_done = self._saves.close(self._drain_timeout, drop_queued=False)
        if not saves_done:
            log.warning("prefixvault: saves not stored at shutdown (save_drain_timeout %.0f s): the "
                        "store did not answer in time", self._drain_timeout)
        loads_done = self._loads.close(min(LOAD_DRAIN_S, self._drain_timeout))
        return saves_done and loads_done

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Block I/O for every cache group, checked against the layout, and the memory the
        copies use. Raises one ``ValueError`` if the caches cannot be used; the worker then
        holds nothing of them and can be ``disable``d."""
        self._io = []
        try:
            self._register(kv_caches)
        except ValueError:
            self._io, self._load_host, self._cuda_device = [], None, None
            raise
        except Exception as e:  # e.g. no memory left for a buffer: one clear error all the same
            self._io, self._load_host, self._cuda_device = [], None, None
            raise ValueError(f"prefixvault: cannot use the engine's cache tensors: {e!r}") from e

    def _register(self, kv_caches: dict[str, Any]) -> None:
        import torch

        ios = group_ios(kv_caches, self.layer_groups, self.num_blocks)
        if len(ios) != len(self.layout.groups):
            raise ValueError(f"prefixvault: {len(ios)} cache groups registered, layout has "
                             f"{len(self.layout.groups)}")
        for gi, io in enumerate(ios):
            expected = self.layout.groups[gi].nbytes(self.rank)
            if io.object_bytes != expected:
                raise ValueError(f"prefixvault: cache group {gi} has {io.object_bytes} bytes per block on "
                                 f"rank {self.rank}, layout says {expected}")
        cuda = [io for io in ios if io.device.type == "cuda"]
        if cuda:
            size = max([LOAD_STAGING_BYTES, *(io.object_bytes for io in cuda)])
            self._load_host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._cuda_device = cuda[0].device
        if self._staging_bytes and self._staging is None:
            buf = torch.empty(self._staging_bytes, dtype=torch.uint8, pin_memory=bool(cuda)).numpy()
            self._staging = StagingRing(self._staging_bytes, buf)
        slot = sum(io.object_bytes for g, io in enumerate(ios) if self.layout.groups[g].is_state)
        if self._hold_bytes and slot and self._holds is None:
            if self._hold_bytes < slot:
                log.warning("prefixvault: one boundary's states (%d bytes) do not fit save_hold_mib (%d "
                            "bytes): no output boundary is stored; raise it", slot, self._hold_bytes)
            else:
                self._holds = SlotPool(slot, self._hold_bytes // slot)
        self._io = ios

    def _on_lane_thread(self) -> None:
        """A lane's thread works on the caches' device: a thread that never chose one would
        open a context on device 0 in every tensor-parallel rank (outside vLLM's budget)."""
        if self._cuda_device is None:
            return
        try:
            import torch

            torch.cuda.set_device(self._cuda_device)
        except Exception as e:  # the copies still name their device explicitly
            log.warning("prefixvault: a worker thread could not select %s: %s", self._cuda_device, e)

    def disable(self, reason: str) -> None:
        """Stop touching the engine's caches (they could not be registered, say): from now on
        every load fails at once, every save is settled unpublished, every held request is
        reported sent. Saves already staged are still stored."""
        if self._disabled is None:
            log.warning("prefixvault: worker off (%s): loads are recomputed, nothing is saved", reason)
        self._disabled = reason
        self._io = []
        self._load_host = None

    @property
    def disabled(self) -> str | None:
        """Why the worker is off, or None."""
        return self._disabled

    # -- save -------------------------------------------------------------------------------------

    def _gather(self, ref: ObjectRef, block_id: int) -> memoryview:
        out = np.empty(self._io[ref.group].object_bytes, np.uint8)
        self._gather_into(ref, block_id, out.data)
        return out.data

    def _gather_into(self, ref: ObjectRef, block_id: int, dest: memoryview) -> None:
        """Copy one object's payload out of the engine's blocks into ``dest``."""
        self._io[ref.group].gather([block_id], _host(dest, 1)).wait()

    def step(self, saves: Sequence[SaveSpec], releases: Sequence[Release], step: int) -> None:
        """One step's work: first the finished requests' held saves (a request preempted and
        computed again may drop its old hold and hold anew in the same step), then the saves."""
        if self._disabled is not None:
            self.fail_releases(releases, step)  # held requests reported sent, their saves settled
            for spec in saves:
                if not spec.hold:  # a hold is settled when its request is released
                    self._settle(save_id(step, spec.req_id), False)
            return
        if releases:
            try:
                self.release(releases, step)
            except Exception as e:  # every stored one is still reported sent
                self._failed("releasing held saves", e)
                self.counters.add(save_errors=1)
                self.fail_releases(releases, step)
        if saves:
            self.save(saves, step)

    def save(self, specs: Sequence[SaveSpec], step: int = 0) -> None:
        """Copy this step's saves out of the engine's blocks; store them on the save lane
        (or here, without a staging budget). Every save is settled, whatever happens to it."""
        if self.vault is None:
            return
        for spec in specs:
            sid = save_id(step, spec.req_id)
            try:
                if spec.hold:  # nothing is stored, nor settled, until its request finishes
                    self._hold(spec)
                    continue
                if not self._staging_bytes:
                    self._settle(sid, self._store(spec, self._gather, self._gather_into))
                    continue
                staged = self._stage(spec)
            except Exception as e:  # one save's error of ours costs that save only
                self._failed(f"staging the save of request {spec.req_id}", e)
                self.counters.add(save_errors=1)
                self._settle(sid, False)
                continue
            if staged is None:
                self._settle(sid, False)
                continue
            self._enqueue(sid, spec, staged, None)

    def _enqueue(self, sid: str, spec: SaveSpec, staged: Staged, slot: int | None) -> None:
        """Hand a staged save to the save lane (which gives ``slot`` back once it is stored)."""
        job = StagedSave(sid, spec, *staged, slot)
        refused = self._saves.put(job)
        if refused is not None:  # queue full, or shutting down: nothing will store it
            self._drop_saves([job], refused, None)

    def _give(self, slot: int | None) -> None:
        if slot is not None and self._holds is not None:
            self._holds.give(slot)

    # -- held saves (output_boundaries: last) ---------------------------------------------------

    def _hold(self, spec: SaveSpec) -> None:
        """Copy a held save's states into the request's slot (taking one if it has none); its
        earlier hold is replaced. No slot free: the earlier hold, if any, stays."""
        assert self.vault is not None
        objects, _ = self.vault.objects_of(self.rank, spec.hashes, spec.plans)
        states = [(ref, b) for ref, b in objects if ref.kind is ObjectKind.STATE]
        old = self._held.get(spec.req_id)
        slot = old[1] if old is not None else None
        if states and slot is None:
            slot = self._holds.take() if self._holds is not None else None
            if slot is None:
                self.counters.tally("save_dropped",
                                    SaveDrop.HOLD_FULL if self._holds else SaveDrop.HOLD_TOO_LARGE)
                return
        held: dict[str, memoryview] = {}
        try:
            if states:
                assert self._holds is not None and slot is not None
                view, off = self._holds.view(slot), 0
                for ref, block_id in states:
                    size = self._io[ref.group].object_bytes
                    if off + size > len(view):
                        raise ValueError("a held save has more states than one boundary's")
                    self._gather_into(ref, block_id, view[off : off + size])
                    held[ref.key] = view[off : off + size]
                    off += size
        except BaseException:  # the slot may hold half of two boundaries: drop the hold
            self._held.pop(spec.req_id, None)
            self._give(slot)
            raise
        self._held[spec.req_id] = (spec, slot, held)

    def release(self, releases: Sequence[Release], step: int) -> None:
        """Store (``Release.store``) or drop the finished requests' held saves. A stored one's
        KV blocks are copied out now and the request is reported sent (vLLM frees its blocks),
        whatever happens to the save."""
        for rel in releases:
            entry = self._held.pop(rel.req_id, None)
            if not rel.store:
                if entry is not None:
                    self._give(entry[1])
                continue
            sid = save_id(step, rel.req_id)
            try:
                if entry is None:  # its hold was dropped when made (no slot)
                    self._settle(sid, False)
                else:
                    self._store_held(sid, *entry)
            except Exception as e:  # one save's error costs that save only
                self._failed(f"storing the held save of request {rel.req_id}", e)
                self.counters.add(save_errors=1)
                self._settle(sid, False)
            finally:
                with self._lock:
                    self._sent.add(rel.req_id)

    def _store_held(self, sid: str, spec: SaveSpec, slot: int | None, held: dict[str, memoryview]) -> None:
        """Stage (or, without staging, store) a held save: its KV blocks from the engine, its
        states from the slot, which goes back once the save is stored."""
        spec = dataclasses.replace(spec, hold=False)
        if not self._staging_bytes:
            def read(ref: ObjectRef, block_id: int) -> memoryview:
                return held[ref.key] if ref.key in held else self._gather(ref, block_id)

            def read_into(ref: ObjectRef, block_id: int, dest: memoryview) -> None:
                if ref.key in held:
                    dest[:] = held[ref.key]
                else:
                    self._gather_into(ref, block_id, dest)
            try:
                self._settle(sid, self._store(spec, read, read_into))
            finally:
                self._give(slot)
            return
        try:
            staged = self._stage(spec, held)
        except BaseException:
            self._give(slot)
            raise
        if staged is None:
            self._give(slot)
            self._settle(sid, False)
            return
        try:
            for c in staged[2]:
                c.wait()  # the blocks are freed once this request is reported sent
        except BaseException:
            for c in staged[2]:
                with contextlib.suppress(Exception):
                    c.wait()  # never hand back memory a copy may still write
            assert self._staging is not None
            self._staging.release(staged[0])
            self._give(slot)
            raise
        self._enqueue(sid, spec, staged, slot)

    def fail_releases(self, releases: Sequence[Release], step: int) -> None:
        """After an error of ours in ``release``: drop the held saves left; every request to
        store is still reported sent (its blocks must be freed) and its save settled."""
        for rel in releases:
            entry = self._held.pop(rel.req_id, None)
            if entry is not None:
                self._give(entry[1])
            if rel.store:
                with self._lock:
                    done = rel.req_id in self._sent
                if not done:
                    self._settle(save_id(step, rel.req_id), False)
                    with self._lock:
                        self._sent.add(rel.req_id)

    def take_sent(self) -> set[str]:
        """Requests whose held saves' blocks were read since the last call (vLLM frees them)."""
        with self._lock:
            out, self._sent = self._sent, set()
        return out

    def _stage(self, spec: SaveSpec, held: dict[str, memoryview] | None = None) -> Staged | None:
        """The spec's objects copied into one staging reservation, one gather per cache
        group (on a device, still in flight: wait for each ``Done``); None if dropped.
        Objects in ``held`` are not copied: their payloads are the held bytes."""
        assert self.vault is not None and self._staging is not None
        objects, _ = self.vault.objects_of(self.rank, spec.hashes, spec.plans)
        by_group: dict[int, list[tuple[ObjectRef, int]]] = {}
        payloads: dict[str, memoryview] = {}
        for ref, block_id in objects:
            if held is not None and ref.key in held:
                payloads[ref.key] = held[ref.key]
            else:
                by_group.setdefault(ref.group, []).append((ref, block_id))
        total = sum(len(objs) * self._io[g].object_bytes for g, objs in by_group.items())
        if not total:  # nothing to copy (records only): no staging, nothing to hand back
            return Reservation(0, 0, memoryview(b""), released=True), payloads, []
        r = self._staging.reserve(total)
        if r is None:
            reason = SaveDrop.TOO_LARGE if total > self._staging.capacity else SaveDrop.STAGING_FULL
            if reason is SaveDrop.TOO_LARGE and not self.counters.save_dropped.get(reason):
                log.warning("prefixvault: a save of %d bytes does not fit save_staging_mib (%d bytes): "
                            "raise it, or such saves are never stored", total, self._staging.capacity)
            self.counters.tally("save_dropped", reason)
            return None
        copies: list[Done] = []
        off = 0
        try:
            for g, objs in by_group.items():
                size = self._io[g].object_bytes
                region = r.view[off : off + len(objs) * size]
                copies.append(self._io[g].gather([b for _, b in objs], _host(region, len(objs))))
                for j, (ref, _) in enumerate(objs):
                    payloads[ref.key] = region[j * size : (j + 1) * size]
                off += len(objs) * size
        except BaseException:
            for c in copies:
                c.wait()  # never hand back memory a copy may still write
            self._staging.release(r)
            raise
        return r, payloads, copies

    def _store_batch(self, batch: list[StagedSave]) -> None:
        """On the save lane: store every save queued by now as one batch (one existence check
        and one put for all their objects: a slow store is not paid per save), publish them
        together (``Vault.publish_many``), then give their staging back. An error raised here
        resolves nothing: the lane drops the batch (``_drop_saves``)."""
        assert self.vault is not None
        payloads: dict[str, memoryview] = {}
        for job in batch:
            for c in job.copies:
                c.wait()
            payloads.update(job.payloads)
        specs = [job.spec for job in batch]
        all_acks = self.vault.save_many(self.rank, [(s.hashes, s.plans) for s in specs],
                                        lambda ref, _block: payloads[ref.key])
        self._finish_saves(batch, self._publish(specs, all_acks, raise_store_errors=True))

    def _drop_saves(self, batch: list[StagedSave], reason: Failure, error: BaseException | None) -> None:
        """Saves the lane could not store: counted (an error, or dropped for the queue or the
        shutdown), their memory given back, settled unpublished."""
        if reason in (Failure.STORE_ERROR, Failure.BREAKER_OPEN, Failure.INTERNAL_ERROR):
            self.counters.add(save_errors=len(batch))
        else:
            self.counters.tally("save_dropped", SAVE_DROPPED[reason].value, len(batch))
        self._finish_saves(batch, [False] * len(batch))

    def _finish_saves(self, batch: Sequence[StagedSave], outcomes: Sequence[bool]) -> None:
        """Give each save's memory back and settle it, once. Never raises (the lane would then
        drop the batch and settle it again): an error of ours here costs that save's memory."""
        assert self._staging is not None
        for job, ok in zip(batch, outcomes, strict=True):
            try:
                for c in job.copies:
                    with contextlib.suppress(Exception):
                        c.wait()  # never hand back memory a copy may still write
                self._staging.release(job.reservation)
                self._give(job.slot)
            except Exception as e:
                self.guard.failed("save", e)
            finally:
                self._settle(job.sid, ok)

    def _store(self, spec: SaveSpec, read: Any, read_into: Any) -> bool:
        assert self.vault is not None
        try:
            acks = self.vault.save(self.rank, spec.hashes, spec.plans, read, read_into)
        except Exception as e:  # a store problem costs future hits, never this request
            self.counters.add(save_errors=1)
            self._failed(f"the save of request {spec.req_id}", e)
            return False
        return self._publish([spec], [acks])[0]

    def _publish(self, specs: Sequence[SaveSpec], all_acks: Sequence[Sequence[RankAck]],
                 raise_store_errors: bool = False) -> list[bool]:
        """Publish these saves' boundaries together; whether each save's are all published now.
        An error is counted and logged here, or raised (``raise_store_errors``: on a lane, which
        sorts and counts it)."""
        assert self.vault is not None
        for acks in all_acks:
            self.counters.add(save_errors=sum(not a.ok for a in acks))
            self.counters.add(saved_boundaries=sum(a.ok for a in acks))
        try:
            outcomes = self.vault.publish_many([(spec.hashes, acks, spec.parent)
                                                for spec, acks in zip(specs, all_acks, strict=True)])
        except Exception as e:  # a store problem costs future hits, never a request
            if raise_store_errors:
                raise
            self.counters.add(save_errors=len(specs))
            self._failed(f"publishing {len(specs)} saves (first: request "
                         f"{specs[0].req_id if specs else '-'})", e)
            return [False] * len(specs)
        done = []
        for results in outcomes:
            self.counters.add(published=sum(why is None for why in results.values()))
            # MISSING_RANK: another rank has not stored its objects yet; the last one to
            # finish publishes (Vault.publish), so this rank's part is done.
            fine = all(why in (None, Refusal.MISSING_RANK) for why in results.values())
            done.append(bool(results) and fine)
        return done

    def _settle(self, sid: str, published: bool) -> None:
        with self._lock:
            self._settled.append((sid, published))

    def take_settled(self) -> list[tuple[str, bool]]:
        """Saves stored or dropped since the last call: (``save_id``, all published)."""
        with self._lock:
            out, self._settled = self._settled, []
        return out

    # -- load -------------------------------------------------------------------------------------

    def load(self, specs: Sequence[LoadSpec], step: int = 0) -> None:
        """Write the synchronous loads of ``step`` now, from the payloads the scheduler handed
        over (vLLM calls this before the step's forward when it has any); queue the others on
        the load lane, each reported by ``take_finished`` once done. On a device, the writes
        wait for the engine's work queued by now (``GroupIO.mark``)."""
        in_step = [s for s in specs if s.in_step]
        specs = [s for s in specs if not s.in_step]
        if self._disabled is not None:
            for spec in in_step:
                self._unwritten(spec, LoadFailure.DISABLED)
            self.fail_loads(specs, LoadFailure.DISABLED)
            return
        try:
            marks = [io.mark() for io in self._io]  # (raises before any load is queued)
        except Exception:
            for spec in in_step:
                self._unwritten(spec, LoadFailure.INTERNAL_ERROR)
            raise
        for spec in in_step:
            self._write_in_step(LoadJob(spec, marks), step)
        for spec in specs:
            job = LoadJob(spec, marks)
            if self._load_in_step:
                self._step_loads.append(job)
            try:  # never raises past here: a load queued is reported by its job alone
                refused = self._loads.put(job, timeout=self.load_deadline(spec))
            except Exception as e:
                self.guard.failed("load", e)
                refused = Failure.INTERNAL_ERROR
            if refused is not None:  # queue full, shutting down, or ours: recomputed
                self._end_load(job, False, LOAD_FAILED[refused])

    def _write_in_step(self, job: LoadJob, step: int) -> None:
        """Write a synchronous load in the engine's thread, its state also into the running
        blocks its ``state_copies`` name, from the payloads the scheduler handed over (read and
        verified by its lookup); bytes not handed over are read from the store here (a local
        store: a copy). Never raises: one that cannot be written is reported as vLLM asks, its
        blocks unloaded."""
        spec = job.spec
        try:
            handed = (self.handoff.take(spec.req_id, spec.token, step)
                      if spec.mode is LoadMode.HANDED_OVER and self.handoff is not None else None)
            targets = self._targets(spec) if spec.hashes else None
            if targets is None:
                self._unwritten(spec, LoadFailure.NO_BLOCK)
                return
            refs, blocks = targets
            named = {g for g, _ in spec.state_copies}
            if any(g.is_state and i not in named for i, g in enumerate(self.layout.groups)):
                raise RuntimeError(f"request {spec.req_id}: a synchronous load naming no running state block")
            payloads: Any = handed
            read = payloads is None or any(r not in payloads for r in refs)
            if read:
                assert self.vault is not None
                loaded = self.vault.load(refs, borrow=False)
                if loaded.failed:
                    why = LoadFailure.MISSING if "missing" in loaded.failed.values() else LoadFailure.REJECTED
                    self._unwritten(spec, why)
                    return
                payloads = loaded.payloads
            all_refs, all_blocks, data = [], [], []
            for ref, block in zip(refs, blocks, strict=True):
                state = ref.kind is ObjectKind.STATE
                extra = [b for g, b in spec.state_copies if g == ref.group] if state else []
                for b in [block, *extra]:
                    all_refs.append(ref)
                    all_blocks.append(b)
                    data.append(payloads[ref])
            self._write(job, data, all_refs, all_blocks)
        except Exception as e:
            self._failed(f"request {spec.req_id}'s synchronous load", e)
            store = isinstance(e, StoreError)
            self._unwritten(spec, LoadFailure.STORE_ERROR if store else LoadFailure.INTERNAL_ERROR)
            return
        self.counters.add(loads=1, loads_in_step=1, loads_in_step_read=int(read),
                          loaded_tokens=spec.tokens - spec.local_tokens)

    def _unwritten(self, spec: LoadSpec, reason: LoadFailure) -> None:
        """A synchronous load not written: its blocks are reported unloaded (vLLM recomputes
        from the first, or, for a model of several cache groups, stops: 0.32-0.34 cannot
        recompute those, and a forward on a state never written would be wrong)."""
        if self.handoff is not None:
            self.handoff.drop(spec.req_id)  # (handed over for this load, if at all: taken by none)
        bs = self.layout.block_size
        for g, table in enumerate(spec.block_ids):
            last = (spec.tokens - 1) // bs
            first = last if self.layout.groups[g].is_state else spec.local_tokens // bs
            self._unloaded.update(b for b in table[first : last + 1] if b)
        self.counters.add(loads=1, load_failures=1)
        self.counters.tally("failure_reasons", reason.value)
        log.error("prefixvault: request %s: its synchronous load could not be written (%s); reported to "
                  "vLLM as unloaded blocks", spec.req_id, reason.value)

    def take_unloaded(self) -> set[int]:
        """Blocks of synchronous loads not written since the last call (vLLM's
        ``get_block_ids_with_load_errors``)."""
        out, self._unloaded = self._unloaded, set()
        return out

    def load_deadline(self, spec: LoadSpec) -> float:
        """Seconds a load may take: ``load_timeout`` plus its bytes at ``LOAD_FLOOR_BYTES_PER_S``."""
        bs = self.layout.block_size
        blocks = max(0, spec.tokens - spec.local_tokens) // bs
        nbytes = sum(g.nbytes(self.rank) * (1 if g.is_state else blocks) for g in self.layout.groups)
        return self._load_timeout + nbytes / LOAD_FLOOR_BYTES_PER_S

    def _load_batch(self, jobs: list[LoadJob]) -> None:
        """On the load lane: every load queued by now read from the store in one batch (an
        object several loads need is read once), then each written into its request's blocks.
        A load whose objects cannot all be read fails alone; a store error fails the batch."""
        assert self.vault is not None
        wanted: list[tuple[LoadJob, list[ObjectRef], list[int]]] = []
        refs: dict[ObjectRef, None] = {}  # every object of the batch, once, in order
        for job in jobs:
            try:
                targets = self._targets(job.spec)
            except Exception as e:  # ours (a block table we misread): this load only
                self.guard.failed("load", e)
                self._end_load(job, False, LoadFailure.INTERNAL_ERROR)
                continue
            if targets is None:
                self._end_load(job, False, LoadFailure.NO_BLOCK)
                continue
            wanted.append((job, *targets))
            refs.update(dict.fromkeys(targets[0]))
        if not wanted:
            return
        loaded = self.vault.load(list(refs), borrow=False)  # never memory the store lends the save path
        for job, job_refs, blocks in wanted:
            reasons = {loaded.failed[r] for r in job_refs if r in loaded.failed}
            if reasons:  # object by object, the vault counted why (``rejected{reason}``)
                why = LoadFailure.MISSING if "missing" in reasons else LoadFailure.REJECTED
                self._end_load(job, False, why)
                continue
            if not self._begin_write(job):
                continue  # past its deadline: already reported failed, its blocks are not ours
            try:
                self._write(job, [loaded.payloads[r] for r in job_refs], job_refs, blocks)
            except Exception as e:  # ours, or the device's: this load only
                self.guard.failed("load", e)
                self._end_load(job, False, LoadFailure.INTERNAL_ERROR)
                continue
            self._end_load(job, True)

    def _targets(self, spec: LoadSpec) -> tuple[list[ObjectRef], list[int]] | None:
        """The objects a load reads and the block each is written into; None if a block is missing."""
        assert self.vault is not None
        bs = self.layout.block_size
        refs = self.vault.needed(spec.hashes, spec.tokens, ranks=[self.rank], since=spec.local_tokens)
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

    def _write(self, job: LoadJob, payloads: Sequence[memoryview], refs: Sequence[ObjectRef],
               blocks: Sequence[int]) -> None:
        by_group: dict[int, list[tuple[memoryview, int]]] = {}
        for ref, payload, block_id in zip(refs, payloads, blocks, strict=True):
            by_group.setdefault(ref.group, []).append((payload, block_id))
        for g, items in by_group.items():
            io = self._io[g]
            if io.device.type == "cpu":  # straight from the loaded bytes, one copy per object
                for payload, block_id in items:
                    io.scatter([block_id], _host(payload, 1))
            else:
                self._scatter_pinned(io, items, job.marks[g] if g < len(job.marks) else None)

    def _fail_load_jobs(self, jobs: list[LoadJob], reason: Failure, error: BaseException | None) -> None:
        """Loads the lane could not finish (a store error, a shutdown): recomputed."""
        for job in jobs:
            self._end_load(job, False, LOAD_FAILED[reason])

    def _begin_write(self, job: LoadJob) -> bool:
        with self._lock:
            if job.state is not LoadState.QUEUED:
                return False
            job.state = LoadState.WRITING
            return True

    def _end_load(self, job: LoadJob, ok: bool, reason: LoadFailure | None = None,
                  only: LoadState | None = None) -> bool:
        """Report a load finished (once: a job already done is left as it is; with ``only``, a
        job in another state too, checked and changed in one hold of the lock); a failure is
        counted by ``reason``. Whether this call reported it."""
        spec = job.spec
        with self._lock:
            if job.state is LoadState.DONE or (only is not None and job.state is not only):
                return False
            job.state = LoadState.DONE
            self._landed.notify_all()
            self.counters.add(loads=1)
            if ok:
                self.counters.add(loaded_tokens=spec.tokens - spec.local_tokens)
            else:
                self.counters.add(load_failures=1)
                self.counters.tally("failure_reasons", reason or LoadFailure.INTERNAL_ERROR)
                self._failed_loads.add(spec.req_id)
            self._finished_loads.add(spec.req_id)
        return True

    def _expire_loads(self) -> None:
        """Loads past their deadline that have not started writing are reported failed now (vLLM
        recomputes them); their late bytes are never written. The store's breaker counts it: a
        store that hangs without an error is as unavailable as one that errs."""
        late = 0
        for job in self._loads.overdue():  # (one that started writing is left to land)
            if self._end_load(job, False, LoadFailure.TIMEOUT, only=LoadState.QUEUED):
                late += 1
        if late:
            log.warning("prefixvault: %d loads past their deadline: recomputed instead", late)
            store = self.vault.store if self.vault is not None else None
            if isinstance(store, BreakerStore):
                store.breaker.failure(f"{late} loads past their deadline")

    def fail_loads(self, specs: Sequence[LoadSpec], reason: LoadFailure = LoadFailure.INTERNAL_ERROR) -> None:
        """Report loads that could not run (an error of ours): vLLM recomputes them."""
        for spec in specs:
            self._end_load(LoadJob(spec, ()), False, reason)

    def _failed(self, what: str, e: Exception) -> None:
        """Say why ``what`` failed: a store's failure as a warning (an open breaker quietly: it
        was said once when it opened); anything else is a bug of ours, counted as an internal
        error and logged once per type with its traceback (``Guard``), never as the store's."""
        if isinstance(e, StoreError):
            log.log(logging.DEBUG if isinstance(e, BreakerOpen) else logging.WARNING,
                    "prefixvault: %s failed: %s", what, e)
        else:
            self.guard.failed("worker", e)

    def _scatter_pinned(self, io: GroupIO, items: Sequence[tuple[memoryview, int]], after: Any) -> None:
        """Write objects into a device's blocks through the pinned load buffer: one transfer
        and one scatter per piece that fits it."""
        host = self._load_host
        if host is None:
            raise RuntimeError("no pinned load buffer (caches not registered)")
        rows = max(1, host.numel() // io.object_bytes)
        flat = host.numpy()
        with self._load_lock:
            for start in range(0, len(items), rows):
                piece = items[start : start + rows]
                for j, (payload, _) in enumerate(piece):
                    flat[j * io.object_bytes : (j + 1) * io.object_bytes] = np.frombuffer(payload, np.uint8)
                src = host[: len(piece) * io.object_bytes].view(len(piece), io.object_bytes)
                io.scatter([b for _, b in piece], src, after=after)  # returns once landed

    @property
    def lanes(self) -> list[Lane[Any]]:
        return [self._saves, self._loads]

    def take_finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Loads finished (and of them, failed) since the last call; loads past their deadline
        are failed first. ``load_in_step``: the loads queued since the last call are waited for
        up to ``IN_STEP_WAIT_S`` first. Else, in an ``idle`` step (no token computed) while a
        load runs, the engine's thread sleeps ``LOAD_YIELD_S``: an engine with nothing else to
        run spins through empty steps holding the interpreter lock, which the load lane then got
        back only at the 5 ms switch interval after each of its store and copy calls."""
        step, self._step_loads = self._step_loads, []
        if step:
            with self._lock:
                self._landed.wait_for(lambda: all(j.state is LoadState.DONE for j in step), IN_STEP_WAIT_S)
        elif idle and self._loads.busy:
            time.sleep(LOAD_YIELD_S)
        self._expire_loads()
        with self._lock:
            done, failed = self._finished_loads, self._failed_loads
            self._finished_loads, self._failed_loads = set(), set()
        return done, failed


def _host(buf: memoryview, rows: int) -> Any:
    """Host bytes as the uint8 [rows, n / rows] tensor block I/O reads or writes (no copy)."""
    import torch

    return torch.from_numpy(np.frombuffer(buf, np.uint8)).view(rows, -1)
