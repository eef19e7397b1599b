"""Loads run beside the engine: ``start_load_kv`` only queues them, a load thread reads,
verifies and writes the objects into the request's blocks, and the request is reported
finished only after they landed. Real vault, store and CPU tensors; no engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
from test_vault import BS, fill, layout

from prefixvault.stores.breaker import BreakerStore
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
    assert worker.caches._load_buffer is None  # CPU caches: loaded bytes are scattered directly
    io = worker.caches.ios[0]
    worker.caches._load_buffer = torch.zeros(2 * io.object_bytes + 8, dtype=torch.uint8)  # two objects fit
    blocks = [3, 9, 4, 12, 7]
    payloads = [np.full(io.object_bytes // 4, i + 0.5, np.float32) for i in range(len(blocks))]
    items = [(p.view(np.uint8).data, b) for p, b in zip(payloads, blocks, strict=True)]
    worker.caches._write_pinned(io, items, None)
    for i, b in enumerate(blocks):
        assert np.all(caches["a"][b].numpy() == i + 0.5)
    untouched = [b for b in range(16) if b not in blocks]
    assert not caches["a"][untouched].any()
    worker.close()


class GatedGets(MemoryStore):
    """Records every read; a read waits while ``gate`` is clear (a store that stalls)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()
        self.reads: list[list[str]] = []

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        self.reads.append(list(keys))
        self.reading.set()
        self.gate.wait(30)
        return super().get_into(keys, buffers)


def _caches() -> dict[str, torch.Tensor]:
    return {"a": torch.full((16, 2, BS, 4), -1.0), "w": torch.full((16, 2, BS, 4), -1.0),
            "s": torch.full((16, 4, 4), -1.0)}


def _finished(worker: WorkerSide, want: int, timeout: float = 5.0) -> tuple[set[str], set[str]]:
    done: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < want and time.monotonic() < deadline:
        d, f = worker.take_finished()
        done |= d
        failed |= f
        time.sleep(0.005)
    return done, failed


def test_loads_queued_together_are_read_in_one_round_trip_and_a_shared_object_once() -> None:
    """Issue 32: loads were one request per round trip on one thread, so N restored requests
    over a 20 ms link waited N x 20 ms. Loads queued by the time the load lane is free go to
    the store as one batch, and an object two of them need is read once."""
    store = GatedGets()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])
    store.gate.clear()
    worker.load([LoadSpec("first", hashes[:5], 40, 0, ([1, 2, 3, 4, 5], [0, 0, 0, 0, 6], [0, 0, 0, 0, 7]))])
    assert store.reading.wait(5)  # the first load is inside the store
    # six requests restoring the same 16-token boundary into blocks of their own
    tables = [([6, 7], [0, 8], [0, 8]), ([9, 10], [0, 9], [0, 9]), ([11, 12], [0, 10], [0, 10]),
              ([13, 14], [0, 11], [0, 11]), ([15, 1], [0, 12], [0, 12]), ([2, 3], [0, 13], [0, 13])]
    specs = [LoadSpec(f"r{i}", hashes[:2], 16, 0, t) for i, t in enumerate(tables)]
    worker.load(specs)
    store.gate.set()
    done, failed = _finished(worker, 7)
    assert done == {"first", *(s.req_id for s in specs)} and not failed
    assert len(store.reads) == 2, store.reads  # the first load, then the six as one batch
    assert len(store.reads[1]) == len(set(store.reads[1])) == 4  # 2 KV blocks, 1 window block, 1 state
    for (a, w, s) in tables[:4]:  # fill() stored engine block id + 0.5 (KV), 200 + boundary + 0.5 (state)
        assert np.all(caches["a"][a[0]].numpy() == 1.5) and np.all(caches["a"][a[1]].numpy() == 2.5)
        assert np.all(caches["w"][w[1]].numpy() == 101.5)
        assert np.all(caches["s"][s[1]].numpy() == 216.5)
    assert worker.counters.loads == 7 and worker.counters.loaded_tokens == 40 + 6 * 16
    worker.close()


