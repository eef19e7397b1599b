"""Output holds: a decoding request's output boundary, kept until it ends or its key is known.

A held save copies only its states, in the step that ends on the boundary, into a slot of its
own (``SlotPool``: fixed-size slots in one pre-faulted buffer, pinned on a device, taken and
given back in any order, since requests finish in any order); the request's next held save
replaces it in the same slot. When the request finishes, its ``Release`` says what to do: a
stored one's KV blocks (kept by vLLM until every worker reports the request sent) are staged
beside the held states and the save goes to the save lane as any other (``saves.py``); a
dropped one gives its slot back. A request without a slot free holds nothing
(``save_dropped{reason="hold_full"}``).
Both copies, the hold's states and the release's blocks, go with the step's other saves
(``EngineCaches.one_step``): on a device the engine's stream waits for the device-side gathers
only, and the save lane, not the engine's thread, waits for the transfers to the host
(``HeldSave.copies``) before it reads the slot (without a staging budget, a held save stored in
the step waits for its states' transfer then).
Under async scheduling a step's output boundary is held before its key is known (a deferred
hold); with ``output_boundaries: every`` its release comes while the request still runs
(``Release.running``): stored the same way, but never reported sent, the blocks being the
running request's own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from prefixvault.blockio import Done
from prefixvault.codec import ObjectKind
from prefixvault.lane import report
from prefixvault.staging import SlotPool
from prefixvault.vault import ObjectRef
from prefixvault.vllm.metadata import Release, SaveSpec
from prefixvault.vllm.saves import SaveDrop, Saves
from prefixvault.vllm.worker_context import WorkerContext

log = logging.getLogger("vllm.prefixvault")


def _named(spec: SaveSpec, block_size: int) -> list[bytes]:
    """The hashes a held save's objects are named by while it is held: its own, or for a
    deferred one (its keys not known yet) one distinct stand-in per block, so that its objects
    are told apart until its release names them."""
    if not spec.deferred:
        return spec.hashes
    n = -(-max(p.tokens for p in spec.plans) // block_size)
    return [i.to_bytes(16, "big") for i in range(n)]


@dataclass(frozen=True, kw_only=True)
class HeldSave:
    """A request's held save, until its request finishes."""

    spec: SaveSpec
    slot: int | None  # None: it had no states to hold
    payloads: dict[str, memoryview]  # the held states by object key: views of the slot
    # The copies into the slot, maybe still running on a device: wait for them before reading
    # ``payloads``. A copy into a slot is queued after every earlier one on the same side
    # stream, so a slot given back and taken again is written in order.
    copies: tuple[Done, ...] = ()


