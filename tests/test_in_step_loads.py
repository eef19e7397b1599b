"""Synchronous loads (``vllm/mailbox.py``): the lookup reads a hit's objects ahead, the scheduler
hands them to the worker of its own process, and the worker writes them before the step's
forward, the state also into the running blocks vLLM's pre-copy would have read it for. Real
vault, store and CPU tensors; no engine (the contract suite drives vLLM's scheduler)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from test_vault import fill, layout

from prefixvault.codec import HEADER_SIZE, ObjectKind
from prefixvault.guard import Guard
from prefixvault.keys import ExtraKeys
from prefixvault.objects import ObjectRef
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault
from prefixvault.vllm.in_step import InStepHandover, ReadAhead, ReadAheadBudget
from prefixvault.vllm.lookups import Lookups
from prefixvault.vllm.mailbox import Mailboxes, MemoryMailbox
from prefixvault.vllm.metadata import LoadMode, LoadSpec
from prefixvault.vllm.worker import WorkerSide

TOKENS = list(range(64))
TABLE = ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 7])


def _caches() -> dict[str, torch.Tensor]:
    return {"a": torch.full((16, 2, 8, 4), -1.0), "w": torch.full((16, 2, 8, 4), -1.0),
            "s": torch.full((16, 4, 4), -1.0)}


def _worker(vault: Vault, caches: dict[str, torch.Tensor]) -> WorkerSide:
    """A worker writing loads into ``caches``, taking synchronous loads' bytes from a mailbox."""
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], load_in_step=True)
    worker.register_kv_caches(caches)
    worker.mailbox = MemoryMailbox()
    return worker


def _objects(vault: Vault, hashes: list[bytes]) -> dict[str, memoryview]:
    """What a scheduler hands over for the load of 40 tokens: each object as stored, by key."""
    loaded = vault.load(vault.needed(hashes[:5], 40, ranks=[0]), borrow=False, stored=True)
    return {r.key: o for r, o in loaded.objects.items()}


def _ask(min_tokens: int) -> dict[str, Any]:
    """A lookup of the first 41 tokens, past the engine's ``min_tokens``."""
    return dict(prompt=TOKENS[:41], extra=ExtraKeys(), known=[], num_tokens=41, min_tokens=min_tokens,
                saving=None)


def test_a_lookup_reads_ahead_every_object_its_hits_load_needs() -> None:
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    budget = ReadAheadBudget(1 << 20)
    lookups = Lookups(vault, Guard(), budget=budget)
    hashes, found, ahead = lookups.submit(**_ask(16), read_from=16).result(5)
    assert found is not None and found.hit == 40 and ahead is not None
    objects = ahead.objects
    needed = vault.needed(hashes[:5], 40, ranks=[0], since=16)
    assert set(objects) == set(needed)  # the KV past the engine's 16 tokens and the state at 40
    assert all(len(vault.open_sealed(r, objects[r])) == vault.layout.groups[r.group].nbytes(0)
               for r in needed)
    assert budget.held == sum(len(o) for o in objects.values())  # held until the scheduler lets go
    # each object in memory of its own: a hit held keeps no other hit's bytes alive
    assert len({id(o.obj) for o in objects.values()}) == len(objects)
    ahead.release()
    ahead.release()  # (once: a second release gives nothing back)
    assert budget.held == 0
    # without read_from: the answer alone
    assert lookups.submit(**_ask(16)).result(5)[2] is None
    lookups.close(1)


def corrupt_state(store: MemoryStore, vault: Vault) -> str:
    """Fill ``vault`` with boundaries 16 and 40, then spoil the last bytes of the state at 40
    (there, but rejected where it is read); its key."""
    fill(vault, TOKENS, [16, 40])
    state = next(r for r in vault.needed(vault.hashes(TOKENS[:41])[:5], 40, ranks=[0]) if r.group == 2)
    good = store.get_many([state.key])[0]
    assert good is not None
    store.put_many([(state.key, [bytes(good)[:-4] + b"\xff\xff\xff\xff"])])
    return state.key


def test_a_hit_whose_objects_cannot_be_read_ahead_is_still_answered() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    corrupt_state(store, vault)
    budget = ReadAheadBudget(1 << 20)
    lookups = Lookups(vault, Guard(), budget=budget)
    _, found, ahead = lookups.submit(**_ask(0), read_from=0).result(5)
    assert found is not None and found.hit == 40 and ahead is None  # its load reads for itself
    assert budget.held == 0


