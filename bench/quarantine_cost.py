"""What a quarantine that sticks costs a lookup and a load, on a local store.

    python bench/quarantine_cost.py [--tokens 8192] [--block-size 16] [--state-kib 1024]
                                    [--block-kib 64] [--repeat 20] [--store-dir DIR]

A hybrid layout (one full-attention group, one state group) on a ``LocalStore`` in a temporary
directory; a producer publishes a prompt with a state every 16 blocks, then a consumer whose
prompt extends it by one token looks it up and loads the hit. Timed, best of ``--repeat``:

- lookup: as shipped (a hit's record read and verified only where the deny-list names it; the
  deny-list read after answering when due) against the same lookup with that step left out
  (``HitFinder._verified`` a no-op): what the quarantine costs a lookup in a namespace without one;
- load: with an empty deny-list (every namespace that never had a quarantine: a dict lookup
  per object) and with every loaded key listed (the worst case: a digest of each object);
- the refresh of the stored deny-list (one read every ``DENY_REFRESH_S``) at 4096 entries,
  unchanged (the common case) and as a vault's first read.

Ratios are printed; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import content_digest, decode
from prefixvault.denylist import DENY_MAX
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.local import LocalStore
from prefixvault.vault import LookupResult, ObjectRef, Vault


def unverified(vault: Vault) -> Vault:
    """``vault`` with the lookup as it was before issue 31: a hit taken from existence checks
    alone (the step that verifies hits, ``HitFinder._verified``, passes its results on)."""

    def passed_on(asks: Any, results: list[LookupResult], later: Any) -> list[LookupResult]:
        return results

    vault._hits._verified = passed_on  # type: ignore[method-assign]
    return vault


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--state-kib", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--store-dir", default="")
    a = ap.parse_args()
    bs = a.block_size
    layout = CacheLayout(model="bench-q", block_size=bs, groups=(
        CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((a.block_kib << 10,), "uint8")]),
        CacheGroup.uniform(GroupKind.STATE, [TensorSpec((a.state_kib << 10,), "uint8")])))
    n = a.tokens // bs
    with tempfile.TemporaryDirectory(dir=a.store_dir or None) as tmp:
        need = n * (a.block_kib << 10) + (n // 16 + 1) * (a.state_kib << 10)
        store = LocalStore(Path(tmp) / "s", capacity=2 * need + (256 << 20))
        vault = Vault(store, layout)
        tokens = list(range(a.tokens))
        hashes = vault.hashes(tokens)
        rng = np.random.default_rng(0)
        blobs: dict[int, bytes] = {k: rng.integers(0, 255, k << 10, dtype=np.uint8).tobytes()
                 for k in (a.block_kib, a.state_kib)}

        def read(ref: ObjectRef, block_id: int) -> bytes:
            return blobs[a.state_kib if ref.kind.name == "STATE" else a.block_kib]

        caps = [StateCapture(1, b, 1, 1) for b in range(16 * bs, a.tokens + 1, 16 * bs)]
        plan = plan_saves(layout, a.tokens, {0: list(range(1, n + 1))}, caps, step=1)
        vault.publish(hashes, vault.save(0, hashes, plan.publishable, read))
        ask = vault.hashes([*tokens, 7])
        consumer, plain = Vault(store, layout), unverified(Vault(store, layout))
        hit = consumer.lookup(ask, a.tokens + 1)
        assert hit == plain.lookup(ask, a.tokens + 1) and hit > 0
        t_verified = best(lambda: consumer.lookup(ask, a.tokens + 1), a.repeat)
        t_plain = best(lambda: plain.lookup(ask, a.tokens + 1), a.repeat)
        refs = consumer.needed(ask, hit)
        staging = np.empty(sum(128 + layout.groups[r.group].nbytes(0) for r in refs), np.uint8)
        assert consumer.load(refs, staging).ok
        t_load = best(lambda: consumer.load(refs, staging), a.repeat)
        # every loaded key listed (other digests: nothing is refused, every object is digested)
        consumer.deny_objects([(r.key, bytes(16)) for r in refs])
        assert consumer.load(refs, staging).ok
        t_load_listed = best(lambda: consumer.load(refs, staging), a.repeat)
        filler = [(consumer.keys.prefix + f"s/1/0/{i:032x}", bytes(16)) for i in range(DENY_MAX)]
        consumer.deny_objects(filler)
        t_refresh = best(lambda: consumer.refresh_deny(force=True), a.repeat)
        t_first = best(lambda: Vault(store, layout).refresh_deny(force=True), a.repeat)
        blob = store.get_many([refs[0].key])[0]
        assert blob is not None
        header, payload = decode(blob)
        t_digest = best(lambda: content_digest(header, payload), a.repeat)
        loaded_bytes = int(staging.nbytes)
        store.close()
    out = {
        "tokens": a.tokens, "block_size": bs, "hit": hit, "objects_loaded": len(refs),
        "loaded_mib": round(loaded_bytes / 2**20, 1),
        "lookup_ms": round(t_plain * 1e3, 3), "lookup_verified_ms": round(t_verified * 1e3, 3),
        "lookup_ratio": round(t_verified / t_plain, 3),
        "load_ms": round(t_load * 1e3, 3), "load_all_listed_ms": round(t_load_listed * 1e3, 3),
        "load_ratio_all_listed": round(t_load_listed / t_load, 3),
        "deny_refresh_ms_4096": round(t_refresh * 1e3, 3), "deny_first_read_ms_4096": round(t_first * 1e3, 3),
        "digest_gbps": round(len(payload) / t_digest / 1e9, 1),
    }
    print(f"lookup: {out['lookup_ms']} ms without the deny-list check, {out['lookup_verified_ms']} ms as "
          f"shipped (x{out['lookup_ratio']})")
    print(f"load of {len(refs)} objects ({out['loaded_mib']} MiB): {out['load_ms']} ms, "
          f"{out['load_all_listed_ms']} ms with every key in the deny-list (x{out['load_ratio_all_listed']})")
    print(f"deny-list at {DENY_MAX} entries: {out['deny_refresh_ms_4096']} ms a refresh (every 10 s), "
          f"{out['deny_first_read_ms_4096']} ms a vault's first read; "
          f"content digest {out['digest_gbps']} GB/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
