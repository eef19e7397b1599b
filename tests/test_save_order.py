"""A step's save holds the engine's stream for device-side copies only: every cache group's
gather is queued before the first transfer to the host, and the engine waits for one event
per step, recorded before any transfer. Stream operations recorded on CPU stand-ins
(``scenarios.stream_log``), with the bytes checked too."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_vault import BS, layout
from test_worker_saves import STATE_BLOCK, TOKENS, held, restored, settle, spec

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.scenarios.cache_layouts import attention_layers, state_layers
from prefixvault.scenarios.stream_log import Op, RecordingOps, engine_waits, held_for_transfers, host_waits
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.kernel_blocks import group_ios
from prefixvault.vllm.metadata import Release, SaveSpec, save_id
from prefixvault.vllm.worker import WorkerSide

BLOCKS = 12


def expected(layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    return torch.stack([torch.cat([t[b].contiguous().view(torch.uint8).reshape(-1) for t in layers])
                        for b in block_ids])


def three_groups(ops: RecordingOps, save_bytes: int | None = None) -> tuple[list, list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    groups = [attention_layers("LBNHC", 2, BLOCKS, 2, 4, 8, torch.bfloat16, generator=g),
              state_layers(2, BLOCKS, (16,), generator=g), state_layers(3, BLOCKS, (8,), generator=g)]
    caches = {f"g{gi}l{li}": t for gi, layers in enumerate(groups) for li, t in enumerate(layers)}
    names = [[f"g{gi}l{li}" for li in range(len(layers))] for gi, layers in enumerate(groups)]
    return group_ios(caches, names, BLOCKS, save_bytes=save_bytes, ops=ops), groups


def first(ops: list[Op], what: str) -> int:
    return next(i for i, op in enumerate(ops) if op.what == what)


def last(ops: list[Op], what: str) -> int:
    return max(i for i, op in enumerate(ops) if op.what == what)


def test_every_groups_gather_is_queued_before_any_transfer_and_the_engine_waits_once() -> None:
    ops = RecordingOps()
    ios, groups = three_groups(ops)
    ids = [[3, 1, 7, 0], [5], [2, 9]]
    outs = [torch.zeros(len(b), io.object_bytes, dtype=torch.uint8) for io, b in zip(ios, ids, strict=True)]
    batch = ios[0].save_batch()
    assert batch is not None
    done = [io.gather(b, out, batch) for io, b, out in zip(ios, ids, outs, strict=True)]
    assert ops.log == []  # nothing queued before the step's saves are all known
    batch.issue()
    log = ops.take()
    assert {op.group for op in log if op.what == "gather"} == {0, 1, 2}
    assert last(log, "gather") < first(log, "to_host")
    waits = engine_waits(log)
    assert len(waits) == 1
    recorded = next(i for i, op in enumerate(log) if op.what == "record" and op.event == waits[0].event)
    assert last(log, "gather") < recorded < first(log, "to_host")
    assert not held_for_transfers(log) and batch.rounds == 1
    for d in done:
        d.wait()
    for layers, b, out in zip(groups, ids, outs, strict=True):
        assert torch.equal(out, expected(layers, b))


def test_a_save_larger_than_the_device_buffer_goes_in_rounds_and_still_one_wait() -> None:
    """The buffer bound holds: past it the engine waits for the earlier rounds' transfers."""
    ops = RecordingOps()
    ios, groups = three_groups(ops, save_bytes=1)  # one object of the largest group
    batch = ios[0].save_batch()
    assert batch is not None and ios[0]._streams is not None
    assert ios[0]._streams.save.buffer.numel() == max(io.object_bytes for io in ios)
    outs = [torch.zeros(2, io.object_bytes, dtype=torch.uint8) for io in ios]
    for io, out in zip(ios, outs, strict=True):
        io.gather([4, 8], out, batch)
    batch.issue()
    log = ops.take()
    assert batch.rounds > 1 and len(engine_waits(log)) == 1 and held_for_transfers(log)
    for layers, out in zip(groups, outs, strict=True):
        assert torch.equal(out, expected(layers, [4, 8]))