def test_a_hit_larger_than_the_read_ahead_budget_is_not_read_ahead() -> None:
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    budget = ReadAheadBudget(100)  # fewer bytes than one KV block of this layout
    _, found, ahead = Lookups(vault, Guard(), budget=budget).submit(**_ask(0), read_from=0).result(5)
    assert found is not None and found.hit == 40 and ahead is None and budget.held == 0


def test_a_synchronous_load_is_written_at_once_its_state_also_into_the_blocks_named() -> None:
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = _worker(vault, caches)
    hashes = vault.hashes(TOKENS[:41])
    assert worker.mailbox is not None
    objects = _objects(vault, hashes)
    payload_bytes = sum(len(o) - HEADER_SIZE for o in objects.values())
    token = worker.mailbox.put("r", objects, step=3)
    spec = LoadSpec("r", hashes[:5], 40, 0, TABLE, mode=LoadMode.HANDED_OVER, token=token,
                    state_copies=[(2, 7), (2, 11), (2, 12)])
    worker.load([spec], step=3)
    # written before load() returned, on the engine's thread; never reported to vLLM as a transfer
    assert np.all(caches["a"][1].numpy() == 1.5) and np.all(caches["a"][5].numpy() == 5.5)
    assert np.all(caches["w"][6].numpy() == 104.5)
    for block in (7, 11, 12):
        assert np.all(caches["s"][block].numpy() == 240.5)
    assert np.all(caches["s"][13].numpy() == -1) and np.all(caches["a"][0].numpy() == -1)
    assert worker.take_finished() == (set(), set()) and worker.take_unloaded() == set()
    assert worker.counters.loads == 1 and worker.counters.loads_in_step == 1
    assert worker.counters.loads_in_step_read == 0  # every byte handed over
    assert worker.counters.loaded_tokens == 40 and len(worker.mailbox) == 0
    # what the step spent on it, for the scheduler's estimates (a step's compute is the rest)
    nbytes, seconds = worker.take_in_step_measured()
    assert nbytes == payload_bytes and seconds > 0
    assert worker.take_in_step_measured() == (0, 0.0)
    worker.close()


def test_a_synchronous_load_whose_bytes_were_not_handed_over_reads_them_in_the_step() -> None:
    """An error of ours on the scheduler's side (``READ_IN_STEP``), or payloads put for another
    token: the worker reads the objects from the store itself, before the forward."""
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = _worker(vault, caches)
    hashes = vault.hashes(TOKENS[:41])
    worker.load([LoadSpec("r", hashes[:5], 40, 16, TABLE, mode=LoadMode.READ_IN_STEP,
                          state_copies=[(2, 11)]),
                 LoadSpec("q", hashes[:5], 40, 0, ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 12]),
                          mode=LoadMode.HANDED_OVER, token=7, state_copies=[(2, 13)])], step=1)
    assert np.all(caches["a"][5].numpy() == 5.5) and np.all(caches["a"][1].numpy() == 1.5)
    for block in (7, 11, 12, 13):
        assert np.all(caches["s"][block].numpy() == 240.5)
    assert worker.take_unloaded() == set() and worker.counters.loads_in_step == 2
    assert worker.counters.loads_in_step_read == 2
    worker.close()


@pytest.mark.parametrize("secret", [False, True], ids=["checksum", "mac"])
def test_bytes_changed_after_they_were_handed_over_never_reach_the_cache(secret: bool) -> None:
    """The worker verifies what it was handed by the rules of every read: a byte changed in the
    mailbox (a file in shared memory another process of this user can write) is refused like a
    byte changed in the store, and the object read from the store instead."""
    key = NamespaceKey.derive(b"s" * 32, "ns") if secret else None
    vault = Vault(MemoryStore(), layout(), "ns", key)
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = _worker(vault, caches)
    hashes = vault.hashes(TOKENS[:41])
    objects = {k: memoryview(bytearray(o)) for k, o in _objects(vault, hashes).items()}
    state = next(k for k in objects if "/s/" in k)
    objects[state][-1] ^= 0x01  # one bit of the state's payload
    assert worker.mailbox is not None
    token = worker.mailbox.put("r", objects, step=3)
    worker.load([LoadSpec("r", hashes[:5], 40, 0, TABLE, mode=LoadMode.HANDED_OVER, token=token,
                          state_copies=[(2, 7)])], step=3)
    assert np.all(caches["s"][7].numpy() == 240.5)  # the store's bytes, not the changed ones
    assert worker.take_unloaded() == set() and worker.counters.loads_in_step == 1
    assert worker.counters.loads_in_step_read == 1
    assert vault.counters.rejected == {"mac" if secret else "payload checksum": 1}
    worker.close()


