"""Saves leave the step: ``wait_for_save`` only copies the objects into staging, a save thread
stores them and publishes the records, a save that does not fit staging is dropped and counted,
and a stopping worker stores what is queued. Real vault, store and CPU tensors; no engine."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_vault import BS, layout
from vllm_support.asking import ask as ask_side

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.stores.base import Buffer
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.metadata import LoadSpec, Release, SaveSpec, SavesSettled, save_id
from prefixvault.vllm.scheduler import SchedulerSide
from prefixvault.vllm.worker import WorkerSide

TOKENS = list(range(3 * BS))  # three blocks
STATE_BLOCK = 7


class GatedStore(MemoryStore):
    """Puts wait until ``gate`` is set: a store that is slow, on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self.gate.wait(10)
        return super().put_many(items)


def engine(vault: Vault, staging: int, drain: float = 30.0, strided: bool = False, hold: int = 0
           ) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A worker on CPU caches; ``strided``: the attention layer's blocks are not one run of
    bytes (heads outermost, vLLM's LHBNC layout)."""
    attn = torch.zeros(2, 16, BS, 4).permute(1, 0, 2, 3) if strided else torch.zeros(16, 2, BS, 4)
    caches = {"a": attn, "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    for name, t in caches.items():  # every block holds its own id (+ a per-layer offset)
        for b in range(16):
            t[b] = b + {"a": 0.25, "w": 0.5, "s": 0.75}[name]
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], staging_bytes=staging,
                        drain_timeout=drain, hold_bytes=hold)
    worker.register_kv_caches(caches)
    return worker, caches


def spec(vault: Vault, req: str = "r", tokens: list[int] = TOKENS) -> SaveSpec:
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(10, 10 + n))}
    d = plan_saves(vault.layout, len(tokens), tables, [StateCapture(2, len(tokens), STATE_BLOCK, 1)], step=1)
    return SaveSpec(req, hashes, list(d.publishable))


