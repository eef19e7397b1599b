"""Device check of block I/O on the exact cache views vLLM hands a connector (torch only).

    PYTHONPATH=src python3 bench/gpu_check.py [--views tests/data/vllm_views.json] [--out FILE]
                                              [--only small] [--device cpu]

The device machine has no vLLM: the views come from ``tests/data/vllm_views.json``, written by
``tools/gen_views.py`` from vLLM's own allocator (and checked against it by a CPU test). Each
configuration (a small hybrid and Qwen3-Next-80B at TP1; layouts LBNHC, LBHNC, BLHNC, BLNHC;
attention cut into kernel blocks of 16 and 32 tokens) is rebuilt over one uint8 device buffer
with ``as_strided``: exactly the tensors ``register_kv_caches`` gets, aliasing and padding
included. Then, through the worker's own registration (``group_ios``):

- exact: object sizes are vLLM's; gathers equal the logical bytes read through the views;
  after every scatter the *whole* buffer equals one written through the views (no stray byte);
- cross_backend: objects saved with kernel blocks restore byte for byte without them;
- worker: ``WorkerSide`` itself (vLLM is not imported), driven through a stand-in for the hooks
  Model Runner V2 calls, in its order (``Runner``; every other step with a drafter's forward
  before ``wait_for_save``): save -> stage -> store -> publish on a store in the run (memory,
  local), then load -> scatter into another engine's blocks, byte for byte; on CUDA also on
  Qwen3-Next-80B's geometry (a whole 8192-token step's save), with the forward a CUDA graph on
  the compute stream, the hooks under ``torch.cuda.set_sync_debug_mode("error")``, the engine's
  stream held per step across all groups (``engine_held_ms_per_step``) and the restore's
  bandwidth against a plain pinned copy;
- CUDA only: ordering against work queued on the engine's stream (a save sees the forward's
  bytes and not a later overwrite; a load from another thread lands after the work queued
  before its mark), the pinned staging path (really pinned, really asynchronous), bandwidth
  against a plain pinned ``copy_`` on the Qwen3-Next geometry, and ``engine_held_ms``: how long
  one save holds the engine's stream.

On CPU the CUDA-only parts are skipped and named in ``skipped``. The last line of output is one
JSON object; ``failed`` lists every check that did not pass (empty: all that ran passed).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixvault.blockio import DEVICE_BUFFER_BYTES, GroupIO
from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec
from prefixvault.staging import StagingRing
from prefixvault.stores.base import Store
from prefixvault.stores.local import LocalStore
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.kernel_blocks import group_ios, rebuild
from prefixvault.vllm.metadata import LoadSpec, Release, SaveSpec
from prefixvault.vllm.worker import WorkerSide

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.8  # bandwidth against a plain pinned copy of the same bytes (reported, not a failure)
SLEEP_CYCLES = 400_000_000  # ~0.2 s of queued engine work on a ~2 GHz GPU


class Engine:
    """One configuration's allocation, views and block I/O on a device."""

    def __init__(self, config: dict[str, Any], device: torch.device, seed: int) -> None:
        self.config = config
        self.num_blocks = int(config["num_blocks"])
        self.raw = torch.empty(int(config["raw_bytes"]), dtype=torch.uint8, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.raw.random_(0, 256, generator=gen)
        self.groups = [list(g["layers"]) for g in config["groups"]]
        self.layers = {n: d for g in config["groups"] for n, d in g["layers"].items()}
        self.views = rebuild(self.layers, self.raw)
        self.ios = group_ios(self.views, self.groups, self.num_blocks)

    def name(self) -> str:
        c = self.config
        return f"{c['geometry']}/{c['layout']}/kbs{c['kernel_block_size']}"


def block_view(v: torch.Tensor, b: int, num_blocks: int) -> torch.Tensor:
    """Manager block ``b`` of a vLLM view in logical order, by plain slicing (kernel blocks
    side by side along the token axis)."""
    ratio = v.shape[0] // num_blocks
    return v[b] if ratio == 1 else v[b * ratio : (b + 1) * ratio].permute(1, 0, *range(2, v.dim()))


def logical(views: dict[str, torch.Tensor], names: list[str], ids: list[int], nb: int) -> torch.Tensor:
    return torch.stack([torch.cat([block_view(views[n], b, nb).contiguous().view(torch.uint8).reshape(-1)
                                   for n in names]) for b in ids]).cpu()


def write_through(views: dict[str, torch.Tensor], names: list[str], ids: list[int], src: torch.Tensor,
                  nb: int) -> None:
    src = src.to(next(iter(views.values())).device)
    for i, b in enumerate(ids):
        off = 0
        for n in names:
            dest = block_view(views[n], b, nb)
            size = dest.numel() * dest.element_size()
            dest.copy_(src[i, off : off + size].view(dest.dtype).reshape(dest.shape))
            off += size


def host(n: int, nbytes: int, device: torch.device) -> torch.Tensor:
    t = torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    t.fill_(0)
    return t


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_exact(engine: Engine, rng: np.random.Generator, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"config": engine.name(), "groups": []}
    want = [int(g["object_bytes"]) for g in engine.config["groups"]]
    row["object_bytes_ok"] = [io.object_bytes for io in engine.ios] == want
    ok = row["object_bytes_ok"]
    for gi, (io, names) in enumerate(zip(engine.ios, engine.groups, strict=True)):
        ids = rng.choice(engine.num_blocks, 6, replace=False).tolist()
        out = host(len(ids), io.object_bytes, device)
        io.gather(ids, out).wait()
        gathered = bool(torch.equal(out, logical(engine.views, names, ids, engine.num_blocks)))
        dst = rng.choice(engine.num_blocks, 5, replace=False).tolist()
        src = host(len(dst), io.object_bytes, device)
        src.copy_(torch.from_numpy(rng.integers(0, 256, tuple(src.shape), dtype=np.uint8)))
        reference = engine.raw.clone()
        write_through(rebuild(engine.layers, reference), names, dst, src, engine.num_blocks)
        io.scatter(dst, src, after=io.mark())
        sync(device)
        whole = bool(torch.equal(engine.raw, reference))
        del reference
        pieces = io.pieces(len(ids))
        row["groups"].append({"group": gi, "gather_ok": gathered, "whole_buffer_ok": whole, "pieces": pieces})
        ok = ok and gathered and whole
    row["ok"] = ok
    return row


def check_cross_backend(split: Engine, whole: Engine) -> dict[str, Any]:
    a, b = split.ios[0], whole.ios[0]
    src_ids, dst_ids = [3, 17, 1], [10, 2, whole.num_blocks - 1]
    saved = host(3, a.object_bytes, split.raw.device)
    a.gather(src_ids, saved).wait()
    b.scatter(dst_ids, saved, after=b.mark())
    sync(whole.raw.device)
    names = split.groups[0]
    ok = a.object_bytes == b.object_bytes and all(
        torch.equal(block_view(split.views[n], s, split.num_blocks).contiguous().view(torch.uint8).flatten(),
                    whole.views[n][d].contiguous().view(torch.uint8).flatten())
        for s, d in zip(src_ids, dst_ids, strict=True) for n in names)
    return {"from": split.name(), "to": whole.name(), "ok": bool(ok)}


# -- CUDA only --------------------------------------------------------------------------------------


def check_ordering(engine: Engine, pieces: int) -> dict[str, Any]:
    """A save must see the forward's bytes (queued behind ~0.2 s of work) and not an overwrite
    queued after it; a load from another thread must land after the work queued before its
    mark (zeroing the blocks)."""
    io, names = engine.ios[0], engine.groups[0]
    device = engine.raw.device
    ids = [5, 9, 2]
    old_rows = io.piece_rows
    io.piece_rows = max(1, -(-len(ids) // pieces))
    pieces = io.pieces(len(ids))  # what the device buffer allows
    main = torch.cuda.current_stream(device)
    idx = torch.tensor(ids, device=device)
    tensors = [lay.tensor for lay in io.layers]

    def random_blocks(t: torch.Tensor) -> torch.Tensor:
        p = torch.empty((len(ids), *t.shape[1:]), dtype=t.dtype, device=device)
        p.view(torch.uint8).random_(0, 256)
        return p

    p1 = [random_blocks(t) for t in tensors]
    p2 = [random_blocks(t) for t in tensors]
    # expected bytes: p1 written synchronously, read back by plain slicing
    for t, p in zip(tensors, p1, strict=True):
        t.index_copy_(0, idx, p)
    expected = logical(engine.views, names, ids, engine.num_blocks)
    for t in tensors:
        t.index_fill_(0, idx, 0)
    torch.cuda.synchronize(device)
    out = host(len(ids), io.object_bytes, device)
    torch.cuda._sleep(SLEEP_CYCLES)
    for t, p in zip(tensors, p1, strict=True):  # "the forward": queued, nothing syncs
        t.index_copy_(0, idx, p)
    done = io.gather(ids, out)
    was_queued = not main.query()
    for t, p in zip(tensors, p2, strict=True):  # the next step reuses the blocks
        t.index_copy_(0, idx, p)
    done.wait()
    torch.cuda.synchronize(device)
    save_ok = bool(torch.equal(out, expected))
    # load: zeroing queued behind sleep, mark, scatter from another thread
    src = host(len(ids), io.object_bytes, device)
    src.copy_(torch.randint(0, 256, tuple(src.shape), dtype=torch.uint8))
    torch.cuda._sleep(SLEEP_CYCLES)
    for t in tensors:
        t.index_fill_(0, idx, 0)
    mark = io.mark()
    seen: dict[str, Any] = {}

    def load() -> None:
        seen["device_before"] = torch.cuda.current_device()
        try:
            io.scatter(ids, src, after=mark)
        except Exception as e:
            seen["error"] = repr(e)
        seen["device_after"] = torch.cuda.current_device()

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    torch.cuda.synchronize(device)
    landed = logical(engine.views, names, ids, engine.num_blocks)
    load_ok = "error" not in seen and bool(torch.equal(landed, src))
    io.piece_rows = old_rows
    return {"config": engine.name(), "pieces": pieces, "save_was_queued": was_queued, "save_ok": save_ok,
            "load_ok": load_ok, "load_thread": seen,
            "ok": was_queued and save_ok and load_ok}


def ordered(config: dict[str, Any], device: torch.device, pieces: int) -> dict[str, Any]:
    return check_ordering(Engine(config, device, 7), pieces)


def check_staging(engine: Engine) -> dict[str, Any]:
    """The worker's save path: a reservation of the pinned ring, viewed as the worker views
    it (numpy -> memoryview -> torch), filled by an asynchronous gather."""
    io, names = engine.ios[0], engine.groups[0]
    device = engine.raw.device
    n = 8
    ring_bytes = 2 * n * io.object_bytes
    pinned = torch.empty(ring_bytes, dtype=torch.uint8, pin_memory=True)
    ring = StagingRing(ring_bytes, pinned.numpy())
    r = ring.reserve(n * io.object_bytes)
    assert r is not None
    view = torch.from_numpy(np.frombuffer(r.view, np.uint8)).view(n, io.object_bytes)
    ids = list(range(1, n + 1))
    io.gather(ids, view).wait()  # warm (pinned index allocations)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    t0 = time.perf_counter()
    done = io.gather(ids, view)
    call_ms = (time.perf_counter() - t0) * 1e3
    done.wait()
    landed_ms = (time.perf_counter() - t0) * 1e3
    ok = bool(torch.equal(view, logical(engine.views, names, ids, engine.num_blocks)))
    ring.release(r)
    return {"view_is_pinned": bool(view.is_pinned()), "bytes_ok": ok, "call_ms": round(call_ms, 3),
            "landed_ms": round(landed_ms, 3), "async": call_ms < landed_ms / 4,
            "ok": bool(view.is_pinned()) and ok and call_ms < landed_ms / 4}


def gather_wait(io: GroupIO, ids: list[int], out: torch.Tensor) -> None:
    io.gather(ids, out).wait()


def best_ms(fn: Callable[[], Any], device: torch.device, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def check_bandwidth(engine: Engine) -> dict[str, Any]:
    """16 attention objects (a prefill step's save of ~8.7k tokens) and 2 states per state
    group, against a plain pinned copy of as many bytes; and how long one save holds the
    engine's stream (the transfers of every piece but the last)."""
    device = engine.raw.device
    rows = []
    for gi, io in enumerate(engine.ios):
        n = 16 if gi == 0 else 2
        src_ids, dst_ids = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
        buf = host(n, io.object_bytes, device)
        plain = torch.empty((n, io.object_bytes), dtype=torch.uint8, device=device)
        io.gather(src_ids, buf).wait()
        d2h = best_ms(functools.partial(gather_wait, io, src_ids, buf), device)
        h2d = best_ms(functools.partial(io.scatter, dst_ids, buf), device)
        plain_d2h = best_ms(functools.partial(buf.copy_, plain, non_blocking=True), device)
        plain_h2d = best_ms(functools.partial(plain.copy_, buf, non_blocking=True), device)
        torch.cuda.synchronize(device)
        main = torch.cuda.current_stream(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(main)
        done = io.gather(src_ids, buf)
        e1.record(main)  # behind the wait for the device-side gathers
        done.wait()
        torch.cuda.synchronize(device)
        nbytes = n * io.object_bytes
        rows.append({"group": gi, "objects": n, "mib": round(nbytes / 2**20, 1),
                     "pieces": io.pieces(n),
                     "gather_gbs": round(nbytes / d2h / 1e6, 2),
                     "plain_d2h_gbs": round(nbytes / plain_d2h / 1e6, 2),
                     "scatter_gbs": round(nbytes / h2d / 1e6, 2),
                     "plain_h2d_gbs": round(nbytes / plain_h2d / 1e6, 2),
                     "gather_ratio": round(plain_d2h / d2h, 3), "scatter_ratio": round(plain_h2d / h2d, 3),
                     "engine_held_ms": round(e0.elapsed_time(e1), 3)})
        del plain
    worst = min(min(r["gather_ratio"], r["scatter_ratio"]) for r in rows)
    return {"config": engine.name(), "rows": rows, "worst_ratio": worst, "goal": GOAL,
            "meets_goal": worst >= GOAL, "engine_held_ms": rows[0]["engine_held_ms"],
            "device_buffer_bytes": DEVICE_BUFFER_BYTES}



# -- the real worker, through the hooks Model Runner V2 calls ------------------------------------


def fixture_layout(config: dict[str, Any]) -> CacheLayout:
    """A layout whose objects are the fixture's (one uint8 tensor per group, as many bytes)."""
    groups = []
    for g in config["groups"]:
        spec = [TensorSpec((int(g["object_bytes"]),), "uint8")]
        if g["kind"] == "state":
            groups.append(CacheGroup.uniform(GroupKind.STATE, spec, family=StateFamily.GDN))
        else:
            groups.append(CacheGroup.uniform(GroupKind.FULL_ATTENTION, spec))
    return CacheLayout(model="gpu_check", block_size=int(config["block_size"]), groups=tuple(groups))


def open_store(kind: str, tmp: Path) -> Store:
    return MemoryStore() if kind == "memory" else LocalStore(tmp / "store", capacity=4 << 30)


class Runner:
    """A stand-in for vLLM 0.34's Model Runner V2 around one worker, calling the connector's
    worker hooks in its order (``v1/worker/gpu/kv_connector.py``, ``model_runner.py``): the
    forward on the compute stream (on CUDA a CUDA graph replayed: it rewrites every block of the
    engine and multiplies matrices), ``start_load_kv`` (``WorkerSide.load``), a drafter's
    forward where there is one, ``wait_for_save`` (``WorkerSide.step``), then
    ``get_finished`` and the worker's metadata (``take_finished``, ``take_settled``). On CUDA
    the hooks run under ``torch.cuda.set_sync_debug_mode("error")``: a hidden host
    synchronisation raises (and, inside the worker, is counted as its error)."""

    def __init__(self, engine: Engine, worker: WorkerSide) -> None:
        self.engine, self.worker = engine, worker
        self.device = engine.raw.device
        self.cuda = self.device.type == "cuda"
        self.inc = torch.ones(1, dtype=torch.uint8, device=self.device)
        self.held_ms: list[float] = []
        self.settled: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.sync_errors: list[str] = []
        self.graph: Any = None
        if self.cuda:
            self.a = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward()  # warm
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._forward()
            torch.cuda.synchronize(self.device)

    def _forward(self) -> None:
        self.engine.raw.add_(self.inc)  # every block of the step (and the others) rewritten
        if self.cuda:
            b = self.a
            for _ in range(8):
                b = b @ self.a

    def forward(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()

    def hook(self, name: str, fn: Callable[[], Any]) -> Any:
        if not self.cuda:
            return fn()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        except RuntimeError as e:
            self.sync_errors.append(f"{name}: {e}")
            return None
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def step(self, n: int, saves: list[SaveSpec], loads: list[LoadSpec], drafter: bool,
             releases: list[Release] | None = None) -> None:
        releases = releases or []
        self.forward()
        self.hook("start_load_kv", lambda: self.worker.load(loads, n))
        if drafter:
            self.forward()  # the drafter's forward, queued before wait_for_save
        e0 = e1 = None
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        self.hook("wait_for_save", lambda: self.worker.step(saves, releases, n))
        if e1 is not None:
            e1.record()  # behind the engine's wait for the step's device-side gathers
        finished = self.hook("get_finished", self.worker.take_finished)
        if finished:
            self.finished |= finished[0]
            self.failed |= finished[1]
        settled = self.hook("worker_meta", self.worker.take_settled) or []
        self.settled.update(sid for sid, _ in settled)
        if e0 is not None and e1 is not None and (saves or releases):
            e1.synchronize()
            self.held_ms.append(e0.elapsed_time(e1))


def check_worker(config: dict[str, Any], device: torch.device, store_kind: str, tmp: Path,
                 steps: int = 3) -> dict[str, Any]:
    """``WorkerSide`` end to end on the fixture's views: each step saves one request's blocks of
    a whole prefill step (every attention block of ~8192 tokens, or what the engine has, and
    every state group's state at its end) through the runner's hooks, alternately with and
    without a drafter; then an output boundary (``output_boundaries: last``) is held (its
    states copied into a pinned slot in its step), decoding rewrites its state blocks, and its
    release two steps later gathers its blocks with that step's work; then a second engine
    loads every saved boundary into other blocks, which must hold the bytes the first engine's
    blocks held right after that step's forward (for the held boundary: its states after the
    hold's step, its blocks after the release's).
    Also: how long the engine's stream is held per step (CUDA), and a restore's bandwidth
    against a plain pinned copy of as many bytes."""
    layout = fixture_layout(config)
    store = open_store(store_kind, tmp)
    vault = Vault(store, layout)
    bs, nb = layout.block_size, int(config["num_blocks"])
    states = [g for g, grp in enumerate(layout.groups) if grp.is_state]
    # blocks one step saves (block 0 is vLLM's null block: never a request's); one more
    # request's worth for the held output boundary
    per_step = max(1, min(8192 // bs, (nb - 1) // (steps + 1) - len(states)))
    producer = Engine(config, device, 20)
    save_bytes = per_step * sum(io.object_bytes for g, io in enumerate(producer.ios) if g not in states) + \
        sum(producer.ios[g].object_bytes for g in states)
    staging = 2 * save_bytes + (1 << 20)
    hold_bytes = 2 * sum(producer.ios[g].object_bytes for g in states)  # two boundaries' states
    names = producer.groups

    def worker_for(engine: Engine) -> WorkerSide:
        w = WorkerSide(layout, vault, 0, names, staging_bytes=staging, num_blocks=nb,
                       save_device_bytes=save_bytes, hold_bytes=hold_bytes)
        w.register_kv_caches(engine.views)
        return w

    worker = worker_for(producer)
    runner = Runner(producer, worker)
    rows: list[dict[str, Any]] = []  # per step: request, tokens, hashes, tables, snapshots
    free = iter(range(1, nb))
    for n in range(1, steps + 2):
        tokens = [n * 1_000_000 + t for t in range(per_step * bs)]
        blocks = [next(free) for _ in range(per_step)]
        state_blocks = {g: next(free) for g in states}
        tables = {g: blocks for g in range(len(layout.groups)) if g not in states}
        caps = [StateCapture(g, len(tokens), b, n) for g, b in state_blocks.items()]
        plan = plan_saves(layout, len(tokens), tables, caps, step=n)

        def snap(gs: list[int], blocks: list[int] = blocks, state_blocks: dict[int, int] = state_blocks
                 ) -> dict[int, torch.Tensor]:  # the bytes right after the last forward
            return {g: logical(producer.views, names[g], blocks if g not in states else [state_blocks[g]], nb)
                    for g in gs}
        groups = list(range(len(layout.groups)))
        if n <= steps:
            spec = SaveSpec(f"r{n}", vault.hashes(tokens), list(plan.publishable))
            runner.step(n, [spec], [], drafter=n % 2 == 0)
            rows.append({"spec": spec, "tokens": tokens, "snap": snap(groups), "sid": spec.sid(n)})
            continue
        # the held output boundary: its states now, its blocks when it is released
        spec = SaveSpec("h", vault.hashes(tokens), list(plan.publishable), hold=True)
        runner.step(n, [spec], [], drafter=False)
        held_states = snap(states)
        runner.step(n + 1, [], [], drafter=True)  # decoding rewrites the state blocks
        release = Release("h", True)
        runner.step(n + 2, [], [], drafter=False, releases=[release])
        kv = snap([g for g in groups if g not in states])
        rows.append({"spec": spec, "tokens": tokens, "snap": {**kv, **held_states},
                     "sid": release.sid(n + 2)})
    deadline = time.monotonic() + 120
    while {r["sid"] for r in rows} - runner.settled and time.monotonic() < deadline:
        runner.step(steps + 4, [], [], drafter=False)  # idle steps: the worker reports settled saves
        time.sleep(0.01)
    published = [vault.lookup(r["spec"].hashes, len(r["tokens"]) + 1) for r in rows]
    ok_published = published == [len(r["tokens"]) for r in rows]
    # restore into a second engine, other blocks
    consumer = Engine(config, device, 21)
    loader = worker_for(consumer)
    crun = Runner(consumer, loader)
    exact = True
    restore_s = 0.0
    restore_bytes = 0
    for i, r in enumerate(rows):
        order = list(range(nb - 1, 0, -1))
        ids = order[i * (per_step + len(states)) : (i + 1) * (per_step + len(states))]
        blocks, state_ids = ids[:per_step], ids[per_step:]
        tables = tuple(blocks if g not in states else [0] * (per_step - 1) + [state_ids[states.index(g)]]
                       for g in range(len(layout.groups)))
        load = LoadSpec(f"l{i}", r["spec"].hashes, len(r["tokens"]), 0, tables)
        sync(device)
        t0 = time.perf_counter()
        crun.step(100 + i, [], [load], drafter=False)
        while f"l{i}" not in crun.finished and time.perf_counter() - t0 < 60:
            d, f = loader.take_finished()
            crun.finished |= d
            crun.failed |= f
            time.sleep(0.0005)
        sync(device)
        restore_s += time.perf_counter() - t0
        restore_bytes += sum(int(t.numel()) for t in r["snap"].values())
        exact = exact and f"l{i}" in crun.finished and not crun.failed and all(
            torch.equal(logical(consumer.views, names[g], blocks if g not in states else
                                [state_ids[states.index(g)]], nb), r["snap"][g])
            for g in range(len(layout.groups)))
    plain = host(1, restore_bytes // len(rows), device)
    dev = torch.empty_like(plain, device=device)
    plain_s = best_ms(functools.partial(dev.copy_, plain, non_blocking=True), device) / 1e3 \
        if device.type == "cuda" else float("nan")
    errors = (worker.counters.save_errors + loader.counters.load_failures + worker.guard.total
              + loader.guard.total + len(runner.sync_errors) + len(crun.sync_errors))
    worker.close()
    loader.close()
    store.close()
    held = runner.held_ms
    row: dict[str, Any] = {
        "config": producer.name(), "store": store_kind, "steps": steps, "held_boundary": True,
        "objects_per_step": per_step + len(states),
        "save_mib_per_step": round(save_bytes / 2**20, 1), "save_device_mib": round(save_bytes / 2**20, 1),
        "published": ok_published, "restored_exact": exact,
        "save_errors": worker.counters.save_errors, "save_dropped": dict(worker.counters.save_dropped),
        "load_failures": loader.counters.load_failures,
        "internal_errors": worker.guard.total + loader.guard.total,
        "sync_errors": runner.sync_errors + crun.sync_errors,
        "engine_held_ms": [round(x, 3) for x in held],
        "engine_held_ms_max": round(max(held), 3) if held else None,
        "restore_gbs": round(restore_bytes / restore_s / 1e9, 2),
        "plain_h2d_gbs": round(restore_bytes / len(rows) / plain_s / 1e9, 2) if plain_s == plain_s else None,
    }
    row["ok"] = ok_published and exact and errors == 0
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--views", type=Path, default=ROOT / "tests" / "data" / "vllm_views.json")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="one geometry of the fixture (e.g. small), for a quick run")
    args = ap.parse_args()
    t_start = time.monotonic()
    failed: list[str] = []
    skipped: list[str] = []
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"torch {torch.__version__}  torch.version.cuda {torch.version.cuda}  device {device}: {name}",
          flush=True)
    fixture = json.loads(args.views.read_text())
    if args.only:
        fixture["configs"] = [c for c in fixture["configs"] if c["geometry"] == args.only]
        skipped.append(f"every geometry but {args.only}")
    configs = {(c["geometry"], c["layout"], c["kernel_block_size"], c["block_size"]): c
               for c in fixture["configs"]}
    result: dict[str, Any] = {"check": "gpu_check", "torch": torch.__version__, "cuda": torch.version.cuda,
                              "device": str(device), "device_name": name, "fixture": str(args.views),
                              "fixture_vllm": fixture.get("vllm")}
    if args.device.startswith("cuda") and not torch.version.cuda:
        failed.append("torch is a CPU build (torch.version.cuda is None)")

    def guarded(label: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # reported, and the rest still runs
            failed.append(f"{label}: {e!r}")
            print(f"{label}: ERROR {e!r}", flush=True)
            return None

    rng = np.random.default_rng(0)
    exact = []
    for i, config in enumerate(fixture["configs"]):
        def run(config: dict[str, Any] = config, i: int = i) -> dict[str, Any]:
            row = check_exact(Engine(config, device, seed=i), rng, device)
            print(f"exact {row['config']:32} ok={row['ok']} pieces={[g['pieces'] for g in row['groups']]}",
                  flush=True)
            return row
        row = guarded(f"exact {config['geometry']}/{config['layout']}/kbs{config['kernel_block_size']}", run)
        if row is not None:
            exact.append(row)
            if not row["ok"]:
                failed.append(f"exact {row['config']}")
    result["exact"] = exact
    result["all_exact"] = len(exact) == len(fixture["configs"]) > 0 and all(r["ok"] for r in exact)

    cross = []
    for (geo, layout, kbs, bs), config in configs.items():
        if kbs == bs:
            continue
        whole_config = configs[(geo, layout, bs, bs)]

        def run_cross(config: dict[str, Any] = config, whole_config: dict[str, Any] = whole_config
                      ) -> dict[str, Any]:
            row = check_cross_backend(Engine(config, device, 100), Engine(whole_config, device, 101))
            print(f"cross_backend {row['from']} -> {row['to']}: ok={row['ok']}", flush=True)
            return row
        row = guarded(f"cross_backend {geo}/{layout}/kbs{kbs}", run_cross)
        if row is not None:
            cross.append(row)
            if not row["ok"]:
                failed.append(f"cross_backend {row['from']} -> {row['to']}")
    result["cross_backend"] = cross

    worker_rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check") as tmp:
        runs = [(c, store) for c in fixture["configs"] if c["geometry"] == "small" and c["layout"] == "LBNHC"
                and c["kernel_block_size"] in (c["block_size"], 16) for store in ("memory", "local")]
        if cuda:
            runs += [(c, "memory") for c in fixture["configs"] if c["geometry"] == "qwen3next80b_tp1"
                     and c["layout"] == "LBNHC" and c["kernel_block_size"] == c["block_size"]]
        for k, (config, store) in enumerate(runs):
            label = f"worker {config['geometry']}/kbs{config['kernel_block_size']}/{store}"
            steps = 2 if config["geometry"] == "qwen3next80b_tp1" else 3
            run_worker = functools.partial(check_worker, config, device, store, Path(tmp) / str(k), steps)
            row = guarded(label, run_worker)
            if row is not None:
                print(f"{label}: {row}", flush=True)
                worker_rows.append(row)
                if not row["ok"]:
                    failed.append(label)
    result["worker"] = worker_rows
    result["worker_ok"] = bool(worker_rows) and all(r["ok"] for r in worker_rows)
    big_rows = [r for r in worker_rows if r["config"].startswith("qwen3next80b_tp1")]
    if big_rows:  # the figure of deliverable 1: the whole step's save, every group
        result["engine_held_ms_per_step"] = big_rows[0]["engine_held_ms_max"]
        result["restore_gbs"] = big_rows[0]["restore_gbs"]
        result["restore_plain_h2d_gbs"] = big_rows[0]["plain_h2d_gbs"]

    if cuda:
        def lbnhc(geometry: str) -> dict[str, Any] | None:  # the H100/H200 default
            return next((c for c in fixture["configs"] if c["geometry"] == geometry and c["layout"] == "LBNHC"
                         and c["kernel_block_size"] == c["block_size"]), None)
        small, q3n = lbnhc("small"), lbnhc("qwen3next80b_tp1")
        ordering = []
        for config in [c for c in (small, q3n) if c is not None]:
            for pieces in (1, 3):
                row = guarded(f"ordering {config['geometry']} pieces={pieces}",
                              functools.partial(ordered, config, device, pieces))
                if row is not None:
                    print(f"ordering {row['config']} pieces={pieces}: {row}", flush=True)
                    ordering.append(row)
                    if not row["ok"]:
                        failed.append(f"ordering {row['config']} pieces={pieces}")
        result["ordering"] = ordering
        result["ordering_ok"] = bool(ordering) and all(r["ok"] for r in ordering)
        big = guarded("engine for staging and bandwidth", lambda: Engine(q3n or small or {}, device, 8))
        if big is not None:
            staging = guarded("staging", lambda: check_staging(big))
            result["staging"] = staging
            if staging is not None:
                print(f"staging: {staging}", flush=True)
                if not staging["ok"]:
                    failed.append("staging")
            bandwidth = guarded("bandwidth", lambda: check_bandwidth(big))
            result["bandwidth"] = bandwidth
            if bandwidth is not None:
                for r in bandwidth["rows"]:
                    print(f"bandwidth {r}", flush=True)
        result["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    else:
        skipped += ["ordering (CUDA streams and events)", "staging (pinned memory, asynchronous copies)",
                    "bandwidth and engine_held_ms (CUDA)",
                    "worker on qwen3next80b_tp1, CUDA graph forward, sync debug mode, "
                    "engine_held_ms_per_step and restore bandwidth (CUDA)"]
    result["skipped"] = skipped
    result["failed"] = failed
    result["seconds"] = round(time.monotonic() - t_start, 1)
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
