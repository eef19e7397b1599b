"""What the scheduler side tells the workers each step (pickled to every rank).

The one module of the worker's that names vLLM: without vLLM installed (a device machine
running ``bench/gpu_check.py``) its two base classes are stood in for, so ``WorkerSide`` and
everything it imports can be driven with torch alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from prefixvault.boundary import SavePlan

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorMetadata,
            KVConnectorWorkerMetadata,
        )
    except ModuleNotFoundError as e:  # no vLLM at all: the worker driven by bench/gpu_check.py
        if e.name != "vllm":
            raise

        class KVConnectorMetadata:
            """Stands in for vLLM's base class where vLLM is not installed."""

        class KVConnectorWorkerMetadata:
            """Stands in for vLLM's base class where vLLM is not installed."""

            def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
                return self


class LoadMode(Enum):
    """How a worker runs a load (``vllm/in_step.py`` for the synchronous ones)."""

    ASYNC = "async"  # on the load lane, beside the steps; reported through ``get_finished``
    # Synchronous (vLLM runs it before the step's forward, the request's first chunk in the
    # same step): written from the bytes the scheduler handed over under ``LoadSpec.token``...
    HANDED_OVER = "handed_over"
    # ...or, where they were not handed over (an error of ours on the scheduler's side), read
    # from the store in the step.
    READ_IN_STEP = "read_in_step"


@dataclass
class LoadSpec:
    """Load boundary ``tokens`` of a request into its freshly allocated blocks."""

    req_id: str
    hashes: list[bytes]
    tokens: int
    local_tokens: int  # already in the engine's own prefix cache; not loaded again
    block_ids: tuple[list[int], ...]  # per cache group, by block index
    mode: LoadMode = LoadMode.ASYNC
    token: int = 0  # HANDED_OVER: the mailbox token its bytes were handed over under (never 0)
    # Synchronous loads only: (group, block) the boundary's state is also written into: the
    # running state block of every request scheduled this step whose state vLLM's runner copies
    # from the block this load fills (align mode's pre-copy runs before the load), this request's
    # own included.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # The request's cache salt: its tenant, whose key its objects are read with (``tenancy``);
    # None: the namespace's. Never logged.
    salt: str | None = field(default=None, repr=False)

    @property
    def in_step(self) -> bool:
        """Whether the load is synchronous: written before the step's forward."""
        return self.mode is not LoadMode.ASYNC


@dataclass
class SaveSpec:
    """Boundaries of a request to save after this step's forward."""

    req_id: str
    hashes: list[bytes]
    plans: list[SavePlan]
    parent: int = 0  # an earlier boundary whose record covers the KV blocks the plans skip
    # Held (``output_boundaries: last``): the workers copy only the states now and keep them,
    # replacing the request's earlier hold; its KV blocks are read when the request finishes.
    hold: bool = False
    # The tail boundary it publishes (its one plan), 0 for block-aligned boundaries: then
    # ``hashes`` end with its tail hash, and ``seed`` (the chain's seed) names the tail index
    # of a tail inside the first block.
    tail: int = 0
    seed: bytes = b""
    # A held save whose boundary's tokens were not known when its step was planned (async
    # scheduling: the token a decode step consumes is still being sampled): ``hashes`` is empty,
    # and the ``Release`` that stores it names them (every token is known once it finishes).
    deferred: bool = False
    # The request's cache salt: its tenant, whose key its objects and records are sealed with
    # (``tenancy``); None: the namespace's. Never logged.
    salt: str | None = field(default=None, repr=False)

    def sid(self, step: int) -> str:
        """Names this save of ``step``, the same on the scheduler and every rank (a request may
        save its block-aligned boundaries and a tail boundary in one step)."""
        return save_id(step, self.req_id) + (f"+{self.tail}" if self.tail else "")


@dataclass
class Release:
    """A request's held save to store (``store``: its request did not fail, and vLLM keeps
    its blocks until every worker reports it sent) or drop: once the request finishes, or, for
    a deferred hold of ``output_boundaries: every``, once its tokens are known."""

    req_id: str
    store: bool
    hashes: list[bytes] = field(default_factory=list)  # a deferred hold's (``SaveSpec.deferred``)
    # The request is still running (``output_boundaries: every`` under async scheduling: its
    # deferred hold is stored once its tokens are known): its blocks are its own, so it is
    # never reported sent (vLLM would free the blocks of a running request).
    running: bool = False

    def sid(self, step: int) -> str:
        """Names the save it becomes (apart from a save the request plans in the same step)."""
        return save_id(step, self.req_id) + ("+held" if self.running else "")


@dataclass
class PrefixVaultMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    idle: bool = False  # the step computes no token (the engine waits, for loads among others)


def save_id(step: int, req_id: str) -> str:
    """Names one request's save of one step, the same on the scheduler and every rank."""
    return f"{step}:{req_id}"


@dataclass
class SavesSettled(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: saves stored or dropped, by
    ``save_id``, with how many ranks settled each (vLLM sums the ranks' reports); the ranks
    whose worker went off since (it writes no load: the scheduler stops offering hits); what
    their loads cost, beside the steps and in them (``prefixvault.costs``); and how deep a
    request whose load failed may still restore (``Loads.take_caps``)."""

    ranks: Counter[str] = field(default_factory=Counter)
    # saves some rank did not fully publish (dropped, failed, refused), by ranks
    failed: Counter[str] = field(default_factory=Counter)
    off: int = 0  # ranks whose worker went off, each reported once
    # bytes asynchronous loads wrote and seconds they took, summed over ranks (a rank's rate)
    load_bytes: int = 0
    load_s: float = 0.0
    # bytes synchronous loads wrote in the step and the seconds that step spent on them, the
    # most of any rank (the step waits for its slowest rank)
    in_step_bytes: int = 0
    in_step_s: float = 0.0
    # requests whose loads failed on some rank: the most tokens each may restore when looked
    # up again (the least over ranks)
    caps: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SavesSettled:
        if isinstance(other, SavesSettled):
            self.ranks.update(other.ranks)
            self.failed.update(other.failed)
            self.off += other.off
            self.load_bytes += other.load_bytes
            self.load_s += other.load_s
            self.in_step_bytes = max(self.in_step_bytes, other.in_step_bytes)
            self.in_step_s = max(self.in_step_s, other.in_step_s)
            for req_id, cap in other.caps.items():
                self.caps[req_id] = min(cap, self.caps.get(req_id, cap))
        return self
