"""How long restored requests that arrive together wait for their loads, over a slow link.

    PYTHONPATH=src python bench/batched_loads.py [--requests 8] [--delay-ms 20] [--blocks 8]
        [--block-kib 64] [--state-kib 256] [--repeat 5]

Why: a worker used to load one request per store round trip, one after another, so N restored
requests over a 20 ms link waited about N x 20 ms for the last load. The load lane now takes
every load queued by then as one batch: one round trip for all of them.

Setup: a valkey-server on 127.0.0.1 behind a loopback proxy that delays every round trip by
``--delay-ms`` (``SlowLink``); ``--requests`` prompts of ``--blocks`` blocks, each its own
prefix (nothing shared between them, so batching alone is measured), saved through the vault;
a ``WorkerSide`` on CPU cache tensors. Measured, ``--repeat`` times each, best taken:

- ``one_ms``: one load, from ``start_load_kv`` (``WorkerSide.load``) until it is reported
  finished (``take_finished``, polled every 0.2 ms): the cost of one restore.
- ``together_ms``: all ``--requests`` loads handed to the worker in one step, until the last
  is reported finished.

Prints both and ``together_over_one`` (about 1-2 when batched; about ``--requests`` when each
load is its own round trip).

Then one shared prefix: ``--requests`` requests restore the same prefix, half of them
together and half in a later wave, on a worker without and with the hot set of recent loads
(``load_cache_mib``, ``HOT_SET_MIB`` by default over a network store). Printed: the bytes read
from the store over one copy of the prefix (``shared_reads_over_one_copy``: about
``--requests`` without it, 1 with it) and the later wave's time. Run on another checkout
(``PYTHONPATH=older/src``) to compare (the shared part needs a vault with ``hot_bytes``); the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from typing import Any

import numpy as np

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.scenarios.netfault import SlowLink
from prefixvault.scenarios.valkey import Valkey
from prefixvault.stores import open_store
from prefixvault.vault import ObjectRef, Vault
from prefixvault.vllm.metadata import LoadSpec
from prefixvault.vllm.worker import WorkerSide

BS = 16


def wait_all(worker: WorkerSide, want: set[str], timeout: float = 60.0) -> float:
    """Seconds until every request in ``want`` is reported finished (raises if one failed)."""
    t0 = time.perf_counter()
    done: set[str] = set()
    while not want <= done:
        d, failed = worker.take_finished()
        if failed:
            raise SystemExit(f"loads failed: {sorted(failed)} {worker.counters.failure_reasons}")
        done |= d
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"loads not finished after {timeout} s: {sorted(want - done)}")
        time.sleep(0.0002)
    return time.perf_counter() - t0


def shared_prefix(store: Any, layout: CacheLayout, spec: LoadSpec, caches: dict[str, Any], n: int,
                  hot_mib: int) -> dict[str, float]:
    """``n`` restores of one prefix (half together, half later) on a fresh worker."""
    vault = Vault(store, layout, hot_bytes=hot_mib << 20)
    worker = WorkerSide(layout, vault, 0, [["a"], ["s"]], load_timeout=60)
    worker.register_kv_caches(caches)
    first = [dataclasses.replace(spec, req_id=f"s{i}") for i in range(n // 2)]
    later = [dataclasses.replace(spec, req_id=f"t{i}") for i in range(n - n // 2)]
    worker.load(first)
    wait_all(worker, {s.req_id for s in first})
    worker.load(later)
    later_s = wait_all(worker, {s.req_id for s in later})
    refs = vault.needed(spec.hashes, spec.tokens, ranks=[0])
    one_copy = sum(layout.groups[r.group].nbytes(0) for r in refs)
    worker.close()
    return {"reads_over_one_copy": round(vault.counters.get_bytes / one_copy, 2),
            "later_wave_ms": round(later_s * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--state-kib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if min(args.requests, args.blocks, args.block_kib, args.state_kib, args.repeat) < 1 or args.delay_ms < 0:
        ap.error("every count and size must be positive, the delay not negative")
    import torch

    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((args.block_kib * 1024,), "uint8")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((args.state_kib * 1024,), "uint8")])
    layout = CacheLayout(model="bench-batched-loads", block_size=BS, groups=(attn, state))
    n, blocks = args.requests, args.blocks
    caches = {"a": torch.zeros(n * blocks + 1, args.block_kib * 1024, dtype=torch.uint8),
              "s": torch.zeros(n * blocks + 1, args.state_kib * 1024, dtype=torch.uint8)}
    valkey = Valkey()
    link = SlowLink(valkey.port, args.delay_ms / 1000)
    out: dict[str, Any] = {"bench": "batched_loads", "requests": n, "delay_ms": args.delay_ms,
                           "blocks": blocks, "block_kib": args.block_kib, "state_kib": args.state_kib}
    try:
        store = open_store(f"redis://127.0.0.1:{link.port}/0?prefix=bench:&timeout=30")
        vault = Vault(store, layout)
        vault.keep_layout()
        rng = np.random.default_rng(0)
        sizes = {ObjectKind.BLOCK: args.block_kib * 1024, ObjectKind.STATE: args.state_kib * 1024}
        blobs = {kind: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for kind, size in sizes.items()}

        def payload(ref: ObjectRef, _block: int) -> bytes:
            return blobs[ref.kind]

        tokens = blocks * BS
        specs = []
        for r in range(n):
            hashes = vault.hashes([r * 100_000 + t for t in range(tokens)])  # a prefix of its own
            table = list(range(1 + r * blocks, 1 + (r + 1) * blocks))
            plan = plan_saves(layout, tokens, {0: table}, [StateCapture(1, tokens, table[-1], 1)], step=1)
            vault.publish(hashes, vault.save(0, hashes, plan.publishable, payload), 0)
            specs.append(LoadSpec(f"r{r}", hashes, tokens, 0, (table, table)))
        older = "load_timeout" not in inspect.signature(WorkerSide).parameters  # a checkout before lanes
        worker = WorkerSide(layout, vault, 0, [["a"], ["s"]], **({} if older else {"load_timeout": 60}))
        worker.register_kv_caches(caches)
        one, together = [], []
        for _ in range(args.repeat):
            worker.load(specs[:1])
            one.append(wait_all(worker, {"r0"}))
            worker.load(specs)
            together.append(wait_all(worker, {s.req_id for s in specs}))
        nbytes = n * (blocks * sizes[ObjectKind.BLOCK] + sizes[ObjectKind.STATE])
        worker.close()
        if "hot_bytes" in inspect.signature(Vault).parameters:
            out["shared"] = {f"hot_mib_{mib}": shared_prefix(store, layout, specs[0], caches, n, mib)
                             for mib in (0, 512)}
        store.close()
    finally:
        link.close()
        valkey.stop()
    out.update(one_ms=round(min(one) * 1e3, 1), together_ms=round(min(together) * 1e3, 1),
               together_over_one=round(min(together) / min(one), 2), mib_together=round(nbytes / 2**20, 1))
    print(f"one load: {out['one_ms']} ms; {n} loads together: {out['together_ms']} ms "
          f"({out['mib_together']} MiB); together / one: {out['together_over_one']} "
          f"(link delay {args.delay_ms} ms per round trip)")
    for name, fig in out.get("shared", {}).items():
        print(f"one prefix restored {n} times, {name}: store bytes read / one copy "
              f"{fig['reads_over_one_copy']}, later wave {fig['later_wave_ms']} ms")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
