"""What Mooncake's soft pin keeps through eviction, and what it costs, in one run.

    python bench/mooncake_soft_pin.py [--segment 64MiB] [--object 1MiB] [--kept 8]
                                      [--early 8] [--written 200]

Mooncake evicts by itself (at its high watermark, a share of the objects whose leases have
ended) and offers one priority: a soft pin (``ReplicateConfig.soft_pin_action``, with a TTL),
evicted only after everything else. Issue 14 asks whether prefixvault should use it, e.g.
to keep the boundaries of shared prefixes (junctions) over one-off tails. This measures the
mechanism on a real ``mooncake_master`` and holder (raw client API, no vault), twice on fresh
clusters: without pins, and with ``--kept`` objects soft-pinned. Each run writes ``--kept``
objects (pinned in the second run), then ``--early`` unpinned ones written at the same time,
then ``--written`` one-off objects (several times the segment), and counts what is still
there and how many puts the store refused while full. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from prefixvault.units import format_size, parse_size


def one_run(pin: bool, segment: int, size: int, kept: int, early: int, written: int) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

    from prefixvault.scenarios.mooncake import MooncakeCluster

    cluster = MooncakeCluster(segment=str(segment))
    try:
        client = MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.address) != 0:
            raise SystemExit("mooncake client setup failed")
        blob = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
        plain = ReplicateConfig()
        pinned = ReplicateConfig()
        if pin:
            pinned.soft_pin_action = SoftPinAction.ENABLE
            pinned.soft_pin_ttl_ms = 3_600_000
        stored = sum(client.put(f"kept/{i}", blob, pinned) == 0 for i in range(kept))
        stored += sum(client.put(f"early/{i}", blob, plain) == 0 for i in range(early))
        if stored != kept + early:
            raise SystemExit(f"only {stored} of the first {kept + early} objects were stored")
        refused = 0
        t0 = time.perf_counter()
        for i in range(written):
            refused += client.put(f"tail/{i}", blob, plain) != 0
            if i % 16 == 15:
                time.sleep(0.1)  # the master evicts in the background
        put_s = time.perf_counter() - t0
        time.sleep(1.0)
        alive = [client.is_exist(f"tail/{i}") == 1 for i in range(written)]
        out = {
            "soft_pin": pin,
            "kept_left": sum(client.is_exist(f"kept/{i}") == 1 for i in range(kept)),
            "early_left": sum(client.is_exist(f"early/{i}") == 1 for i in range(early)),
            "tail_left": sum(alive),
            "tail_refused": refused,
            "tail_put_s": round(put_s, 3),
        }
        client.close()
        return out
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segment", default="64MiB", help="memory the holder mounts")
    ap.add_argument("--object", default="1MiB", help="size of every object")
    ap.add_argument("--kept", type=int, default=8, help="objects pinned in the second run")
    ap.add_argument("--early", type=int, default=8, help="unpinned objects written beside them")
    ap.add_argument("--written", type=int, default=200, help="one-off objects written after them")
    args = ap.parse_args(argv)
    try:
        segment, size = parse_size(args.segment), parse_size(args.object)
    except ValueError as e:
        ap.error(str(e))
    first = (args.kept + args.early) * size
    if min(args.kept, args.early, args.written) < 0 or size <= 0 or first >= segment:
        ap.error("counts must not be negative, and the first objects must fit in the segment")
    runs = [one_run(pin, segment, size, args.kept, args.early, args.written) for pin in (False, True)]
    print(f"segment {format_size(segment)}, objects of {format_size(size)}, {args.written} one-off objects "
          f"({args.written * size / segment:.1f}x the segment)")
    for r in runs:
        print(f"  soft pin {'on ' if r['soft_pin'] else 'off'}: kept {r['kept_left']}/{args.kept}, "
              f"early {r['early_left']}/{args.early}, one-off left {r['tail_left']}, "
              f"refused {r['tail_refused']}, {r['tail_put_s']:.2f} s")
    print(json.dumps({"bench": "mooncake_soft_pin", "segment": segment, "object": size, "kept": args.kept,
                      "early": args.early, "written": args.written, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