def settle(worker: WorkerSide, want: set[str], timeout: float = 5.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + timeout
    while not want <= got and time.monotonic() < deadline:
        got.update(sid for sid, _ in worker.take_settled())
        time.sleep(0.005)
    return got


def restored(vault: Vault, worker: WorkerSide, caches: dict[str, torch.Tensor],
             state: float = STATE_BLOCK + 0.75) -> None:
    """Load the saved boundary into fresh blocks 11..13 (state 14) and check the bytes are
    the ones the engine held when the save was made."""
    for t in caches.values():
        t[11:15] = -1
    hashes = vault.hashes(TOKENS)
    worker.load([LoadSpec("back", hashes, 3 * BS, 0, ([11, 12, 13], [0, 12, 13], [0, 0, 14]))])
    assert settle_loads(worker) == ({"back"}, set()), worker.counters.failure_reasons
    assert np.all(caches["a"][11:14].numpy() == np.array([1.25, 2.25, 3.25])[:, None, None, None])
    assert np.all(caches["w"][13].numpy() == 12.5)  # a one-block window needs the last block only
    assert np.all(caches["s"][14].numpy() == state)


def wait_published(worker: WorkerSide, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while worker.counters.published < n and time.monotonic() < deadline:
        time.sleep(0.005)


def settle_loads(worker: WorkerSide) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done, failed = worker.take_finished()
        if done:
            return done, failed
        time.sleep(0.005)
    return set(), set()


@pytest.mark.parametrize("strided", [False, True])
def test_a_save_returns_before_the_store_and_keeps_the_bytes_of_its_step(strided: bool) -> None:
    store = GatedStore()
    vault = Vault(store, layout())
    worker, caches = engine(vault, staging=1 << 20, strided=strided)
    store.gate.clear()  # the store does not answer yet
    t0 = time.monotonic()
    worker.step([spec(vault)], [], step=3)
    assert time.monotonic() - t0 < 0.5, "wait_for_save waited for the store"
    assert worker.take_settled() == []  # not stored yet
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 0
    for t in caches.values():  # the next step reuses the blocks
        t[:] = 99
    store.gate.set()
    assert settle(worker, {save_id(3, "r")}) == {save_id(3, "r")}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    assert worker.counters.published == 1
    restored(vault, worker, caches)
    worker.close()


def test_without_staging_a_save_is_stored_in_the_step() -> None:
    vault = Vault(MemoryStore(), layout())
    worker, _ = engine(vault, staging=0)
    worker.step([spec(vault)], [], step=1)
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS  # before step() returned
    assert worker.take_settled() == [(save_id(1, "r"), True)]
    worker.close()


def test_a_save_that_does_not_fit_is_dropped_counted_and_settled() -> None:
    store = GatedStore()
    vault = Vault(store, layout())
    first = spec(vault)
    objects, _ = vault.objects_of(0, first.hashes, first.plans)
    one = sum(vault.layout.groups[ref.group].nbytes(0) for ref, _ in objects)
    worker, _ = engine(vault, staging=one + one // 2)  # room for one save in flight
    store.gate.clear()
    worker.step([spec(vault, "a")], [], step=1)
    worker.step([spec(vault, "b", [*TOKENS[: 2 * BS], *range(500, 500 + BS)])], [], step=1)  # staging is full
    assert worker.counters.save_dropped == {"staging_full": 1}
    assert worker.take_settled() == [(save_id(1, "b"), False)]  # dropped: settled at once, unpublished
    store.gate.set()
    assert settle(worker, {save_id(1, "a")}) == {save_id(1, "a")}
    worker.step([spec(vault, "c", [*TOKENS[: 2 * BS], *range(600, 600 + BS)])], [], step=2)  # room again
    assert settle(worker, {save_id(2, "c")}) == {save_id(2, "c")}
    assert worker.counters.published == 2
    worker.close()
    other = Vault(MemoryStore(), layout())
    small, _ = engine(other, staging=one // 2)
    small.step([spec(other)], [], step=1)
    assert small.counters.save_dropped == {"too_large": 1}
    small.close()


def test_a_stopping_worker_stores_its_queued_saves() -> None:
    store = GatedStore()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20)
    store.gate.clear()
    prompts = [[*TOKENS[: 2 * BS], *range(1000 + BS * i, 1000 + BS * (i + 1))] for i in range(5)]
    for i, prompt in enumerate(prompts):
        worker.step([spec(vault, f"r{i}", prompt)], [], step=i)
    threading.Timer(0.2, store.gate.set).start()
    assert worker.close()  # waits for the five: drained
    assert worker.counters.published == 5
    for prompt in prompts:
        assert vault.lookup(vault.hashes(prompt), 3 * BS + 1) == 3 * BS


def test_saves_queued_behind_a_slow_store_are_stored_in_one_batch() -> None:
    """A store slower than the engine makes saves queue up; the save thread then stores all of
    them with one existence check and one put, and publishes their records with one more
    check and one conditional put, not round trips per save."""

    class CountingGated(GatedStore):
        puts = 0
        record_puts = 0

        def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
            CountingGated.puts += 1
            return super().put_many(items)

        def put_if_absent(self, key: str, data: Buffer) -> bool:
            CountingGated.record_puts += "/r/" in key  # a record's (not the layout's)
            return super().put_if_absent(key, data)

        def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
            CountingGated.record_puts += 1
            return [MemoryStore.put_if_absent(self, k, d) for k, d in items]

    store = CountingGated()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20)
    store.gate.clear()
    prompts = [[*TOKENS[: 2 * BS], *range(2000 + BS * i, 2000 + BS * (i + 1))] for i in range(6)]
    for i, prompt in enumerate(prompts):
        worker.step([spec(vault, f"q{i}", prompt)], [], step=i)
    store.gate.set()
    assert settle(worker, {save_id(i, f"q{i}") for i in range(6)}) == {save_id(i, f"q{i}") for i in range(6)}
    assert CountingGated.puts <= 2  # the first save, maybe alone, then the five queued behind it
    assert CountingGated.record_puts <= 2  # their records: as many batches
    assert worker.counters.published == 6
    for prompt in prompts:
        assert vault.lookup(vault.hashes(prompt), 3 * BS + 1) == 3 * BS
    worker.close()


def test_a_stopping_worker_waits_no_longer_than_its_drain_timeout(caplog: pytest.LogCaptureFixture) -> None:
    store = GatedStore()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20, drain=0.3)
    store.gate.clear()
    worker.step([spec(vault)], [], step=1)
    worker.step([spec(vault, "r2", [*TOKENS[: 2 * BS], *range(500, 500 + BS)])], [], step=1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vllm.prefixvault"):
        drained = worker.close()
    assert time.monotonic() - t0 < 2
    assert "saves not stored at shutdown" in caplog.text
    assert not drained  # a put is still running: whoever owns the store must not close it
    store.gate.set()


class StuckGets(MemoryStore):
    """A store whose reads hang (a server that stopped answering) until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        self.gate.wait(30)
        return super().get_into(keys, buffers)


def test_a_stopping_worker_abandons_a_stuck_load_within_its_deadline_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32: the load thread's shutdown had no deadline, so one stuck load hung engine
    shutdown; and close() never said whether its threads were done."""
    import prefixvault.vllm.loads as loads_module

    monkeypatch.setattr(loads_module, "LOAD_DRAIN_S", 0.3)
    store = StuckGets()
    store.gate.set()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20)
    worker.step([spec(vault)], [], step=1)
    wait_published(worker)
    store.gate.clear()
    hashes = vault.hashes(TOKENS)
    back = LoadSpec("back", hashes, 3 * BS, 0, ([11, 12, 13], [0, 12, 13], [0, 0, 14]))
    worker.load([back, LoadSpec("queued", hashes, 3 * BS, 0, ([11, 12, 13], [0, 12, 13], [0, 0, 14]))])
    time.sleep(0.1)  # the first load is inside the store now
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vllm.prefixvault"):
        drained = worker.close()
    assert time.monotonic() - t0 < 2 and not drained
    assert "load lane closing" in caplog.text and "still running" in caplog.text
    store.gate.set()


def _request(rid: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt), cache_salt=None,
                           lora_request=None, mm_features=None)


