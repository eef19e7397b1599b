"""Worker side of the connector: one per tensor-parallel rank, the parts vLLM's worker calls reach.

``WorkerSide`` builds the parts and routes each call of the connector to its owner:

- ``engine_caches.py``: the engine's cache tensors as block I/O, and the memory copies use;
- ``saves.py``: saves copied into staging in the step, stored and published on the save lane,
  each settled;
- ``holds.py``: held output boundaries (``output_boundaries: last``), stored when their
  request finishes;
- ``loads.py``: asynchronous loads on the load lane, with deadlines;
- ``in_step.py``: synchronous loads, written in the engine's thread before the forward.

All of them count into one ``WorkerCounters`` and sort every error by one rule
(``prefixvault.lane.report``): the store's failure is a warning, a bug of ours is the guard's.

A worker whose caches cannot be used (``register_kv_caches`` raised) is ``disable``d by the
connector: every load fails at once (vLLM recomputes), every save is settled unpublished, every
held request is reported sent, and no cache tensor is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prefixvault.guard import Guard
from prefixvault.lane import Lane
from prefixvault.layout import CacheLayout
from prefixvault.vault import Vault
from prefixvault.vllm.engine_caches import EngineCaches
from prefixvault.vllm.holds import Holds
from prefixvault.vllm.in_step import InStepWrites
from prefixvault.vllm.loads import LOAD_DRAIN_S, LoadFailure, Loads
from prefixvault.vllm.mailbox import Mailbox
from prefixvault.vllm.metadata import LoadSpec, Release, SaveSpec
from prefixvault.vllm.saves import Saves
from prefixvault.vllm.worker_context import WorkerContext, WorkerCounters

log = logging.getLogger("vllm.prefixvault")


class WorkerSide:
    """One rank's worker: each call of the connector, routed to the part that owns it."""

    def __init__(
        self, layout: CacheLayout, vault: Vault | None, rank: int, layer_groups: Sequence[Sequence[str]],
        staging_bytes: int = 0, drain_timeout: float = 30.0, hold_bytes: int = 0,
        num_blocks: int | None = None, guard: Guard | None = None, load_timeout: float = 5.0,
        load_in_step: bool = False, save_device_bytes: int | None = None,
    ) -> None:
        """``num_blocks``: the engine's manager blocks (``KVCacheConfig.num_blocks``); a layer
        with more (kernel blocks) is viewed as that many manager blocks. ``guard``: where errors
        of ours (not the store's) are counted and logged, the connector's own. ``load_timeout``:
        the fixed part of a load's deadline (its bytes add to it). ``load_in_step``:
        ``take_finished`` waits for the loads queued since the last call up to
        ``IN_STEP_WAIT_S`` (``restore_in_step``). ``save_device_bytes``: the device buffer one
        step's gathers go through on CUDA (``config.save_device_bytes``)."""
        self.guard = guard or Guard()
        self.layout = layout
        self.rank = rank
        self.counters = WorkerCounters()
        self._vault = vault
        self._drain_timeout = drain_timeout
        self._disabled: str | None = None  # why the worker touches no cache tensor (``disable``)
        self.caches = EngineCaches(layout, rank, layer_groups, num_blocks, save_device_bytes)
        ctx = WorkerContext(layout=layout, rank=rank, vault=vault, caches=self.caches, counters=self.counters,
                            guard=self.guard)
        self.saves = Saves(ctx, staging_bytes=staging_bytes, drain_timeout=drain_timeout)
        self.holds = Holds(ctx, self.saves, hold_bytes=hold_bytes)
        self.loads = Loads(ctx, load_timeout=load_timeout, wait_in_step=load_in_step)
        self.in_step = InStepWrites(ctx, self.loads.deadline)

    @property
    def mailbox(self) -> Mailbox | None:
        """Where the scheduler of this process hands the payloads of synchronous loads (set by
        the connector once the caches are registered)."""
        return self.in_step.mailbox

    @mailbox.setter
    def mailbox(self, mailbox: Mailbox | None) -> None:
        self.in_step.mailbox = mailbox

    @property
    def lanes(self) -> list[Lane[Any]]:
        return [self.saves.lane, self.loads.lane, self.in_step.lane]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Block I/O for every cache group, checked against the layout, and the memory the
        copies use. Raises one ``ValueError`` if the caches cannot be used; the worker then
        holds nothing of them and can be ``disable``d."""
        try:
            self.caches.register(kv_caches)
            self.saves.allocate()
            self.holds.allocate()
        except ValueError:
            self.caches.unregister()
            raise
        except Exception as e:  # e.g. no memory left for a buffer: one clear error all the same
            self.caches.unregister()
            raise ValueError(f"prefixvault: cannot use the engine's cache tensors: {e!r}") from e

    def disable(self, reason: str) -> None:
        """Stop touching the engine's caches (they could not be registered, say): from now on
        every load fails at once, every save is settled unpublished, every held request is
        reported sent. Saves already staged are still stored."""
        if self._disabled is None:
            log.warning("prefixvault: worker off (%s): loads are recomputed, nothing is saved", reason)
        self._disabled = reason
        self.caches.let_go()

    @property
    def disabled(self) -> str | None:
        """Why the worker is off, or None."""
        return self._disabled

    def step(self, saves: Sequence[SaveSpec], releases: Sequence[Release], step: int) -> None:
        """One step's work: first the finished requests' held saves (a request preempted and
        computed again may drop its old hold and hold anew in the same step), then the saves,
        each copied out of the engine's blocks in this step. Every save is settled, whatever
        happens to it (a held one when its request is released)."""
        if self._disabled is not None:
            self.holds.fail_releases(releases, step)  # held requests reported sent, their saves settled
            for spec in saves:
                if not spec.hold:  # a hold is settled when its request is released
                    self.saves.settle(spec.sid(step), False)
            return
        if not releases and (not saves or self._vault is None):
            return
        # Every gather of the step (releases' blocks, holds' states, saves) queued together: the
        # engine's stream waits once, for the device-side copies only.
        with self.caches.one_step():
            if releases:
                self.holds.release(releases, step)
            if saves and self._vault is not None:
                for spec in saves:
                    if spec.hold:
                        self.holds.hold(spec, spec.sid(step))
                    else:
                        self.saves.save(spec, spec.sid(step))

    def load(self, specs: Sequence[LoadSpec], step: int = 0) -> None:
        """Write the synchronous loads of ``step`` now (vLLM calls this before the step's
        forward when it has any); queue the others on the load lane, each reported by
        ``take_finished`` once done. On a device, the writes wait for the engine's work queued
        by now (marked before any load is queued)."""
        in_step = [s for s in specs if s.in_step]
        later = [s for s in specs if not s.in_step]
        if self._disabled is not None:
            for spec in in_step:
                self.in_step.unwritten(spec, LoadFailure.DISABLED)
            self.loads.fail(later, LoadFailure.DISABLED)
            return
        try:
            marks = self.caches.mark()
        except Exception:
            for spec in in_step:
                self.in_step.unwritten(spec, LoadFailure.INTERNAL_ERROR)
            raise
        for spec in in_step:
            self.in_step.write(spec, marks, step)
        self.loads.queue(later, marks)

    def load_deadline(self, spec: LoadSpec) -> float:
        """Seconds a load may take: ``load_timeout`` plus its bytes at ``LOAD_FLOOR_BYTES_PER_S``."""
        return self.loads.deadline(spec)

    def fail_loads(self, specs: Sequence[LoadSpec], reason: LoadFailure = LoadFailure.INTERNAL_ERROR) -> None:
        """Report loads that could not run (an error of ours): vLLM recomputes them."""
        self.loads.fail(specs, reason)

    def fail_releases(self, releases: Sequence[Release], step: int) -> None:
        """After an error of ours in ``step``: every request to store is still reported sent
        (its blocks must be freed) and its save settled."""
        self.holds.fail_releases(releases, step)

    def take_finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Loads finished (and of them, failed) since the last call (``Loads.take_finished``)."""
        return self.loads.take_finished(idle)

    def take_sent(self) -> set[str]:
        """Requests whose held saves' blocks were read since the last call (vLLM frees them)."""
        return self.holds.take_sent()

    def take_settled(self) -> list[tuple[str, bool]]:
        """Saves stored or dropped since the last call: (``save_id``, all published)."""
        return self.saves.take_settled()

    def take_load_measured(self) -> tuple[int, float]:
        """Bytes asynchronous loads wrote and the seconds they took, since the last call (the
        scheduler's restore cost estimates, ``prefixvault.costs``)."""
        return self.loads.measured.take()

    def take_in_step_measured(self) -> tuple[int, float]:
        """Bytes synchronous loads wrote and the seconds their steps spent on them (loads not
        written too), since the last call (``InStepWrites.measured``): a step's time less
        these is its compute."""
        return self.in_step.measured.take()

    def take_load_caps(self) -> dict[str, int]:
        """Requests whose loads failed since the last call, with the most tokens each may
        restore when it is looked up again (``Loads.take_caps``)."""
        return self.loads.take_caps()

    def take_unloaded(self) -> set[int]:
        """Blocks of synchronous loads not written since the last call (vLLM's
        ``get_block_ids_with_load_errors``)."""
        return self.in_step.take_unloaded()

    def close(self) -> bool:
        """Store the saves still queued (up to ``drain_timeout``; those left are dropped), drop
        the loads not started, wait for a running one (up to ``LOAD_DRAIN_S``). Returns whether
        both lanes are idle: if not, one is still inside a store call, and the store must stay
        open under it (the caller closes it only when every side drained)."""
        saves_done = self.saves.close()
        loads_done = self.loads.close(self._drain_timeout)
        reads_done = self.in_step.close(min(LOAD_DRAIN_S, self._drain_timeout))
        return saves_done and loads_done and reads_done