def test_the_save_lane_waits_until_the_engines_thread_issued_the_step() -> None:
    ops = RecordingOps()
    ios, groups = three_groups(ops)
    batch = ios[1].save_batch()
    assert batch is not None
    out = torch.zeros(1, ios[1].object_bytes, dtype=torch.uint8)
    done = ios[1].gather([6], out, batch)
    waited = threading.Event()

    def lane() -> None:
        done.wait()
        waited.set()

    t = threading.Thread(target=lane)
    t.start()
    assert not waited.wait(0.2) and ops.log == []  # another thread never issues the engine's work
    batch.issue()
    t.join(5)
    assert waited.is_set() and torch.equal(out, expected(groups[1], [6]))


def worker_on(ops: RecordingOps, vault: Vault, hold_bytes: int = 0
              ) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """The worker of test_worker_saves on CPU tensors, its copies queued through ``ops``."""
    caches = {"a": torch.zeros(16, 2, BS, 4), "w": torch.zeros(16, 2, BS, 4), "s": torch.zeros(16, 4, 4)}
    for name, t in caches.items():
        for b in range(16):
            t[b] = b + {"a": 0.25, "w": 0.5, "s": 0.75}[name]
    worker = WorkerSide(vault.layout, vault, 0, [["a"], ["w"], ["s"]], staging_bytes=1 << 20,
                        hold_bytes=hold_bytes)
    worker.caches.stream_ops = ops
    worker.register_kv_caches(caches)
    return worker, caches


def test_a_workers_step_of_several_saves_holds_the_engine_once_and_restores_exactly() -> None:
    ops = RecordingOps()
    vault = Vault(MemoryStore(), layout())
    worker, caches = worker_on(ops, vault)
    other = [t + 1000 for t in TOKENS]
    for step in (1, 2):
        worker.step([spec(vault), spec(vault, "q", other)], [], step=step)
        log = ops.take()
        assert {op.group for op in log if op.what == "gather"} == {0, 1, 2}
        assert last(log, "gather") < first(log, "to_host")
        assert len(engine_waits(log)) == 1 and not held_for_transfers(log)
    for t in caches.values():  # the next step reuses the blocks
        t[:] = 99
    want = {save_id(step, req) for step in (1, 2) for req in "rq"}
    assert settle(worker, want) == want
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    restored(vault, worker, caches)  # load -> scatter, through the same stand-ins
    assert any(op.what == "to_device" for op in ops.take())
    assert np.all(caches["s"][14].numpy() == STATE_BLOCK + 0.75)
    worker.close()


def one_wait_for_device_copies(log: list[Op], groups: set[int]) -> None:
    """The step's gathers (of ``groups``) all before the first transfer, the engine's stream
    waiting once and for device-side copies only, the engine's thread never for a transfer."""
    assert {op.group for op in log if op.what == "gather"} == groups
    assert last(log, "gather") < first(log, "to_host")
    assert len(engine_waits(log)) == 1 and not held_for_transfers(log)
    assert host_waits(log) == []


def test_output_boundaries_go_with_the_steps_saves_and_the_engines_thread_never_waits_for_them() -> None:
    """``output_boundaries``: a hold's states (copied in its step) and, when its request
    finishes, its release's blocks are gathered with the step's other saves; yet the state
    stored is the one of the hold's step, and the request is reported sent in its step."""
    ops = RecordingOps()
    vault = Vault(MemoryStore(), layout())
    worker, caches = worker_on(ops, vault, hold_bytes=1 << 20)
    other = [t + 1000 for t in TOKENS]
    worker.step([held(vault), spec(vault, "q", other)], [], step=1)
    one_wait_for_device_copies(ops.take(), {0, 1, 2})
    assert worker.holds._held["r"].copies  # the state's gather, waited for only by the save lane
    caches["s"][STATE_BLOCK] = 99.0  # decoding goes on: the state block moves past the boundary
    worker.step([spec(vault, "q", other)], [Release("r", True)], step=2)
    one_wait_for_device_copies(ops.take(), {0, 1, 2})
    assert worker.take_sent() == {"r"}
    want = {save_id(1, "q"), save_id(2, "q"), save_id(2, "r")}
    assert settle(worker, want) == want
    assert worker.holds._slots is not None and worker.holds._slots.taken == 0
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    restored(vault, worker, caches)  # the state of step 1, not the engine's block now
    worker.close()