def _first_step(side: SchedulerSide, rid: str, prompt: list[int]) -> Any:
    """The scheduler output of a step that prefills ``prompt`` up to its last full block (the
    step ends there, as chunk alignment makes it), with the state kept in ``STATE_BLOCK``."""
    n = len(prompt) // BS
    states = [0] * (n + 1)
    states[n - 1] = STATE_BLOCK
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: n * BS},
        kv_connector_block_state=SimpleNamespace(
            boundary_state_offloads={},
            get_block_ids=lambda r: (list(range(1, n + 2)), list(range(10, n + 11)), states)),
    )


@pytest.mark.parametrize("settled", [True, False])
def test_a_lookup_waits_for_a_save_of_its_prefix_in_flight(settled: bool) -> None:
    """The next turn of a conversation arrives while the previous turn's save is still being
    stored: it is held (undetermined) until the workers report the save settled, then hits;
    a report that never comes holds it for lookup_timeout at most, then it is looked up."""
    store = GatedStore()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20)
    side = SchedulerSide(ConnectorSettings(lookup_timeout=0.3), vault.layout, vault, load=True, save=True)
    first = [*TOKENS, 777]
    assert ask_side(side, _request("t1", first)) == (0, False)
    meta = side.build_connector_meta(_first_step(side, "t1", first))
    assert [s.req_id for s in meta.saves] == ["t1"], side.counters.refused
    store.gate.clear()
    worker.step(meta.saves, [], meta.step)
    nxt = _request("t2", [*TOKENS, 888, 889])
    for _ in range(5):
        assert side.get_num_new_matched_tokens(nxt, 0) == (None, False)  # held
        time.sleep(0.01)
    store.gate.set()
    done = settle(worker, {save_id(meta.step, "t1")})
    if settled:
        side.settle(SavesSettled(Counter(done)))
        assert ask_side(side, nxt) == (3 * BS, True)
    else:  # the report is lost: the request is held no longer than lookup_timeout
        t0 = time.monotonic()
        assert ask_side(side, nxt) == (3 * BS, True)
        assert 0.1 < time.monotonic() - t0 < 1.0
    assert side.counters.lookups == 2  # a held lookup is one lookup
    assert vault.counters.misses["no_record"] == 1  # t1's; t2's held answer was never counted
    side.close()
    worker.close()