class Holds:
    """The held saves of one worker, and the requests whose held saves' blocks were read."""

    def __init__(self, ctx: WorkerContext, saves: Saves, *, hold_bytes: int) -> None:
        """``saves``: where a held save goes once its request finishes."""
        self._ctx = ctx
        self._saves = saves
        self._hold_bytes = hold_bytes if ctx.vault is not None else 0
        self._slots: SlotPool | None = None  # allocated once the caches are registered
        # Held saves by request. Only the engine's thread (hold, release) touches it; slots go
        # back from the save lane too (``SlotPool`` has a lock of its own). Invariant: a held
        # save's slot is its request's alone, and goes back once: when the hold is dropped, or
        # once the save it became is stored or dropped.
        self._held: dict[str, HeldSave] = {}
        # Requests whose held save's blocks were read since the last ``take_sent``; under _lock.
        # Invariant: every request released to be stored lands here, whatever happened to its
        # save: vLLM keeps its blocks until it is reported sent.
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        # Running requests' releases (``Release.running``) settled by the last ``release``:
        # ``fail_releases`` after it settles only the others (each save is settled once).
        self._settled_running: set[str] = set()

    def allocate(self) -> None:
        """The slots, once the caches are registered: one boundary's states each."""
        slot = self._ctx.caches.state_bytes()
        if self._hold_bytes and slot and self._slots is None:
            if self._hold_bytes < slot:
                log.warning("prefixvault: one boundary's states (%d bytes) do not fit save_hold_mib (%d "
                            "bytes): no output boundary is stored; raise it", slot, self._hold_bytes)
            else:
                count = self._hold_bytes // slot
                self._slots = SlotPool(slot, count, self._ctx.caches.host_buffer(slot * count))

    def hold(self, spec: SaveSpec, sid: str) -> None:
        """Hold a save (``SaveSpec.hold``): nothing is stored, nor settled, until its request
        finishes. An error of ours costs this save only."""
        try:
            self._hold(spec)
        except Exception as e:
            self._saves.fail(sid, f"staging the save of request {spec.req_id}", e)

    def _hold(self, spec: SaveSpec) -> None:
        """Copy a held save's states into the request's slot (taking one if it has none); its
        earlier hold is replaced. No slot free: the earlier hold, if any, stays."""
        assert self._ctx.vault is not None
        objects, _ = self._ctx.vault.objects_of(self._ctx.rank, _named(spec, self._ctx.layout.block_size),
                                                spec.plans, spec.salt)
        states = [(ref, b) for ref, b in objects if ref.kind is ObjectKind.STATE]
        old = self._held.get(spec.req_id)
        slot = old.slot if old is not None else None
        if states and slot is None:
            slot = self._slots.take() if self._slots is not None else None
            if slot is None:
                self._ctx.counters.tally("save_dropped",
                                     SaveDrop.HOLD_FULL if self._slots else SaveDrop.HOLD_TOO_LARGE)
                return
        payloads: dict[str, memoryview] = {}
        copies: list[Done] = []
        try:
            if states:  # one gather per group, queued with the step's saves
                assert self._slots is not None and slot is not None
                payloads, copies = self._ctx.caches.copy_objects(states, self._slots.view(slot))
        except BaseException:  # the slot may hold half of two boundaries: drop the hold
            self._held.pop(spec.req_id, None)
            self._give(slot)
            raise
        self._held[spec.req_id] = HeldSave(spec=spec, slot=slot, payloads=payloads, copies=tuple(copies))

    def release(self, releases: Sequence[Release], step: int) -> None:
        """Store (``Release.store``) or drop the released held saves. A stored one's KV blocks
        are copied out now and, its request finished, the request is reported sent (vLLM frees
        its blocks) whatever happens to the save. Never raises: after an error of ours, the held
        saves left are dropped, and every finished request to store is still reported sent, and
        every save settled."""
        try:
            self._release(releases, step)
        except Exception as e:
            report(self._ctx.guard, "worker", e, "releasing held saves")
            self._ctx.counters.add(save_errors=1)
            self.fail_releases(releases, step)

    def _release(self, releases: Sequence[Release], step: int) -> None:
        self._settled_running = set()
        for rel in releases:
            held = self._held.pop(rel.req_id, None)
            if not rel.store:
                if held is not None:
                    self._give(held.slot)
                continue
            sid = rel.sid(step)
            try:
                if held is None:  # its hold was dropped when made (no slot)
                    self._saves.settle(sid, False)
                else:
                    if held.spec.deferred:
                        try:
                            held = self._named(held, rel.hashes)
                        except BaseException:
                            self._give(held.slot)
                            raise
                    self._store_held(sid, held)  # (its slot goes back whatever happens)
            except Exception as e:  # one save's error costs that save only
                self._saves.fail(sid, f"storing the held save of request {rel.req_id}", e)
            finally:
                if rel.running:
                    self._settled_running.add(sid)
                else:
                    with self._lock:
                        self._sent.add(rel.req_id)

    def _store_held(self, sid: str, held: HeldSave) -> None:
        """Stage (or, without staging, store) a held save: its KV blocks from the engine, its
        states from the slot, which goes back once the save is stored."""
        spec = dataclasses.replace(held.spec, hold=False)
        slot, states = held.slot, held.payloads
        if any(c.failed for c in held.copies):  # its step's gathers failed: this save alone is lost
            self._give(slot)
            raise RuntimeError(f"the copy of request {held.spec.req_id}'s held states failed in its step")
        if self._saves.stored_in_step:
            try:
                for c in held.copies:  # made in an earlier step: issued, and landed by now on a host
                    c.wait()
            except BaseException:
                self._give(slot)
                raise
            def read(ref: ObjectRef, block_id: int) -> memoryview:
                return states[ref.key] if ref.key in states else self._ctx.caches.read(ref, block_id)

            def read_into(ref: ObjectRef, block_id: int, dest: memoryview) -> None:
                if ref.key in states:
                    dest[:] = states[ref.key]
                else:
                    self._ctx.caches.read_into(ref, block_id, dest)
            try:
                self._saves.settle(sid, self._saves.store_now(spec, read, read_into))
            finally:
                self._give(slot)
            return
        try:
            staged = self._saves.stage(sid, spec, states, held.copies,
                                       give_back=functools.partial(self._give, slot))
        except BaseException:
            self._give(slot)
            raise
        if staged is None:
            self._give(slot)
            self._saves.settle(sid, False)
            return
        # Not waited for here: the blocks may be freed (the request reported sent) once the
        # step's gathers are issued, and the save lane waits for the transfers.
        self._saves.enqueue(staged)

    def _named(self, held: HeldSave, hashes: list[bytes]) -> HeldSave:
        """A deferred hold (``SaveSpec.deferred``) keyed by the hashes its release names: its
        states, held under stand-in keys, under their keys now."""
        assert self._ctx.vault is not None
        if not hashes:
            raise ValueError(f"the release of request {held.spec.req_id}'s deferred hold names no hashes")
        spec = dataclasses.replace(held.spec, hashes=list(hashes), deferred=False)
        rank, plans, salt = self._ctx.rank, held.spec.plans, held.spec.salt
        stand_ins = _named(held.spec, self._ctx.layout.block_size)
        before, _ = self._ctx.vault.objects_of(rank, stand_ins, plans, salt)
        after, _ = self._ctx.vault.objects_of(rank, spec.hashes, plans, salt)
        keys = {a.key: b.key for (a, _), (b, _) in zip(before, after, strict=True)}
        return HeldSave(spec=spec, slot=held.slot, payloads={keys[k]: v for k, v in held.payloads.items()},
                        copies=held.copies)

    def fail_releases(self, releases: Sequence[Release], step: int) -> None:
        """After an error of ours in ``release`` (or with the worker off): drop the held saves
        left; every request to store is still reported sent (its blocks must be freed) and its
        save settled."""
        for rel in releases:
            held = self._held.pop(rel.req_id, None)
            if held is not None:
                self._give(held.slot)
            if rel.store and rel.running:
                if rel.sid(step) not in self._settled_running:
                    self._saves.settle(rel.sid(step), False)
                    self._settled_running.add(rel.sid(step))  # (called again after a second error)
            elif rel.store:
                with self._lock:
                    done = rel.req_id in self._sent
                if not done:
                    self._saves.settle(rel.sid(step), False)
                    with self._lock:
                        self._sent.add(rel.req_id)

    def take_sent(self) -> set[str]:
        """Requests whose held saves' blocks were read since the last call (vLLM frees them)."""
        with self._lock:
            out, self._sent = self._sent, set()
        return out

    def _give(self, slot: int | None) -> None:
        if slot is not None and self._slots is not None:
            self._slots.give(slot)
