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


def test_a_load_larger_than_the_pinned_buffer_goes_through_it_in_pieces() -> None:
    """On a device, loaded objects go through one pinned buffer allocated at registration
    (never a fresh pinned allocation per load); a load larger than it goes in pieces. The
    piece logic is the same on CPU, where it is run here through a small buffer."""
    vault = Vault(MemoryStore(), layout())
    caches = {"a": torch.zeros(16, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(caches)
    assert worker._load_host is None  # CPU caches: loaded bytes are scattered directly
    io = worker._io[0]
    worker._load_host = torch.zeros(2 * io.object_bytes + 8, dtype=torch.uint8)  # two objects fit
    blocks = [3, 9, 4, 12, 7]
    payloads = [np.full(io.object_bytes // 4, i + 0.5, np.float32) for i in range(len(blocks))]
    worker._scatter_pinned(io, [(p.view(np.uint8).data, b) for p, b in zip(payloads, blocks, strict=True)],
                           None)
    for i, b in enumerate(blocks):
        assert np.all(caches["a"][b].numpy() == i + 0.5)
    untouched = [b for b in range(16) if b not in blocks]
    assert not caches["a"][untouched].any()
    worker.close()