def test_a_save_not_published_makes_the_next_one_start_from_its_parent() -> None:
    """A dropped save leaves no record at its boundary: the request's next save must not name
    it as parent (it would never publish), but carry the blocks from the last published one."""
    vault = Vault(MemoryStore(), layout())
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=True)
    prompt = [*range(6 * BS), 999]
    assert ask_side(side, _request("t", prompt)) == (0, False)
    first = _first_step(side, "t", prompt[: 3 * BS + 1])  # the first three blocks
    meta = side.build_connector_meta(first)
    (s1,) = meta.saves
    assert s1.parent == 0 and max(p.tokens for p in s1.plans) == 3 * BS
    side.settle(SavesSettled(Counter([save_id(meta.step, "t")]), Counter([save_id(meta.step, "t")])))
    states = [0] * 7
    states[5] = STATE_BLOCK
    nxt = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["t"], num_computed_tokens=[3 * BS]),
        num_scheduled_tokens={"t": 3 * BS},
        kv_connector_block_state=SimpleNamespace(
            boundary_state_offloads={},
            get_block_ids=lambda r: (list(range(1, 8)), list(range(10, 17)), states)),
    )
    (s2,) = side.build_connector_meta(nxt).saves
    assert s2.parent == 0  # not 3 * BS: that record never came
    top = max(s2.plans, key=lambda p: p.tokens)
    assert top.tokens == 6 * BS
    assert sorted({i for g, i, _ in top.blocks if g == 0}) == list(range(6))
    side.close()


# -- held saves (output_boundaries: last) ---------------------------------------------------------

def held(vault: Vault, req: str = "r", tokens: list[int] = TOKENS) -> SaveSpec:
    return dataclasses.replace(spec(vault, req, tokens), hold=True)


@pytest.mark.parametrize("staging", [0, 1 << 20])
def test_a_held_save_stores_the_state_of_its_step_when_its_request_finishes(staging: int) -> None:
    vault = Vault(MemoryStore(), layout())
    worker, caches = engine(vault, staging=staging, hold=1 << 20)
    worker.step([held(vault)], [], step=1)
    caches["s"][STATE_BLOCK] = 5.0  # a later decode step writes the state block...
    worker.step([held(vault)], [], step=2)  # ...and the next output boundary replaces the hold
    assert worker.take_settled() == [] and vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 0
    assert worker.holds._slots is not None and worker.holds._slots.taken == 1  # one slot per request
    caches["s"][STATE_BLOCK] = 99.0  # decoding goes on past the last boundary
    worker.step([], [Release("r", True)], step=9)
    assert worker.take_sent() == {"r"}  # its blocks were read: vLLM may free them
    assert settle(worker, {save_id(9, "r")}) == {save_id(9, "r")}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    restored(vault, worker, caches, state=5.0)  # the held state, not the engine's block now
    assert worker.holds._slots.taken == 0
    worker.close()


@pytest.mark.parametrize("staging", [0, 1 << 20])
def test_a_hold_whose_keys_come_with_its_release_is_stored_under_them(staging: int) -> None:
    """Async scheduling: a held save planned before its tokens were known carries no hashes
    (``SaveSpec.deferred``); its release names them, and the held state is stored under them."""
    vault = Vault(MemoryStore(), layout())
    worker, caches = engine(vault, staging=staging, hold=1 << 20)
    deferred = dataclasses.replace(held(vault), hashes=[], deferred=True)
    worker.step([deferred], [], step=1)
    caches["s"][STATE_BLOCK] = 99.0  # decoding goes on past the boundary
    worker.step([], [Release("r", True, vault.hashes(TOKENS))], step=9)
    assert worker.take_sent() == {"r"}
    assert settle(worker, {save_id(9, "r")}) == {save_id(9, "r")}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    restored(vault, worker, caches)  # the state held at its step, under the keys named at release
    worker.close()


@pytest.mark.parametrize("staging", [0, 1 << 20])
def test_a_running_requests_release_stores_its_hold_and_never_reports_it_sent(staging: int) -> None:
    """``output_boundaries: every`` under async scheduling: a deferred hold released while its
    request still runs (``Release.running``) is stored under the keys its release names; the
    request is not reported sent (vLLM would free a running request's blocks), and an error
    of ours after the release settles the save once, not twice."""
    vault = Vault(MemoryStore(), layout())
    worker, caches = engine(vault, staging=staging, hold=1 << 20)
    deferred = dataclasses.replace(held(vault), hashes=[], deferred=True)
    worker.step([deferred], [], step=1)
    caches["s"][STATE_BLOCK] = 99.0  # the next decode step advances the state in place
    release = Release("r", True, vault.hashes(TOKENS), running=True)
    worker.step([], [release], step=3)
    assert worker.take_sent() == set()
    assert settle(worker, {release.sid(3)}) == {release.sid(3)}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    restored(vault, worker, caches)  # the state held at its step
    assert worker.holds._slots is not None and worker.holds._slots.taken == 0 and not worker.holds._held
    worker.step([deferred], [], step=4)
    worker.step([], [dataclasses.replace(release, hashes=[])], step=5)  # a release naming no keys: dropped
    worker.fail_releases([dataclasses.replace(release, hashes=[])], step=5)  # (then an error after it)
    assert worker.take_settled() == [(release.sid(5), False)] and worker.take_sent() == set()
    assert worker.holds._slots.taken == 0
    worker.fail_releases([release], step=6)  # an error of ours in a step, then another after it
    worker.fail_releases([release], step=6)
    assert worker.take_settled() == [(release.sid(6), False)]
    worker.close()


