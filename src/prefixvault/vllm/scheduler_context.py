"""What every part of the scheduler side shares: settings, layout, vault, counters, admission.

``SchedulerSide`` builds one ``SchedulerContext`` and hands it to each of its parts (restores,
save plans). The scheduler's thread, the lookup lane and the sample lane all count into its one
``SchedulerCounters``, which the connector reads by ``snapshot`` and maps field by field to its
metrics (``connector.py``, ``SCHEDULER_FIGURES``): a field's name is part of the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixvault.admission import Admission
from prefixvault.counters import Counters
from prefixvault.guard import Guard
from prefixvault.layout import CacheLayout
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.ledger import SavesInFlight
from prefixvault.vllm.request import TrackedRequest


@dataclass
class SchedulerCounters(Counters):
    """What the scheduler side did (its thread, the lookup and sample lanes all count here)."""

    lookups: int = 0  # requests looked up (a lookup held for a save in flight counts once)
    lookup_errors: int = 0
    hit_tokens: int = 0  # tokens vLLM allocated to load from the store
    refused: dict[str, int] = field(default_factory=dict)  # boundaries not saved, by ``Refusal``
    holds_dropped: dict[str, int] = field(default_factory=dict)  # by ``HoldDrop``
    # what ``restore_when`` judged, by ``lookup_`` or ``load_`` and the ``costs.Judgment``
    judged: dict[str, int] = field(default_factory=dict)
    # restores that lost their synchronous load, by why (``InStepLoss``): bytes that could not be
    # handed over (shared memory full), or the worker's mailbox found gone
    in_step_lost: dict[str, int] = field(default_factory=dict)
    plans: int = 0
    samples: int = 0
    sample_errors: int = 0
    busy_ns: int = 0  # wall time of vLLM's calls into the scheduler side (``connector.spent_in``)
    steps: int = 0  # steps built (``build_connector_meta``)


@dataclass(frozen=True, kw_only=True)
class SchedulerContext:
    """The scheduler side's settings, layout and vault; its counters and the guard its bugs
    are counted by; the admission policy (which boundaries to store, learning from restores);
    and the saves in flight (lookups of their prefixes wait for them)."""

    settings: ConnectorSettings
    layout: CacheLayout
    vault: Vault
    guard: Guard
    counters: SchedulerCounters
    admission: Admission
    in_flight: SavesInFlight

    def chain(self, tr: TrackedRequest, upto: int) -> list[bytes]:
        """The hashes naming a request's prefix of ``upto`` tokens (``TrackedRequest.chain``)."""
        return tr.chain(upto, self.layout.block_size, self.vault.prefix_hashes)
