"""Whether one tenant filling a local store leaves another tenant's working set restorable.

    python bench/tenant_shares.py [--capacity-mib 64] [--share 50] [--fill 10] [--dir /dev/shm]

Two namespaces share one local store. Each prefix is what the vault stores for it: ``--blocks``
KV blocks, one recurrent state and one boundary record, under the namespace's keys. Tenant B
first stores a working set of prefixes taking about 90% of its bound (``--share`` % of the
capacity, counted as the store counts: a slot's share of its slab); tenant A then stores new
prefixes worth ``--fill`` times the capacity, one prefix per put, as a producer would. A prefix
is restorable when every object it needs is still stored. The run is made twice on fresh
stores: with ``namespace_share`` and without it (the store's global recency, the control). The
last line printed is one JSON object: the share of B's working set (what B had restorable
before A's fill) still restorable after it in each, what A restored of its own last prefixes,
and A's put cost per prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from prefixvault.keys import KeySpace
from prefixvault.stores import _arena, open_store
from prefixvault.stores.base import Store

KiB, MiB = 1 << 10, 1 << 20


def prefix_keys(space: KeySpace, i: int, blocks: int) -> list[str]:
    """The keys one prefix of ``blocks`` blocks needs: its KV blocks, its state, its record."""
    hashes = [(i * 1000 + b).to_bytes(16, "big") for b in range(blocks)]
    return [*(space.block(0, 0, h) for h in hashes), space.state(1, 0, hashes[-1]), space.record(hashes[-1])]


def restorable(store: Store, prefixes: list[list[str]]) -> int:
    found = store.exists_many([k for keys in prefixes for k in keys])
    out, at = 0, 0
    for keys in prefixes:
        out += all(found[at : at + len(keys)])
        at += len(keys)
    return out


def run(uri: str, args: argparse.Namespace) -> dict[str, float]:
    sizes = {"b": args.block_kib * KiB, "s": args.state_kib * KiB, "r": 512}
    tenant_a, tenant_b = KeySpace("tenant-a", bytes(8)), KeySpace("tenant-b", bytes(8))
    capacity = args.capacity_mib * MiB
    slab = _arena.slab_size_for(capacity)

    def held(n: int) -> int:  # an object's space as the store counts it (``_index._HELD``)
        cls = _arena.size_class(n, slab)
        return n if cls == 0 else _arena.slab_bytes(cls, slab) // _arena.slots_per_slab(cls, slab)

    per_prefix = args.blocks * held(sizes["b"]) + held(sizes["s"]) + held(sizes["r"])
    working = int(0.9 * capacity * args.share / 100) // per_prefix
    filling = args.fill * capacity // per_prefix
    payload = {cls: bytes(n) for cls, n in sizes.items()}

    def put(store: Store, keys: list[str]) -> bool:
        return all(store.put_many([(k, [payload[k.split("/")[2]]]) for k in keys]))

    with open_store(uri) as store:
        mine = [prefix_keys(tenant_b, i, args.blocks) for i in range(working)]
        stored_b = sum(put(store, keys) for keys in mine)
        before = restorable(store, mine)
        t0 = time.perf_counter()
        theirs = [prefix_keys(tenant_a, i, args.blocks) for i in range(filling)]
        stored_a = sum(put(store, keys) for keys in theirs)
        put_ms = (time.perf_counter() - t0) * 1000 / max(filling, 1)
        last = theirs[-working:] if working else []
        return {
            "b_working_set_prefixes": working,
            "b_stored": stored_b,
            "b_restorable_before": before,
            "b_restorable": round(restorable(store, mine) / max(before, 1), 4),
            "a_prefixes_put": filling,
            "a_stored": stored_a,
            "a_last_restorable": round(restorable(store, last) / max(len(last), 1), 4),
            "a_put_ms_per_prefix": round(put_ms, 3),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity-mib", type=int, default=64)
    ap.add_argument("--share", type=int, default=50, help="namespace_share, in %% of the capacity")
    ap.add_argument("--fill", type=int, default=10, help="tenant A stores this many times the capacity")
    ap.add_argument("--blocks", type=int, default=8, help="KV blocks per prefix")
    ap.add_argument("--block-kib", type=int, default=96)
    ap.add_argument("--state-kib", type=int, default=500)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    out: dict[str, object] = {"capacity_mib": args.capacity_mib, "namespace_share_pct": args.share,
                              "fill_x_capacity": args.fill}
    for name, query in (("bounded", f"&namespace_share={args.share}%"), ("global_lru", "")):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            res = run(f"local://{Path(tmp) / 's'}?capacity={args.capacity_mib}MiB{query}", args)
        print(name, res, flush=True)
        out[name] = res
    bounded, control = out["bounded"], out["global_lru"]
    assert isinstance(bounded, dict) and isinstance(control, dict)
    out["b_restorable_bounded"] = bounded["b_restorable"]
    out["b_restorable_global_lru"] = control["b_restorable"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