def test_a_load_past_its_deadline_is_recomputed_never_written_late_and_counts_for_the_breaker() -> None:
    """Issue 32: a load had no deadline, so a store that hangs without an error held its
    request forever and never tripped the breaker. Past ``load_timeout`` (plus its bytes at
    the floor rate) the load is reported failed, its late bytes never land in blocks vLLM
    has since given to the recompute, and the breaker counts a failure."""
    inner = GatedGets()
    store = BreakerStore("memory://deadline", lambda uri: inner, store=inner)
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], load_timeout=0.2)
    worker.register_kv_caches(caches)
    spec = LoadSpec("r", vault.hashes(TOKENS[:41])[:5], 40, 0,
                    ([1, 2, 3, 4, 5], [0, 0, 0, 0, 6], [0, 0, 0, 0, 7]))
    assert 0.2 < worker.load_deadline(spec) < 0.25
    inner.gate.clear()
    t0 = time.monotonic()
    worker.load([spec])
    assert _finished(worker, 1) == ({"r"}, {"r"})
    assert 0.2 <= time.monotonic() - t0 < 2
    assert worker.counters.failure_reasons == {"timeout": 1}
    assert store.breaker._failures == 1
    inner.gate.set()  # the store answers, late
    deadline = time.monotonic() + 5
    while worker.loads.lane.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.loads.lane.busy
    for t in caches.values():
        assert np.all(t.numpy() == -1), "a load past its deadline wrote its bytes"
    assert worker.take_finished() == (set(), set())  # reported once
    assert worker.counters.loads == 1
    worker.close()


def test_with_a_hot_set_overlapping_and_later_restores_of_a_prefix_read_the_store_once() -> None:
    """Issue 33: a shared prefix was fetched from the store once per request. With the hot set
    (``load_cache_mib``), a load queued behind a load of the same boundary, and a later one,
    are served from the objects the first read."""
    store = GatedGets()
    fill(Vault(store, layout()), TOKENS, [16, 40])
    vault = Vault(store, layout(), hot_bytes=1 << 20)
    caches = _caches()
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])[:5]
    store.gate.clear()
    worker.load([LoadSpec("first", hashes, 40, 0, ([1, 2, 3, 4, 5], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1]))])
    assert store.reading.wait(5)
    worker.load([LoadSpec("overlap", hashes, 40, 0, ([6, 7, 8, 9, 10], [0, 0, 0, 0, 2], [0, 0, 0, 0, 2]))])
    store.gate.set()
    assert _finished(worker, 2) == ({"first", "overlap"}, set())
    worker.load([LoadSpec("later", hashes, 40, 0, ([11, 12, 13, 14, 15], [0, 0, 0, 0, 3], [0, 0, 0, 0, 3]))])
    assert _finished(worker, 1) == ({"later"}, set())
    assert len(store.reads) == 1  # one fetch for three restores
    for blocks, w in (([1, 2, 3, 4, 5], 1), ([6, 7, 8, 9, 10], 2), ([11, 12, 13, 14, 15], 3)):
        assert [float(caches["a"][b][0, 0, 0]) for b in blocks] == [1.5, 2.5, 3.5, 4.5, 5.5]
        assert np.all(caches["w"][w].numpy() == 104.5) and np.all(caches["s"][w].numpy() == 240.5)
    worker.close()