def test_a_release_and_a_new_hold_of_the_same_request_in_one_step() -> None:
    """A request preempted while holding drops its hold; computed again, it may hold anew in
    the same step the drop reaches the workers: the drop goes first, the new hold stays."""
    vault = Vault(MemoryStore(), layout())
    worker, caches = engine(vault, staging=1 << 20, hold=1 << 20)
    worker.step([held(vault)], [], step=1)
    caches["s"][STATE_BLOCK] = 5.0
    worker.step([held(vault)], [Release("r", False)], step=2)
    assert "r" in worker.holds._held
    worker.step([], [Release("r", True)], step=3)
    assert worker.take_sent() == {"r"}
    assert settle(worker, {save_id(3, "r")}) == {save_id(3, "r")}
    restored(vault, worker, caches, state=5.0)
    worker.close()


def test_holds_without_room_are_dropped_and_a_release_always_reports_the_request() -> None:
    vault = Vault(MemoryStore(), layout())
    state_bytes = vault.layout.groups[2].nbytes(0)
    worker, _ = engine(vault, staging=1 << 20, hold=state_bytes)  # one slot
    worker.step([held(vault, "a"), held(vault, "b", [*TOKENS[: 2 * BS], *range(500, 500 + BS)])], [], step=1)
    assert worker.counters.save_dropped == {"hold_full": 1}
    worker.step([], [Release("b", True), Release("a", False)], step=2)  # b has no hold; a dropped
    assert worker.take_sent() == {"b"} and worker.take_settled() == [(save_id(2, "b"), False)]
    assert worker.holds._slots is not None and worker.holds._slots.taken == 0
    worker.step([held(vault, "c")], [], step=3)
    worker.fail_releases([Release("c", True)], step=4)  # an error of ours while releasing
    assert worker.take_sent() == {"c"} and worker.take_settled() == [(save_id(4, "c"), False)]
    assert worker.holds._slots.taken == 0
    worker.close()
    tiny, _ = engine(vault, staging=1 << 20, hold=state_bytes - 1)
    tiny.step([held(vault)], [], step=1)
    assert tiny.counters.save_dropped == {"hold_too_large": 1}
    tiny.close()


# -- kernel blocks, and a worker that cannot use its caches ---------------------------------------

KBS = BS // 2  # tokens per kernel block: a backend that cuts each block in two


