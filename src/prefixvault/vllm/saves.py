"""A worker's saves: copied out of the engine's blocks in the step, stored and published beside it.

``wait_for_save`` copies each save's objects, right after the forward that computed them, into
staging memory (a block may be reused by the next step) and hands the save to the save lane,
which stores every save queued by then as one batch (``Vault.save_many``) and publishes their
records together (``Vault.publish_many``) while the engine goes on. Staging is a fixed budget
(``save_staging_mib``, a ``StagingRing``): a save that does not fit is dropped and counted
(``SaveDrop``), never waited for. Without a budget a save is stored in the step, as it is copied.

Each save, stored or dropped, is settled (``take_settled``): the scheduler holds lookups of a
prefix whose save is in flight until every rank settled it, and plans a request's next save from
further back when one was not published.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from prefixvault.blockio import Done
from prefixvault.boundary import Refusal
from prefixvault.lane import Failure, Lane, report
from prefixvault.staging import Reservation, StagingRing
from prefixvault.vault import ObjectRef, RankAck
from prefixvault.vllm.metadata import SaveSpec
from prefixvault.vllm.worker_context import WorkerContext

log = logging.getLogger("vllm.prefixvault")

#: Saves the save lane queues at most; past it a save is dropped (``queue_full``).
SAVE_QUEUE = 4096


class SaveDrop(StrEnum):
    """Why a save was not stored (``save_dropped``); a store's failure is a ``save_error``."""

    STAGING_FULL = "staging_full"  # more bytes wait for the store than save_staging_mib holds
    TOO_LARGE = "too_large"  # one save is larger than save_staging_mib
    HOLD_FULL = "hold_full"  # every save_hold_mib slot is held by a decoding request
    HOLD_TOO_LARGE = "hold_too_large"  # one boundary's states are larger than save_hold_mib
    QUEUE_FULL = "queue_full"  # the save lane holds SAVE_QUEUE saves already
    SHUTDOWN = "shutdown"  # still queued when the engine stopped (save_drain_timeout)


#: What the save lane's refusals count as (its errors are ``save_errors``).
SAVE_DROPPED = {Failure.FULL: SaveDrop.QUEUE_FULL, Failure.CLOSED: SaveDrop.SHUTDOWN,
                Failure.TIMEOUT: SaveDrop.SHUTDOWN}

#: Reads an object's payload out of the engine's blocks (``Vault.save``'s ``read``, ``read_into``).
Read = Callable[[ObjectRef, int], memoryview]
ReadInto = Callable[[ObjectRef, int, memoryview], None]


@dataclass(frozen=True, kw_only=True)
class StagedSave:
    """A save copied into staging, handed from the engine's thread to the save lane.
    Invariant: once stored or dropped, its staging goes back (after every copy into it ended),
    then ``give_back`` runs, and it is settled, once."""

    sid: str  # ``save_id``: what the scheduler knows it by
    spec: SaveSpec
    reservation: Reservation
    payloads: dict[str, memoryview]  # by object key: views of the reservation (or of a hold's slot)
    copies: list[Done]  # copies into the reservation, maybe still running on a device
    give_back: Callable[[], None] | None = None  # what else it held (a hold's slot)