def test_a_load_that_started_writing_is_never_expired_under_it() -> None:
    """The expiry checks and ends a load in one hold of the lock: a load that moved to writing
    meanwhile lands and is reported once, as loaded (never failed while its bytes go in)."""
    from prefixvault.vllm.loads import LoadFailure, LoadJob, LoadState

    vault = Vault(MemoryStore(), layout())
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    job = LoadJob(spec=LoadSpec("r", [], 16, 0, ([1, 2], [0, 2], [0, 3])), marks=())
    assert worker.loads._begin_write(job) and job.state is LoadState.WRITING
    assert not worker.loads._end_load(job, False, LoadFailure.TIMEOUT, only=LoadState.QUEUED)
    assert job.state is LoadState.WRITING and worker.take_finished() == (set(), set())
    assert worker.loads._end_load(job, True)
    assert worker.take_finished() == ({"r"}, set()) and worker.counters.load_failures == 0
    worker.close()


def test_in_step_loads_are_waited_for_and_reported_in_the_step_they_were_planned_in() -> None:
    """``restore_in_step`` (a local store on CPU): ``get_finished`` waits for the step's loads
    (up to ``IN_STEP_WAIT_S``), so a restored request is reported in the step its load was
    planned in, and vLLM runs its first chunk in the next. A failed one is reported failed; one
    slower than the wait is reported in a later step, as beside the step."""
    store = GatedGets()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], load_in_step=True)
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])
    other = vault.hashes(list(range(100, 141)))  # nothing stored
    table = ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7])
    gone = ([8, 10, 11, 12, 13], [9, 9, 9, 9, 14], [0, 0, 0, 0, 15])
    worker.load([LoadSpec("r", hashes[:5], 40, 0, table), LoadSpec("gone", other[:5], 40, 0, gone)])
    assert worker.take_finished() == ({"r", "gone"}, {"gone"})  # no sleep: waited for
    assert np.all(caches["a"][5].numpy() == 5.5) and np.all(caches["s"][7].numpy() == 240.5)
    assert np.all(caches["a"][8].numpy() == -1) and np.all(caches["s"][15].numpy() == -1)
    store.gate.clear()  # a store slower than the step's wait
    worker.load([LoadSpec("slow", hashes[:5], 40, 0, table)])
    t0 = time.monotonic()
    assert worker.take_finished() == (set(), set())
    assert 0.04 <= time.monotonic() - t0 < 1.0  # waited IN_STEP_WAIT_S, not for the store
    store.gate.set()
    assert _finished(worker, 1) == ({"slow"}, set())
    worker.close()


def test_a_failed_load_says_how_deep_its_request_may_still_restore() -> None:
    """Issue 46: the next lookup of a request whose load failed stops short of what failed, so
    it restores the deepest boundary whose objects did not fail rather than the same one again:
    short of the first KV block missing, one token short of the load's boundary where its state
    failed, and what the engine held before the load where the load failed whole (a timeout)."""
    tables = ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7])
    for gone, want in (("kv", 2 * BS), ("state", 40 - 1), ("none", 8)):
        inner = GatedGets()
        vault = Vault(inner, layout())
        fill(vault, TOKENS, [16, 40])
        hashes = vault.hashes(TOKENS[:41])[:5]
        refs = vault.needed(hashes, 40, ranks=[0], since=8)
        if gone == "kv":
            inner.delete_many([r.key for r in refs if r.group == 0 and r.block_index in (2, 3)])
        elif gone == "state":
            inner.delete_many([r.key for r in refs if r.group == 2])
        else:
            inner.gate.clear()  # the store stalls: the load times out
        worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], load_timeout=0.2)
        worker.register_kv_caches(_caches())
        worker.load([LoadSpec("r", hashes, 40, 8, tables)])
        assert _finished(worker, 1) == ({"r"}, {"r"})
        assert worker.take_load_caps() == {"r": want}, gone
        assert worker.take_load_caps() == {}  # reported once
        inner.gate.set()
        worker.close()


def test_a_load_that_lands_leaves_no_cap() -> None:
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]])
    worker.register_kv_caches(_caches())
    worker.load([LoadSpec("r", vault.hashes(TOKENS[:41])[:5], 40, 0,
                          ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7]))])
    assert _finished(worker, 1) == ({"r"}, set())
    assert worker.take_load_caps() == {}
    worker.close()