class _StuckStore(MemoryStore):
    """A store whose reads wait until ``release`` is set (as behind another process's lock);
    a stand-in: a real store cannot be made to stall on cue without one."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.stuck = False

    def get_into(self, keys: Any, buffers: Any) -> Any:
        if self.stuck:
            self.release.wait(30)
        return super().get_into(keys, buffers)


def test_the_engines_thread_waits_for_the_store_no_longer_than_the_loads_deadline() -> None:
    store = _StuckStore()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    caches = _caches()
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], load_in_step=True, load_timeout=0.3)
    worker.register_kv_caches(caches)
    hashes = vault.hashes(TOKENS[:41])
    store.stuck = True
    t0 = time.monotonic()
    worker.load([LoadSpec("r", hashes[:5], 40, 0, TABLE, mode=LoadMode.READ_IN_STEP, state_copies=[(2, 7)])],
                step=1)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2, waited
    assert worker.counters.failure_reasons == {"timeout": 1} and worker.take_unloaded()
    # the read still inside the store refuses the next at once, never queues it behind
    t0 = time.monotonic()
    worker.load([LoadSpec("q", hashes[:5], 40, 0, TABLE, mode=LoadMode.READ_IN_STEP, state_copies=[(2, 8)])],
                step=2)
    assert time.monotonic() - t0 < 0.2 and worker.counters.failure_reasons == {"timeout": 1, "busy": 1}
    store.release.set()
    assert worker.close()
    assert all(np.all(caches["s"][b].numpy() == -1) for b in (7, 8))  # the late bytes never written


def test_a_synchronous_load_that_cannot_be_written_is_reported_as_unloaded_blocks() -> None:
    """vLLM's protocol for a failed synchronous load: the blocks it did not write (vLLM
    recomputes from the first, or stops an engine of several cache groups rather than compute
    on a state never written). Here: objects the store lost before the step read them, and a
    load naming no running state block (align mode's pre-copy would have left it stale)."""
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [40])
    caches = _caches()
    worker = _worker(vault, caches)
    hashes = vault.hashes(TOKENS[:41])
    lost = vault.hashes(list(range(100, 141)))  # nothing stored
    worker.load([LoadSpec("lost", lost[:5], 40, 16, TABLE, mode=LoadMode.READ_IN_STEP,
                          state_copies=[(2, 11)]),
                 LoadSpec("unnamed", hashes[:5], 40, 0, ([1, 2, 3, 4, 5], [9, 9, 9, 9, 6], [0, 0, 0, 0, 8]),
                          mode=LoadMode.READ_IN_STEP)],
                step=1)
    # lost: KV blocks past its 16 local tokens (both attention groups) and its state block;
    # unnamed: its own
    assert worker.take_unloaded() == {3, 4, 5, 9, 6, 7} | {1, 2, 3, 4, 5, 9, 6, 8}
    assert worker.take_unloaded() == set()
    assert worker.counters.load_failures == 2 and worker.counters.loads_in_step == 0
    assert worker.counters.failure_reasons == {"missing": 1, "internal_error": 1}
    assert all(np.all(c.numpy() == -1) for c in caches.values())
    assert worker.take_finished() == (set(), set())
    nbytes, seconds = worker.take_in_step_measured()  # nothing written: no bytes; their time still the step's
    assert nbytes == 0 and seconds > 0
    worker.close()


def test_payloads_of_a_step_no_load_took_are_let_go() -> None:
    handoff = MemoryMailbox()
    first = handoff.put("a", {}, step=1)
    second = handoff.put("b", {}, step=2)
    assert handoff.take("b", second, step=2) == {}
    assert len(handoff) == 0  # "a", put for step 1, is let go of when step 2 takes its own
    assert handoff.take("a", first, step=2) is None
    again = handoff.put("c", {}, step=3)
    assert handoff.take("c", again + 1, step=3) is None  # another token: not these payloads


def test_only_an_engine_whose_worker_serves_handoffs_gets_synchronous_loads() -> None:
    assert Mailboxes.find("engine-x") is None and Mailboxes.find(None) is None
    handoff = Mailboxes.serve("engine-x", "uni")
    assert handoff is not None and Mailboxes.find("engine-x") is handoff
    MemoryMailbox("engine-x").withdraw()  # another worker's: not this one's to withdraw
    assert Mailboxes.find("engine-x") is handoff
    handoff.withdraw()
    assert Mailboxes.find("engine-x") is None
    assert Mailboxes.serve("engine-x", "ray") is None  # a worker of another executor: none