class Saves:
    """Staging, the save lane and settling, for one worker."""

    def __init__(self, ctx: WorkerContext, *, staging_bytes: int, drain_timeout: float) -> None:
        self._ctx = ctx
        self._drain_timeout = drain_timeout
        # No staging budget: saves are stored in the step, as they are copied. Allocated once the
        # cache tensors are known (pinned host memory, for a device's copies to overlap).
        self._staging_bytes = staging_bytes if ctx.vault is not None else 0
        self._staging: StagingRing | None = None
        self.lane: Lane[StagedSave] = Lane("save", self._store_batch, self._drop_saves, capacity=SAVE_QUEUE,
                                           guard=ctx.guard, on_start=ctx.caches.on_lane_thread)
        # Saves settled since the last report, with whether every boundary was published (a
        # save dropped or failed is not: the scheduler then plans the next one from further
        # back); under _lock.
        self._settled: list[tuple[str, bool]] = []
        self._lock = threading.Lock()

    def allocate(self) -> None:
        """The staging budget, once the caches are registered (its memory is pre-faulted)."""
        if self._staging_bytes and self._staging is None:
            buffer = self._ctx.caches.host_buffer(self._staging_bytes)
            self._staging = StagingRing(self._staging_bytes, buffer)

    @property
    def stored_in_step(self) -> bool:
        """Whether saves are stored in the step, as they are copied (no staging budget)."""
        return not self._staging_bytes

    # -- the engine's thread ----------------------------------------------------------------------

    def save(self, spec: SaveSpec, sid: str) -> None:
        """Copy one save out of the engine's blocks; store it on the save lane (or here,
        without a staging budget). Settled whatever happens to it."""
        try:
            if self.stored_in_step:
                self.settle(sid, self.store_now(spec, self._ctx.caches.read, self._ctx.caches.read_into))
                return
            staged = self.stage(sid, spec)
        except Exception as e:  # one save's error of ours costs that save only
            self.fail(sid, f"staging the save of request {spec.req_id}", e)
            return
        if staged is None:
            self.settle(sid, False)
            return
        self.enqueue(staged)

    def fail(self, sid: str, doing: str, e: Exception) -> None:
        """A save that failed in the step: the error sorted, counted, the save settled unpublished."""
        report(self._ctx.guard, "worker", e, doing)
        self._ctx.counters.add(save_errors=1)
        self.settle(sid, False)

    def stage(self, sid: str, spec: SaveSpec, held: dict[str, memoryview] | None = None,
              held_copies: Sequence[Done] = (),
              give_back: Callable[[], None] | None = None) -> StagedSave | None:
        """The spec's objects copied into one staging reservation, one gather per cache group
        (on a device, maybe still in flight: the save lane waits for ``StagedSave.copies``);
        None if dropped. Objects in ``held`` are not copied: their payloads are the held bytes,
        copied by ``held_copies``, which the lane waits for too."""
        assert self._ctx.vault is not None and self._staging is not None
        objects, _ = self._ctx.vault.objects_of(self._ctx.rank, spec.hashes, spec.plans, spec.salt)
        held = held or {}
        payloads = {ref.key: held[ref.key] for ref, _ in objects if ref.key in held}
        to_copy = [(ref, block_id) for ref, block_id in objects if ref.key not in held]
        total = self._ctx.caches.nbytes_of(to_copy)
        if not total:  # nothing to copy (records only): no staging, nothing to hand back
            nothing = Reservation(0, 0, memoryview(b""), released=True)
            return StagedSave(sid=sid, spec=spec, reservation=nothing, payloads=payloads,
                              copies=list(held_copies), give_back=give_back)
        r = self._staging.reserve(total)
        if r is None:
            reason = SaveDrop.TOO_LARGE if total > self._staging.capacity else SaveDrop.STAGING_FULL
            if reason is SaveDrop.TOO_LARGE and not self._ctx.counters.save_dropped.get(reason):
                log.warning("prefixvault: a save of %d bytes does not fit save_staging_mib (%d bytes): "
                            "raise it, or such saves are never stored", total, self._staging.capacity)
            self._ctx.counters.tally("save_dropped", reason)
            return None
        try:
            copied, copies = self._ctx.caches.copy_objects(to_copy, r.view)
        except BaseException:
            self._staging.release(r)  # (what was queued into it ended)
            raise
        payloads.update(copied)
        return StagedSave(sid=sid, spec=spec, reservation=r, payloads=payloads,
                          copies=[*copies, *held_copies], give_back=give_back)

    def enqueue(self, job: StagedSave) -> None:
        """Hand a staged save to the save lane (which gives back what it holds once it is stored)."""
        refused = self.lane.put(job)
        if refused is not None:  # queue full, or shutting down: nothing will store it
            self._drop_saves([job], refused, None)

    def store_now(self, spec: SaveSpec, read: Read, read_into: ReadInto) -> bool:
        """Store and publish one save in the step (no staging budget); whether it was published.
        A store problem costs future hits, never this request: counted, logged, not raised."""
        assert self._ctx.vault is not None
        try:
            acks = self._ctx.vault.save(self._ctx.rank, spec.hashes, spec.plans, read, read_into, spec.salt)
        except Exception as e:
            self._ctx.counters.add(save_errors=1)
            report(self._ctx.guard, "worker", e, f"the save of request {spec.req_id}")
            return False
        return self._publish([spec], [acks])[0]

    # -- the save lane ----------------------------------------------------------------------------

    def _store_batch(self, batch: list[StagedSave]) -> None:
        """On the save lane: store every save queued by now as one batch (one existence check
        and one put for all their objects: a slow store is not paid per save), publish them
        together (``Vault.publish_many``), then give their staging back. An error raised here
        resolves nothing: the lane drops the batch (``_drop_saves``). A save whose copies failed
        (its step's gathers) is the only one lost for it."""
        assert self._ctx.vault is not None
        payloads: dict[str, memoryview] = {}
        copied: list[int] = []  # indexes in ``batch`` of the saves whose copies ended well
        for i, job in enumerate(batch):
            try:
                for c in job.copies:
                    c.wait()
            except Exception as e:
                report(self._ctx.guard, "save", e, f"the copies of save {job.sid}")
                continue
            copied.append(i)
            payloads.update(job.payloads)
        outcomes = [False] * len(batch)
        if copied:
            specs = [batch[i].spec for i in copied]
            all_acks = self._ctx.vault.save_many(self._ctx.rank, [(s.hashes, s.plans) for s in specs],
                                             lambda ref, _block: payloads[ref.key],
                                             salts=[s.salt for s in specs])
            for i, ok in zip(copied, self._publish(specs, all_acks, raise_store_errors=True), strict=True):
                outcomes[i] = ok
        self._ctx.counters.add(save_errors=len(batch) - len(copied))
        self._finish_saves(batch, outcomes)

    def _drop_saves(self, batch: list[StagedSave], reason: Failure, error: BaseException | None) -> None:
        """Saves the lane could not store: counted (an error, or dropped for the queue or the
        shutdown), their memory given back, settled unpublished."""
        if reason in (Failure.STORE_ERROR, Failure.BREAKER_OPEN, Failure.INTERNAL_ERROR):
            self._ctx.counters.add(save_errors=len(batch))
        else:
            self._ctx.counters.tally("save_dropped", SAVE_DROPPED[reason].value, len(batch))
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
                if job.give_back is not None:
                    job.give_back()
            except Exception as e:
                report(self._ctx.guard, "save", e)
            finally:
                self.settle(job.sid, ok)

    def _publish(self, specs: Sequence[SaveSpec], all_acks: Sequence[Sequence[RankAck]],
                 raise_store_errors: bool = False) -> list[bool]:
        """Publish these saves' boundaries together; whether each save's are all published now.
        An error is counted and logged here, or raised (``raise_store_errors``: on a lane, which
        sorts and counts it)."""
        assert self._ctx.vault is not None
        for acks in all_acks:
            self._ctx.counters.add(save_errors=sum(not a.ok for a in acks))
            self._ctx.counters.add(saved_boundaries=sum(a.ok for a in acks))
        try:
            outcomes = self._ctx.vault.publish_many([(spec.hashes, acks, spec.parent)
                                                     for spec, acks in zip(specs, all_acks, strict=True)],
                                                    seeds=[spec.seed or None for spec in specs],
                                                    salts=[spec.salt for spec in specs])
        except Exception as e:  # a store problem costs future hits, never a request
            if raise_store_errors:
                raise
            self._ctx.counters.add(save_errors=len(specs))
            report(self._ctx.guard, "worker", e, f"publishing {len(specs)} saves (first: request "
                                             f"{specs[0].req_id if specs else '-'})")
            return [False] * len(specs)
        done = []
        for results in outcomes:
            self._ctx.counters.add(published=sum(why is None for why in results.values()))
            # MISSING_RANK: another rank has not stored its objects yet; the last one to
            # finish publishes (Vault.publish), so this rank's part is done.
            fine = all(why in (None, Refusal.MISSING_RANK) for why in results.values())
            done.append(bool(results) and fine)
        return done

    # -- settling ---------------------------------------------------------------------------------

    def settle(self, sid: str, published: bool) -> None:
        with self._lock:
            self._settled.append((sid, published))

    def take_settled(self) -> list[tuple[str, bool]]:
        """Saves stored or dropped since the last call: (``save_id``, all published)."""
        with self._lock:
            out, self._settled = self._settled, []
        return out

    def close(self) -> bool:
        """Store the saves still queued (up to ``drain_timeout``; those left are dropped).
        Whether the lane is idle: if not, it is still inside a store call."""
        if self.lane.busy:
            log.info("prefixvault: storing the queued saves before shutting down (up to %.0f s)",
                     self._drain_timeout)
        done = self.lane.close(self._drain_timeout, drop_queued=False)
        if not done:
            log.warning("prefixvault: saves not stored at shutdown (save_drain_timeout %.0f s): the "
                        "store did not answer in time", self._drain_timeout)
        return done