def kernel_cut(blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer as vLLM hands it to a backend that cuts blocks in two (``[2 * blocks,
    H, BS / 2, C]``, heads outside tokens), and its logical blocks read by plain slicing."""
    kernel = torch.rand(2 * blocks, 2, KBS, 4, generator=g)
    logical = torch.stack([kernel[2 * b : 2 * b + 2].permute(1, 0, 2, 3).reshape(2, BS, 4)
                           for b in range(blocks)])
    return kernel, logical


def test_bytes_saved_on_kernel_blocks_restore_on_an_engine_without() -> None:
    """An engine on FlashInfer (kernel blocks) and one on FlashAttention (none) share objects:
    a worker given the engine's block count views kernel blocks as the manager's blocks."""
    g = torch.Generator().manual_seed(3)
    vault = Vault(MemoryStore(), layout())
    kernel, logical = kernel_cut(16, g)
    window, _ = kernel_cut(16, g)
    caches = {"a": kernel, "w": window, "s": torch.rand(16, 4, 4, generator=g)}
    unaware = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], staging_bytes=1 << 20)
    with pytest.raises(ValueError, match="cache group 0 has 128 bytes per block on rank 0, layout says 256"):
        unaware.register_kv_caches(caches)  # kernel blocks taken for blocks: refused, never half-copied
    unaware.close()
    producer = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], staging_bytes=1 << 20,
                          num_blocks=16)
    producer.register_kv_caches(caches)
    producer.step([spec(vault)], [], step=1)
    assert settle(producer, {save_id(1, "r")}) == {save_id(1, "r")}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    producer.close()
    consumer = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], num_blocks=16)
    plain = {"a": torch.zeros(16, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    consumer.register_kv_caches(plain)
    tables = ([11, 12, 13], [0, 12, 13], [0, 0, 14])
    consumer.load([LoadSpec("back", vault.hashes(TOKENS), 3 * BS, 0, tables)])
    assert settle_loads(consumer) == ({"back"}, set()), consumer.counters.failure_reasons
    assert torch.equal(plain["a"][11:14].view(torch.uint8), logical[1:4].view(torch.uint8))
    assert torch.equal(plain["s"][14], caches["s"][STATE_BLOCK])
    assert not plain["a"][:11].any() and not plain["a"][14:].any()
    consumer.close()


def test_a_worker_that_cannot_use_its_caches_is_disabled_and_answers_everything_at_once() -> None:
    vault = Vault(MemoryStore(), layout())
    caches = {"a": torch.zeros(24, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], staging_bytes=1 << 20,
                        hold_bytes=1 << 20, num_blocks=16)
    with pytest.raises(ValueError, match="layer a has 24 blocks, not a multiple of the engine's 16"):
        worker.register_kv_caches(caches)
    with pytest.raises(ValueError, match=r"cache group 1: no tensor registered for layers \['w'\]"):
        worker.register_kv_caches({"a": caches["a"][:16]})
    worker.disable("no usable cache")
    assert worker.disabled == "no usable cache"
    worker.step([spec(vault, "r"), held(vault, "h")], [Release("done", True), Release("gone", False)], step=4)
    assert sorted(worker.take_settled()) == [(save_id(4, "done"), False), (save_id(4, "r"), False)]
    assert worker.take_sent() == {"done"}  # vLLM frees its blocks; "gone" was never held
    worker.step([], [Release("h", True)], step=5)  # the hold was never made: settled, sent
    assert worker.take_settled() == [(save_id(5, "h"), False)] and worker.take_sent() == {"h"}
    worker.load([LoadSpec("back", vault.hashes(TOKENS), 3 * BS, 0, ([11, 12, 13], [0, 12, 13], [0, 0, 14]))])
    assert worker.take_finished() == ({"back"}, {"back"})  # at once, not from the load thread
    assert worker.counters.failure_reasons == {"disabled": 1}
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 0
    assert all(not t.any() for t in caches.values())
    worker.close()


class FailingGets(MemoryStore):
    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        from prefixvault.stores.base import StoreUnavailable

        raise StoreUnavailable("the store is down")


def test_a_load_tells_our_errors_from_the_stores() -> None:
    """Issue 32: any exception in a load, an IndexError in our block mapping say, was counted
    as a ``store_error``: a bug looked like a flaky store. Now a store's failure is the store's
    and anything else is an internal error, logged with its traceback by the guard."""
    store = MemoryStore()
    vault = Vault(store, layout())
    worker, _ = engine(vault, staging=1 << 20)
    worker.step([spec(vault)], [], step=1)
    wait_published(worker)
    hashes = vault.hashes(TOKENS)
    # Block ids past the engine's 16 blocks: our mapping fails, not the store.
    worker.load([LoadSpec("ours", hashes, 3 * BS, 0, ([91, 92, 93], [0, 92, 93], [0, 0, 94]))])
    assert settle_loads(worker) == ({"ours"}, {"ours"})
    assert worker.counters.failure_reasons == {"internal_error": 1}
    assert worker.guard.errors["load"] == 1
    worker.close()

    down = Vault(FailingGets(), layout())
    worker, _ = engine(down, staging=1 << 20)
    worker.load([LoadSpec("theirs", hashes, 3 * BS, 0, ([11, 12, 13], [0, 12, 13], [0, 0, 14]))])
    assert settle_loads(worker) == ({"theirs"}, {"theirs"})
    assert worker.counters.failure_reasons == {"store_error": 1}
    assert worker.guard.total == 0
    worker.close()
