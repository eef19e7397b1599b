"""Loads run beside the engine: ``start_load_kv`` only queues them, a load thread reads,
verifies and writes the objects into the request's blocks, and the request is reported
finished only after they landed. Real vault, store and CPU tensors; no engine."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from test_vault import BS, fill, layout

from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.metadata import LoadSpec
from prefixvault.vllm.worker import WorkerSide

TOKENS = list(range(64))


class SlowStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        time.sleep(self.delay)
        return super().get_into(keys, buffers)


def test_a_slow_load_does_not_hold_the_step_and_lands_before_it_is_reported() -> None:
    store = SlowStore()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    store.delay = 0.3
    caches = {"a": torch.zeros(16, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])
    spec = LoadSpec("r", hashes[:5], 40, 0, ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7]))
    t0 = time.monotonic()
    worker.load([spec])
    assert time.monotonic() - t0 < 0.05, "start_load_kv waited for the store"
    assert worker.take_finished() == (set(), set())  # not reported before it landed
    deadline = time.monotonic() + 5
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done, failed = worker.take_finished()
    assert done == {"r"} and not failed
    # the payloads fill() stored: engine block id + 0.5 (KV), 200 + boundary + 0.5 (state)
    assert np.all(caches["a"][1].numpy() == 1.5) and np.all(caches["a"][5].numpy() == 5.5)
    assert np.all(caches["w"][6].numpy() == 104.5)
    assert np.all(caches["s"][7].numpy() == 240.5)
    assert np.all(caches["a"][0].numpy() == 0)  # nothing else written
    worker.close()


def test_a_failed_load_is_reported_failed() -> None:
    vault = Vault(MemoryStore(), layout())
    caches = {"a": torch.zeros(16, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])  # nothing stored
    worker.load([LoadSpec("r", hashes[:5], 40, 0, ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7]))])
    worker.close()  # waits for the queued load
    assert worker.take_finished() == ({"r"}, {"r"})
    assert worker.counters.load_failures == 1