def test_losing_the_workers_mailbox_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    lost: list[str] = []
    handover = InStepHandover(layout(), ReadAheadBudget(1 << 20), "engine-z", lambda why: lost.append(why))
    assert not handover.reads_ahead()  # never found: nothing to say
    mailbox = Mailboxes.serve("engine-z", "uni")
    assert not handover.reads_ahead()  # looked for once a step: found in the next
    handover.next_step()
    assert mailbox is not None and handover.reads_ahead()
    mailbox.withdraw()
    with caplog.at_level(logging.WARNING, logger="vllm.prefixvault"):
        handover.next_step()
        assert not handover.reads_ahead() and not handover.reads_ahead()
        handover.next_step()
        assert not handover.reads_ahead()
    assert caplog.text.count("mailbox for synchronous loads is gone") == 1
    assert lost == ["mailbox_gone"]  # counted once (``in_step_lost``)


def test_the_workers_mailbox_is_looked_for_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking for a shared mailbox reads shared memory and ``/proc``; a step's asks (several
    calls each) look once, and the next step looks again (a mailbox withdrawn meanwhile is
    found gone there: within a step, a put then fails or the worker reads the store)."""
    mailbox = Mailboxes.serve("engine-w", "uni")
    finds: list[str | None] = []
    real = Mailboxes.find
    monkeypatch.setattr(Mailboxes, "find",
                        lambda engine_id, root=None: finds.append(engine_id) or real(engine_id))
    handover = InStepHandover(layout(), ReadAheadBudget(1 << 20), "engine-w")
    for _ in range(5):
        assert handover.reads_ahead() and handover.mailbox() is mailbox
    assert finds == ["engine-w"]
    assert mailbox is not None
    mailbox.withdraw()
    assert handover.reads_ahead()  # (this step's answer)
    handover.next_step()
    assert not handover.reads_ahead() and finds == ["engine-w", "engine-w"]


def one_object_read_ahead() -> tuple[ObjectRef, ReadAhead]:
    ref = ObjectRef("k", ObjectKind.BLOCK, 0, 0, b"h", 16, 0)
    return ref, ReadAhead(objects={ref: memoryview(b"x")}, nbytes=1, budget=ReadAheadBudget(1 << 20))


def test_a_mailbox_withdrawn_within_a_step_is_never_promised_a_load() -> None:
    """The mailbox found at a step's first ask is kept for its other asks: withdrawn meanwhile
    (the worker released its caches), a put is refused, so the load is asynchronous, never a
    synchronous one no worker takes, and the loss is ``mailbox_gone``, said once."""
    lost: list[str] = []
    mailbox = Mailboxes.serve("engine-v", "uni")
    assert mailbox is not None
    handover = InStepHandover(layout(), ReadAheadBudget(1 << 20), "engine-v", lambda why: lost.append(why))
    assert handover.reads_ahead()
    ref, ahead = one_object_read_ahead()
    assert handover.hand_over("a", ahead, [ref], step=1) > 0
    mailbox.withdraw()
    assert handover.hand_over("b", ahead, [ref], step=1) == 0
    assert handover.hand_over("c", ahead, [ref], step=1) == 0 and lost == ["mailbox_gone"]
    assert len(mailbox) == 0  # (what it held goes with it)


def test_a_put_refused_by_a_mailbox_still_served_is_a_failed_handover(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared memory full: the mailbox is still there, so the loss is ``handover_failed``."""
    lost: list[str] = []
    mailbox = Mailboxes.serve("engine-u", "uni")
    assert isinstance(mailbox, MemoryMailbox)

    def full(*args: object) -> int:
        raise OSError(28, "no space left")

    monkeypatch.setattr(mailbox, "put", full)
    handover = InStepHandover(layout(), ReadAheadBudget(1 << 20), "engine-u", lambda why: lost.append(why))
    ref, ahead = one_object_read_ahead()
    assert handover.hand_over("a", ahead, [ref], step=1) == 0 and lost == ["handover_failed"]
    assert handover.reads_ahead()  # (still served: the next restore tries again)
    mailbox.withdraw()


def test_an_engine_id_two_workers_of_one_process_serve_is_served_by_neither() -> None:
    """Two engines built from one ``KVTransferConfig`` share vLLM's engine id: their schedulers
    could not tell whose worker takes their bytes, so both restore asynchronously."""
    first = Mailboxes.serve("engine-y", None)
    assert first is not None and Mailboxes.serve("engine-y", "uni") is None
    assert Mailboxes.find("engine-y") is None
