"""What every part of one worker shares: the rank it serves, its caches, its vault, its counters.

``WorkerSide`` builds one ``WorkerContext`` and hands it to each of its parts (saves, holds,
loads, synchronous loads). The engine's thread, the save lane and the load lane all count into
its one ``WorkerCounters``, which the connector reads by ``snapshot`` and maps field by field to
its metrics (``connector.py``, ``WORKER_FIGURES``): a field's name is part of the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixvault.counters import Counters
from prefixvault.guard import Guard
from prefixvault.layout import CacheLayout
from prefixvault.vault import Vault
from prefixvault.vllm.engine_caches import EngineCaches


@dataclass
class WorkerCounters(Counters):
    """What a worker did (the engine's thread, the save and load lanes all count here)."""

    saved_boundaries: int = 0
    published: int = 0
    save_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_tokens: int = 0
    loads_in_step: int = 0  # synchronous loads written (``vllm/in_step.py``), among ``loads``
    loads_in_step_read: int = 0  # of those, read from the store in the step (not handed over)
    failure_reasons: dict[str, int] = field(default_factory=dict)  # failed loads, by ``LoadFailure``
    save_dropped: dict[str, int] = field(default_factory=dict)  # saves not stored, by ``SaveDrop``
    busy_ns: int = 0  # wall time of vLLM's calls into the worker side in its steps (``connector.spent_in``)


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """One worker's rank, caches, vault and counters, and the guard its bugs are counted by
    (every error is sorted by ``prefixvault.lane.report``)."""

    layout: CacheLayout
    rank: int
    vault: Vault | None  # None: no store (nothing is saved)
    caches: EngineCaches
    counters: WorkerCounters
    guard: Guard
