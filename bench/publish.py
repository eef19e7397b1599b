"""Publishing queued saves over a slow store: one by one against one batch, in one run.

    PYTHONPATH=src python bench/publish.py [--store redis|mooncake] [--delay-ms 20] [--saves 1,4,16]
        [--repeat 3]

Why: a producer's save thread publishes the records of every save it stored. Over a store a
network away each publish costs round trips (an existence check, a conditional put), so under
load the thread trails the engine and saves queue up (docs/architecture.md, "Under load").
``Vault.publish_many`` publishes all queued saves in the round trips of one.

Setup: a valkey-server on 127.0.0.1 behind a loopback link that adds ``--delay-ms`` to every
round trip (``prefixvault.scenarios.netfault.SlowLink``), a two-rank hybrid layout (attention and
state groups), and ``N`` saves of distinct 8-block prompts sharing a 2-block system prompt,
each with a boundary at every block past the shared part, acknowledged by rank 0 only (so
rank 1's objects are checked in the store, as a tensor-parallel worker does). Per ``N``: the
seconds to publish them one by one (``Vault.publish`` each) and together (``publish_many``),
best of ``--repeat`` on fresh keys; the ratio together / one by one. Every boundary must be
published. Run on an older prefixvault (``PYTHONPATH=older/src``) without ``publish_many``, it
times one by one only. ``--store mooncake``: a ``mooncake_master`` and a holder on 127.0.0.1
instead (no added delay: what is measured is the store's own calls, three per record one by
one against three per batch; older versions put a batch's records one by one). The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.scenarios.mooncake import MooncakeCluster
from prefixvault.scenarios.netfault import SlowLink
from prefixvault.scenarios.valkey import Valkey
from prefixvault.stores import open_store
from prefixvault.vault import ObjectRef, RankAck, Vault

BS = 16


def layout() -> CacheLayout:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((256,), "uint8")], 2)
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((1024,), "uint8")], 2)
    return CacheLayout(model="bench-publish", block_size=BS, groups=(attn, state), tp_size=2)


def payload(ref: ObjectRef, _block: int) -> bytes:
    return bytes(256 if ref.kind is ObjectKind.BLOCK else 1024)


def saves(vault: Vault, n: int, salt: int) -> list[tuple[list[bytes], list[RankAck], int]]:
    """``n`` prompts stored by both ranks; the acks of rank 0 only."""
    out = []
    system = list(range(2 * BS))
    for i in range(n):
        tokens = system + [salt * 1_000_000 + i * 1000 + t for t in range(6 * BS)]
        hashes = vault.hashes(tokens)
        nb = len(tokens) // BS
        caps = [StateCapture(1, b, 1, 1) for b in range(3 * BS, nb * BS + 1, BS)]
        d = plan_saves(vault.layout, len(tokens), {0: list(range(1, nb + 1))}, caps, step=1)
        acks = vault.save(0, hashes, d.publishable, payload)
        vault.save(1, hashes, d.publishable, payload)
        out.append((hashes, acks, 0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=["redis", "mooncake"], default="redis")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="added per round trip (redis only)")
    ap.add_argument("--saves", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        counts = [int(n) for n in args.saves.split(",")]
    except ValueError:
        ap.error(f"--saves: whole numbers, not {args.saves!r}")
    if args.repeat < 1 or any(n < 1 for n in counts) or args.delay_ms < 0:
        ap.error("--repeat and --saves must be positive, --delay-ms not negative")
    stops: list[Any] = []
    cases: list[dict[str, Any]] = []
    try:
        if args.store == "mooncake":
            cluster = MooncakeCluster(segment="256MiB")
            stops.append(cluster.stop)
            uri = cluster.uri(prefix="bench/", timeout="30")
        else:
            valkey = Valkey()
            stops.append(valkey.stop)
            link = SlowLink(valkey.port, args.delay_ms / 1000)
            stops.append(link.close)
            uri = f"redis://127.0.0.1:{link.port}/0?prefix=bench:&timeout=30"
        store = open_store(uri)
        vault = Vault(store, layout())
        vault.keep_layout()  # once, outside the timing
        salt = 0
        print(f"{'saves':>6} {'one by one s':>13} {'together s':>11} {'ratio':>6}")
        for n in counts:
            hows = ("alone", "together") if hasattr(vault, "publish_many") else ("alone",)
            best = {"alone": float("inf"), "together": float("inf")}
            for _ in range(args.repeat):
                for how in hows:
                    salt += 1
                    batch = saves(vault, n, salt)
                    t0 = time.perf_counter()
                    if how == "alone":
                        outcomes = [vault.publish(h, a, p) for h, a, p in batch]
                    else:
                        outcomes = vault.publish_many(batch)
                    best[how] = min(best[how], time.perf_counter() - t0)
                    if any(why is not None for out in outcomes for why in out.values()):
                        raise SystemExit(f"{how}: not every boundary was published: {outcomes}")
            ratio = best["together"] / best["alone"] if "together" in hows else float("nan")
            cases.append({"saves": n, "alone_s": round(best["alone"], 4),
                          "together_s": round(best["together"], 4) if "together" in hows else None,
                          "ratio": round(ratio, 3) if "together" in hows else None})
            together = f"{'n/a':>11}"
            if "together" in hows:
                together = f"{best['together']:>11.4f} {ratio:>6.3f}"
            print(f"{n:>6} {best['alone']:>13.4f} {together}", flush=True)
        store.close()
    finally:
        for stop in reversed(stops):
            stop()
    delay = args.delay_ms if args.store == "redis" else 0.0
    print(json.dumps({"bench": "publish", "store": args.store, "delay_ms": delay, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
