"""Verification samples are written off the engine's thread: a slow store never holds the
step that finishes a sampled request, samples in flight are bounded, and closing the
connector lets the ones being written land."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from test_vault import fill, layout
from vllm_support.asking import ask

from prefixvault.samples import pending_samples
from prefixvault.stores.base import Buffer
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm import scheduler as scheduler_module
from prefixvault.vllm import verify_samples
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.scheduler import SchedulerSide

TOKENS = list(range(64))


class SlowPuts(MemoryStore):
    """Puts wait until ``release`` is set (a stalled network store); reads answer at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()  # a put is waiting

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self.started.set()
        self.release.wait(10)
        return super().put_many(items)


def restored(side: SchedulerSide, rid: str) -> Any:
    """A greedy request that restored 40 tokens and generated some."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None, output_token_ids=[5, 6, 7],
                          sampling_params=SimpleNamespace(temperature=0.0))
    n, load = ask(side, req)
    assert (n, load) == (40, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1] * 6, [1] * 6, [1] * 6)), n)
    return req


def test_a_stalled_store_does_not_hold_the_step_that_finishes_a_sampled_request() -> None:
    store = SlowPuts()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    side = SchedulerSide(ConnectorSettings(verify_sample=1.0), vault.layout, vault, load=True, save=False)
    req = restored(side, "r1")
    store.release.clear()
    t0 = time.monotonic()
    assert side.request_finished(req) is False
    assert time.monotonic() - t0 < 0.1, "request_finished waited for the store"
    assert side.counters.samples == 1 and not list(pending_samples(store))
    threading.Timer(0.2, store.release.set).start()
    assert side.close()  # the sample being written lands before the connector is gone
    (_, sample), = pending_samples(store)
    assert sample is not None and sample.hit == 40 and sample.output == [5, 6, 7]
    assert side.counters.sample_errors == 0


def test_samples_in_flight_are_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(verify_samples, "MAX_PENDING_SAMPLES", 2)
    monkeypatch.setattr(scheduler_module, "SAMPLE_DRAIN_S", 0.1)
    store = SlowPuts()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    side = SchedulerSide(ConnectorSettings(verify_sample=1.0), vault.layout, vault, load=True, save=False)
    reqs = [restored(side, f"b{i}") for i in range(4)]
    store.release.clear()
    store.started.clear()
    side.request_finished(reqs[0])
    assert store.started.wait(5)  # the first is being written (a batch of one)
    for r in reqs[1:]:
        side.request_finished(r)
    # two in flight (one written, one queued); the next two dropped and counted
    assert (side.counters.samples, side.counters.sample_errors) == (4, 2)
    # gives up waiting after SAMPLE_DRAIN_S (the engine's shutdown is not held), drops the one
    # queued (counted), and says the store must stay open for the one being written
    assert side.close() is False
    assert side.counters.sample_errors == 3
    store.release.set()
