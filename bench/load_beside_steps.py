"""What a background load costs the engine's thread: step times alone against beside loads.

    PYTHONPATH=src python bench/load_beside_steps.py [--stores local,redis,mooncake] [--blocks 16]
        [--block-kib 256] [--state-kib 512] [--steps 400] [--ops 300] [--gap-ms 10]

Why: the worker loads on a thread of its own so that the forward of other requests never waits
for a store. On CPU the forward runs Python between kernels, and gives the GIL up around each
kernel; a load that takes the GIL back in many short bursts (a client parsing its replies
piece by piece) delays every kernel's return, so decoding slows down although nothing waits for
the store. This is what ITL p99 of a consumer server shows under load (bench/serving.py).

Stores: a local store on /dev/shm, a valkey-server and a ``mooncake_master`` with one holder,
all on 127.0.0.1. Setup: one prompt of ``--blocks`` blocks saved through the vault (a full-attention group of
``--block-kib`` per block and a state group of ``--state-kib``), then, on the main thread,
``--steps`` "steps" of ``--ops`` small torch kernels each (about a millisecond, one OpenMP
thread, as a decode step of a tiny model): first alone, then while a thread loads the prompt's
objects again and again (``Vault.load``: the store's reads and the checks of every object, as
the worker's load thread does) with ``--gap-ms`` between two loads, per store. Prints per store
the step time p50 and p99 alone and beside loads, their ratio, and loads per second. Run on
another checkout
(``PYTHONPATH=older/src``) to compare versions; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.scenarios.mooncake import MooncakeCluster
from prefixvault.scenarios.valkey import Valkey
from prefixvault.stores import open_store
from prefixvault.vault import ObjectRef, Vault

BS = 16


def steps(n: int, ops: int) -> list[float]:
    """Step times in ms: ``ops`` small kernels each, the GIL given up around every one."""
    import torch

    x = torch.ones(64, 64)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        y = x
        for _ in range(ops):
            y = y + 1.0
        out.append((time.perf_counter() - t) * 1e3)
    return out


def figures(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"p50_ms": round(statistics.median(s), 3), "p99_ms": round(s[int(0.99 * (len(s) - 1))], 3)}


def run_store(uri: str, args: argparse.Namespace) -> dict[str, Any]:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((args.block_kib * 1024,), "uint8")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((args.state_kib * 1024,), "uint8")])
    layout = CacheLayout(model="bench-load", block_size=BS, groups=(attn, state))
    store = open_store(uri)
    vault = Vault(store, layout)
    vault.keep_layout()
    rng = np.random.default_rng(0)
    sizes = {ObjectKind.BLOCK: args.block_kib * 1024, ObjectKind.STATE: args.state_kib * 1024}
    blobs = {kind: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for kind, size in sizes.items()}

    def payload(ref: ObjectRef, _block: int) -> bytes:
        return blobs[ref.kind]

    tokens = args.blocks * BS
    hashes = vault.hashes(list(range(tokens)))
    plan = plan_saves(layout, tokens, {0: list(range(1, args.blocks + 1))}, [StateCapture(1, tokens, 1, 1)],
                      step=1)
    vault.publish(hashes, vault.save(0, hashes, plan.publishable, payload), 0)
    refs = vault.needed(hashes, tokens, ranks=[0])
    first = vault.load(refs, borrow=False)
    if not first.ok:
        raise SystemExit(f"{uri}: the saved prompt does not load: {first.failed}")
    nbytes = sum(len(p) for p in first.payloads.values())

    stop = threading.Event()
    loads = [0]
    failed: list[str] = []  # a load that failed: its figures would be of less work

    def loader() -> None:
        while not stop.is_set():
            got = vault.load(refs, borrow=False)
            if not got.ok:
                failed.append(str(got.failed))
                return
            loads[0] += 1
            time.sleep(args.gap_ms / 1000)  # requests arrive apart

    alone = steps(args.steps, args.ops)
    thread = threading.Thread(target=loader, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    beside = steps(args.steps, args.ops)
    stop.set()
    thread.join()
    elapsed = time.perf_counter() - t0
    store.close()
    if failed:
        raise SystemExit(f"{uri}: a load beside the steps failed: {failed[0]}")
    a, b = figures(alone), figures(beside)
    return {"alone": a, "beside_loads": b, "p99_ratio": round(b["p99_ms"] / a["p99_ms"], 3),
            "p50_ratio": round(b["p50_ms"] / a["p50_ms"], 3), "loads_per_s": round(loads[0] / elapsed, 1),
            "load_mib": round(nbytes / 2**20, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="local,redis,mooncake")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--state-kib", type=int, default=512)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=10.0, help="pause between two loads")
    args = ap.parse_args(argv)
    kinds = args.stores.split(",")
    if any(k not in ("local", "redis", "mooncake") for k in kinds):
        ap.error(f"--stores: local, redis and/or mooncake, not {args.stores!r}")
    if min(args.blocks, args.block_kib, args.state_kib, args.steps, args.ops) < 1:
        ap.error("every count and size must be positive")
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {"bench": "load_beside_steps", "blocks": args.blocks, "block_kib": args.block_kib,
                           "state_kib": args.state_kib, "ops": args.ops}
    print(f"{'store':>6} {'p50 alone':>10} {'p99 alone':>10} {'p50 beside':>11} {'p99 beside':>11} "
          f"{'p99 ratio':>10} {'loads/s':>8}")
    for kind in kinds:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
            if kind == "redis":
                valkey = Valkey()
                try:
                    fig = run_store(f"redis://127.0.0.1:{valkey.port}/0?prefix=bench:", args)
                finally:
                    valkey.stop()
            elif kind == "mooncake":
                cluster = MooncakeCluster(segment="256MiB")
                try:
                    fig = run_store(cluster.uri(prefix="bench/", timeout="30"), args)
                finally:
                    cluster.stop()
            else:
                fig = run_store(f"local://{tmp}/store?capacity=1GiB", args)
        out[kind] = fig
        a, b = fig["alone"], fig["beside_loads"]
        print(f"{kind:>6} {a['p50_ms']:>10.3f} {a['p99_ms']:>10.3f} {b['p50_ms']:>11.3f} "
              f"{b['p99_ms']:>11.3f} {fig['p99_ratio']:>10.3f} {fig['loads_per_s']:>8.1f}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
