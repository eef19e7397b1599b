"""Worker side of the connector: gather objects out of vLLM's cache tensors, scatter them back.

One worker per tensor-parallel rank. Saves are copied, in ``wait_for_save`` right after the
forward that computed them, out of the engine's blocks into staging memory (a block may be
reused by the next step); a save thread then stores the objects and publishes the records, in
the order the saves were made, while the engine goes on. Staging is a fixed budget: a save that
does not fit is dropped and counted, never waited for. Each save, stored or dropped, is reported
back to the scheduler (``take_settled``), which holds lookups of a prefix whose save is in flight.
Loads are handed, in ``start_load_kv``, to a load thread that reads and verifies the objects and
writes them into the request's blocks while the engine goes on with other requests; the request
is reported finished (``get_finished``) only after its objects landed, and vLLM schedules its
first chunk only then. Its blocks are fresh (vLLM caches them only once loaded), so nothing else
reads or writes them meanwhile.

A held save (``output_boundaries: last``) copies only its states, into a slot of its own that
the request's next held save reuses; when the request finishes, its KV blocks (kept by vLLM
until this worker reports the request sent) are staged beside the held states and the save
goes to the save thread as any other.

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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixvault.blockio import Done, GroupIO
from prefixvault.boundary import Refusal
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheLayout
from prefixvault.staging import Reservation, SlotPool, StagingRing
from prefixvault.stores.base import StoreError
from prefixvault.stores.breaker import BreakerOpen
from prefixvault.vault import ObjectRef, RankAck, Vault
from prefixvault.vllm.guard import Guard
from prefixvault.vllm.metadata import LoadSpec, Release, SaveSpec, save_id
from prefixvault.vllm.views import group_ios

log = logging.getLogger("vllm.prefixvault")

#: Pinned host memory one worker keeps for loads into CUDA caches (a larger load goes in pieces).
LOAD_STAGING_BYTES = 32 << 20
#: How long a stopping worker waits for a load already running (loads queued are dropped: the
#: engine they were for is stopping).
LOAD_DRAIN_S = 5.0

#: A save's objects copied into staging: its reservation, payloads by key, copies in flight.
Staged = tuple[Reservation, dict[str, memoryview], list[Done]]


@dataclass
class WorkerCounters:
    saved_boundaries: int = 0
    published: int = 0
    save_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_tokens: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    save_dropped: dict[str, int] = field(default_factory=dict)  # saves not stored, by reason
    # Invariant: every change of a number goes through ``add``, under this lock (the engine's
    # thread, the save thread and the load thread all count here).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)


class WorkerSide:
    def __init__(
        self, layout: CacheLayout, vault: Vault | None, rank: int, layer_groups: Sequence[Sequence[str]],
        staging_bytes: int = 0, drain_timeout: float = 30.0, hold_bytes: int = 0,
        num_blocks: int | None = None, guard: Guard | None = None,
    ) -> None:
        """``num_blocks``: the engine's manager blocks (``KVCacheConfig.num_blocks``); a layer
        with more (kernel blocks) is viewed as that many manager blocks. ``guard``: where errors
        of ours (not the store's) are counted and logged, the connector's own."""
        self.guard = guard or Guard()
        self.layout = layout
        self.vault = vault
        self.rank = rank
        self.layer_groups = [list(g) for g in layer_groups]
        self._io: list[GroupIO] = []  # per cache group: copies between its layers' blocks and host bytes
        self._finished_loads: set[str] = set()  # guarded by _lock (the load thread adds to them)
        self._failed_loads: set[str] = set()
        # Saves settled since the last report, with whether every boundary was published (a
        # save dropped or failed is not: the scheduler then plans the next one from further
        # back); under _lock.
        self._settled: list[tuple[str, bool]] = []
        self._lock = threading.Lock()
        self.num_blocks = num_blocks
        self._disabled: str | None = None  # why the worker touches no cache tensor (``disable``)
        self._cuda_device: Any = None  # the caches' CUDA device, once registered
        # Loads into CUDA caches go through this pinned buffer, one load at a time (under the lock).
        self._load_host: Any = None
        self._load_lock = threading.Lock()
        self._load_futures: set[Future[None]] = set()  # queued or running loads; under _lock
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixvault-load",
                                          initializer=self._on_load_thread)
        # No staging budget: saves are stored in the step, as they are copied. Allocated once the
        # cache tensors are known (pinned host memory, for a device's copies to overlap).
        self._staging_bytes = staging_bytes if vault is not None else 0
        self._staging: StagingRing | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixvault-save")
        self._in_flight = 0  # saves queued on the save thread; under _idle's lock
        # Staged saves waiting for the save thread: (save_id, spec, reservation, payloads by
        # key, copies in flight, hold slot to give back once stored); under _lock.
        self._queue: list[tuple[str, SaveSpec, Reservation, dict[str, memoryview], list[Done],
                                int | None]] = []
        # Held saves by request: (spec, slot, the held states' payloads by key). Only the
        # engine's thread (save, release) touches it; slots go back from the save thread.
        self._hold_bytes = hold_bytes if vault is not None else 0
        self._holds: SlotPool | None = None
        self._held: dict[str, tuple[SaveSpec, int | None, dict[str, memoryview]]] = {}
        self._sent: set[str] = set()  # requests whose held save's blocks were read; under _lock
        self._idle = threading.Condition(self._lock)
        self._drain_timeout = drain_timeout
        self.counters = WorkerCounters()

    def close(self) -> bool:
        """Store the saves still queued (up to ``drain_timeout``), drop the loads not started,
        wait for a running one (up to ``LOAD_DRAIN_S``), then stop the threads. Returns whether
        both threads are done: if not, one may still be inside a store call, and the store must
        stay open under it (the caller closes it only when every side drained)."""
        with self._idle:
            if self._in_flight:
                log.info("prefixvault: storing %d queued saves before shutting down", self._in_flight)
            saves_done = self._idle.wait_for(lambda: self._in_flight == 0, timeout=self._drain_timeout)
            if not saves_done:
                log.warning("prefixvault: %d saves not stored at shutdown (save_drain_timeout %.0f s)",
                            self._in_flight, self._drain_timeout)
        self._saver.shutdown(wait=saves_done, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)  # a load now is for a stopping engine
        with self._lock:
            loads = [f for f in self._load_futures if not f.cancelled()]
        _, running = wait(loads, timeout=min(LOAD_DRAIN_S, self._drain_timeout))
        if running:
            log.warning("prefixvault: a load still running at shutdown after %.0f s is abandoned",
                        min(LOAD_DRAIN_S, self._drain_timeout))
        return saves_done and not running

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

    def _on_load_thread(self) -> None:
        """The load thread works on the caches' device: a thread that never chose one would
        open a context on device 0 in every tensor-parallel rank (outside vLLM's budget)."""
        if self._cuda_device is None:
            return
        try:
            import torch

            torch.cuda.set_device(self._cuda_device)
        except Exception as e:  # the copies still name their device explicitly
            log.warning("prefixvault: the load thread could not select %s: %s", self._cuda_device, e)

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
        """Copy this step's saves out of the engine's blocks; store them on the save thread
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
        """Hand a staged save to the save thread (which gives ``slot`` back once it is stored)."""
        with self._idle:
            self._in_flight += 1
            self._queue.append((sid, spec, *staged, slot))
        try:
            self._saver.submit(self._store_queued)
        except RuntimeError:  # shut down meanwhile: nothing will store it
            with self._idle:
                self._queue = [q for q in self._queue if q[0] != sid]
                self._in_flight -= 1
            if self._staging is not None:
                self._staging.release(staged[0])
            self._give(slot)
            self._settle(sid, False)

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
                self._count(self.counters.save_dropped, "hold_full" if self._holds else "hold_too_large")
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
            reason = "too_large" if total > self._staging.capacity else "staging_full"
            if reason == "too_large" and not self.counters.save_dropped.get(reason):
                log.warning("prefixvault: a save of %d bytes does not fit save_staging_mib (%d bytes): "
                            "raise it, or such saves are never stored", total, self._staging.capacity)
            self._count(self.counters.save_dropped, reason)
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

    def _store_queued(self) -> None:
        """On the save thread: store every save queued by now as one batch (one existence check
        and one put for all their objects: a slow store is not paid per save), publish them
        together (``Vault.publish_many``), then give their staging back."""
        with self._lock:
            batch, self._queue = self._queue, []
        if not batch:
            return  # an earlier call took them
        outcomes = [False] * len(batch)
        try:
            payloads: dict[str, memoryview] = {}
            for _, _, _, staged, copies, _ in batch:
                for c in copies:
                    c.wait()
                payloads.update(staged)
            outcomes = self._store_many([spec for _, spec, _, _, _, _ in batch],
                                        lambda ref, _block: payloads[ref.key])
        except Exception as e:  # logged here: nothing else sees this thread's errors
            self._failed(f"storing {len(batch)} saves", e)
            self.counters.add(save_errors=len(batch))
        finally:
            assert self._staging is not None
            for (sid, _, r, _, copies, slot), ok in zip(batch, outcomes, strict=True):
                for c in copies:
                    with contextlib.suppress(Exception):
                        c.wait()  # never hand back memory a copy may still write
                self._staging.release(r)
                self._give(slot)
                self._settle(sid, ok)
            with self._idle:
                self._in_flight -= len(batch)
                self._idle.notify_all()

    def _store_many(self, specs: Sequence[SaveSpec], read: Any) -> list[bool]:
        """Whether each save's boundaries were all published. Stored with one batch put and
        published with one batch of records (``Vault.publish_many``)."""
        assert self.vault is not None
        try:
            all_acks = self.vault.save_many(self.rank, [(s.hashes, s.plans) for s in specs], read)
        except Exception as e:  # a store problem costs future hits, never a request
            self.counters.add(save_errors=len(specs))
            self._failed(f"{len(specs)} saves", e)
            return [False] * len(specs)
        return self._publish(specs, all_acks)

    def _store(self, spec: SaveSpec, read: Any, read_into: Any) -> bool:
        assert self.vault is not None
        try:
            acks = self.vault.save(self.rank, spec.hashes, spec.plans, read, read_into)
        except Exception as e:  # a store problem costs future hits, never this request
            self.counters.add(save_errors=1)
            self._failed(f"the save of request {spec.req_id}", e)
            return False
        return self._publish([spec], [acks])[0]

    def _publish(self, specs: Sequence[SaveSpec], all_acks: Sequence[Sequence[RankAck]]) -> list[bool]:
        """Publish these saves' boundaries together; whether each save's are all published now."""
        assert self.vault is not None
        for acks in all_acks:
            self.counters.add(save_errors=sum(not a.ok for a in acks))
            self.counters.add(saved_boundaries=sum(a.ok for a in acks))
        try:
            outcomes = self.vault.publish_many([(spec.hashes, acks, spec.parent)
                                                for spec, acks in zip(specs, all_acks, strict=True)])
        except Exception as e:  # a store problem costs future hits, never a request
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

    def load(self, specs: Sequence[LoadSpec]) -> None:
        """Queue the loads on the load thread; each is reported by ``take_finished`` once done.
        On a device, the writes wait for the engine's work queued by now (``GroupIO.mark``)."""
        if self._disabled is not None:
            self.fail_loads(specs, "disabled")
            return
        marks = [io.mark() for io in self._io]
        for spec in specs:
            future = self._loader.submit(self._load_and_report, spec, marks)
            with self._lock:
                self._load_futures.add(future)
            future.add_done_callback(self._load_done)

    def _load_done(self, future: Future[None]) -> None:
        with self._lock:
            self._load_futures.discard(future)

    def _load_and_report(self, spec: LoadSpec, marks: Sequence[Any] = ()) -> None:
        ok = False
        try:
            ok = self._load_one(spec, marks)
        except Exception as e:  # any error of ours or of the store: the request recomputes
            self._failed(f"the load of request {spec.req_id}", e)
            self._count_failure("breaker_open" if isinstance(e, BreakerOpen)
                                else "store_error" if isinstance(e, StoreError) else "internal_error")
        finally:  # reported whatever happened: vLLM waits for every load it was promised
            with self._lock:
                self.counters.add(loads=1)
                if ok:
                    self.counters.add(loaded_tokens=spec.tokens - spec.local_tokens)
                else:
                    self.counters.add(load_failures=1)
                    self._failed_loads.add(spec.req_id)
                self._finished_loads.add(spec.req_id)

    def fail_loads(self, specs: Sequence[LoadSpec], reason: str = "internal_error") -> None:
        """Report loads that could not run (an error of ours): vLLM recomputes them."""
        with self._lock:
            for spec in specs:
                self.counters.add(loads=1)
                self.counters.add(load_failures=1)
                self.counters.failure_reasons[reason] = self.counters.failure_reasons.get(reason, 0) + 1
                self._failed_loads.add(spec.req_id)
                self._finished_loads.add(spec.req_id)

    def _failed(self, what: str, e: Exception) -> None:
        """Say why ``what`` failed: a store's failure as a warning (an open breaker quietly: it
        was said once when it opened); anything else is a bug of ours, counted as an internal
        error and logged once per type with its traceback (``Guard``), never as the store's."""
        if isinstance(e, StoreError):
            log.log(logging.DEBUG if isinstance(e, BreakerOpen) else logging.WARNING,
                    "prefixvault: %s failed: %s", what, e)
        else:
            self.guard.failed("worker", e)

    def _count_failure(self, reason: str) -> None:
        self._count(self.counters.failure_reasons, reason)

    def _count(self, counts: dict[str, int], reason: str) -> None:
        with self._lock:
            counts[reason] = counts.get(reason, 0) + 1

    def _load_one(self, spec: LoadSpec, marks: Sequence[Any] = ()) -> bool:
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
                self._count_failure("no_block")
                return False
            targets.append(block_id)
        loaded = self.vault.load(refs, borrow=False)  # never memory the store lends the save path
        if not loaded.ok:
            for why in loaded.failed.values():
                self._count_failure(why)
            return False
        by_group: dict[int, list[tuple[memoryview, int]]] = {}
        for ref, block_id in zip(refs, targets, strict=True):
            by_group.setdefault(ref.group, []).append((loaded.payloads[ref], block_id))
        for g, items in by_group.items():
            io = self._io[g]
            if io.device.type == "cpu":  # straight from the loaded bytes, one copy per object
                for payload, block_id in items:
                    io.scatter([block_id], _host(payload, 1))
            else:
                self._scatter_pinned(io, items, marks[g] if g < len(marks) else None)
        return True

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

    def take_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, failed = self._finished_loads, self._failed_loads
            self._finished_loads, self._failed_loads = set(), set()
        return done, failed


def _host(buf: memoryview, rows: int) -> Any:
    """Host bytes as the uint8 [rows, n / rows] tensor block I/O reads or writes (no copy)."""
    import torch

    return torch.from_numpy(np.frombuffer(buf, np.uint8)).view(rows, -1)