def test_a_save_failing_mid_step_costs_that_save_only_and_the_steps_later_saves_still_go() -> None:
    """A save whose copies fail half way hands its staging back once its copies queued so far
    ended (which issues the step's batch on the engine's thread); the step's later saves go in
    a batch of their own."""
    ops = RecordingOps()
    vault = Vault(MemoryStore(), layout())
    worker, caches = worker_on(ops, vault)
    tables = {0: [1, 2, 3], 1: [10, 11, 12]}
    bad = plan_saves(vault.layout, 3 * BS, tables, [StateCapture(2, 3 * BS, 99, 1)], step=1)  # no block 99
    other = [t + 1000 for t in TOKENS]
    worker.step([SaveSpec("bad", vault.hashes(other), list(bad.publishable)), spec(vault)], [], step=1)
    log = ops.take()
    assert len(engine_waits(log)) == 2  # (the second batch queued behind the first's transfers)
    assert settle(worker, {save_id(1, "r")}) == {save_id(1, "bad"), save_id(1, "r")}
    assert worker.counters.save_errors == 1
    assert vault.lookup(vault.hashes(TOKENS), 3 * BS + 1) == 3 * BS
    for t in caches.values():
        t[:] = 99
    restored(vault, worker, caches)
    worker.close()


class FailingOps(RecordingOps):
    """Stand-ins whose device-side gathers fail while ``failing`` is set (a CUDA error, say)."""

    failing = False

    def gather(self, dest: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, page: int, group: int) -> None:
        if self.failing:
            raise RuntimeError("a device-side gather failed")
        super().gather(dest, src, idx, page, group)


def test_a_step_whose_gathers_failed_loses_its_own_saves_and_holds_only() -> None:
    """The step's batch fails when it is issued: its save and its hold are lost (each settled
    unpublished, the hold when its request finishes, the request still reported sent), every
    staging byte and slot goes back, and a later step's save is stored."""
    ops = FailingOps()
    vault = Vault(MemoryStore(), layout())
    worker, caches = worker_on(ops, vault, hold_bytes=1 << 20)
    ops.failing = True
    with pytest.raises(RuntimeError, match="gather failed"):  # (the connector's guard takes it)
        worker.step([held(vault), spec(vault, "q", [t + 1000 for t in TOKENS])], [], step=1)
    ops.failing = False
    worker.step([spec(vault, "p")], [Release("r", True)], step=2)
    assert worker.take_sent() == {"r"}
    got: dict[str, bool] = {}
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        got.update(worker.take_settled())
        time.sleep(0.005)
    assert got == {save_id(1, "q"): False, save_id(2, "r"): False, save_id(2, "p"): True}
    assert worker.counters.save_errors == 2
    assert worker.holds._slots is not None and worker.holds._slots.taken == 0
    assert worker.saves._staging is not None and worker.saves._staging.in_use == 0
    for t in caches.values():
        t[:] = 99
    restored(vault, worker, caches)  # p's save, whole
    worker.close()


def test_the_save_device_buffer_is_one_prefill_steps_save_and_bounded() -> None:
    from types import SimpleNamespace

    from prefixvault.vllm.config import SAVE_DEVICE_MAX, save_device_bytes

    lay = layout()
    attention = sum(g.nbytes(0) for g in lay.groups if not g.is_state)
    states = sum(g.nbytes(0) for g in lay.groups if g.is_state)
    step = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=10 * BS))
    assert save_device_bytes(lay, step) == 11 * attention + 2 * states
    huge = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=1 << 40))
    assert save_device_bytes(lay, huge) == SAVE_DEVICE_MAX
