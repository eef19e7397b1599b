"""A worker that goes off tells its scheduler, once (``SavesSettled.off``): the scheduler then
offers no hit (tests/contract: ``test_a_worker_gone_off_stops_hits_and_saves``). Real worker,
vault and store; the connector's worker-side hook called on a stand-in for the connector
(building a real one needs a vLLM config)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from test_vault import layout

from prefixvault.guard import Guard
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.connector import PrefixVaultConnector
from prefixvault.vllm.metadata import SavesSettled
from prefixvault.vllm.worker import WorkerSide


def test_a_worker_gone_off_is_reported_once_and_ranks_add_up() -> None:
    vault = Vault(MemoryStore(), layout())
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    side = SimpleNamespace(worker=worker, guard=Guard(), _off_reported=False)
    build = PrefixVaultConnector.build_connector_worker_meta
    assert build(side) is None  # (nothing settled, nothing to say)
    worker.disable("its cache tensors could not be registered")
    first = build(side)
    assert isinstance(first, SavesSettled) and first.off == 1
    assert build(side) is None  # once
    total = SavesSettled(Counter({"1:r": 1}), off=1).aggregate(SavesSettled(off=1))
    assert isinstance(total, SavesSettled) and total.off == 2 and total.ranks == Counter({"1:r": 1})
    worker.close()


def test_ranks_report_a_failed_loads_depth_and_the_least_is_kept() -> None:
    """Each rank says how deep a request whose load failed may still restore; over ranks the
    scheduler keeps the least (a boundary is good only where every rank's objects are)."""
    a = SavesSettled(caps={"r": 32, "q": 8})
    merged = a.aggregate(SavesSettled(caps={"r": 16}))
    assert isinstance(merged, SavesSettled) and merged.caps == {"r": 16, "q": 8}
