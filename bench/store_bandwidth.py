"""Store bandwidth against plain memcpy of the same bytes, measured in one run.

    python bench/store_bandwidth.py [--uri URI] [--total 256MiB]
                                    [--min-object 1MiB] [--max-object 4MiB]

Without ``--uri`` a fresh local store is made under /dev/shm and removed at the end. The
objects have random sizes in [min, max] and add up to ``total``; source and destination
buffers are written once before any timing so no figure pays for first-touch page faults.
Each figure is the best of ``--repeat`` rounds. The first put round creates the store's
slabs and is reported on its own as the cold put. ``get+checksum`` adds the xxh3 pass the
codec makes over every payload on load in a namespace without a secret. In a namespace with
one, objects are encrypted (codec.py): ``put+encrypt`` is a save's put, each object encrypted
straight into the store's memory (``Store.put_filled``, ``codec.encode_into``), and
``get+decrypt`` a load's read, each object decrypted and its tag verified straight out of the
store's memory into the destination (``Store.get_taken``, ``codec.decode``), as the vault does.
Their ratios count payload bytes against the same memcpy. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prefixvault.codec import (
    HEADER_SIZE,
    IntegrityError,
    ObjectHeader,
    ObjectKind,
    checksum,
    decode,
    encode_into,
)
from prefixvault.stores import Store, open_store
from prefixvault.tenancy import NamespaceKey
from prefixvault.units import format_size, parse_size

TARGETS = {"get_ratio": 0.8, "put_ratio": 0.6, "get_decrypt_ratio": 0.5, "put_encrypt_ratio": 0.5}


def object_sizes(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Random sizes in [lo, hi] whose sum is exactly ``total`` (the last one may be smaller)."""
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    left = total
    while left > 0:
        n = min(int(rng.integers(lo, hi + 1)), left)
        sizes.append(n)
        left -= n
    return sizes


def best_seconds(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def default_uri(total: int) -> tuple[str, Path]:
    """A fresh local store under /dev/shm (else the temp dir), with room for two copies."""
    capacity = max(4 * total, 1 << 30)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if base is not None and shutil.disk_usage(base).free < 2 * capacity:
        base = None
    tmp = Path(tempfile.mkdtemp(prefix="prefixvault-bench-", dir=base))
    return f"local://{tmp / 'store'}?capacity={capacity}", tmp


def run(store: Store, sizes: list[int], batch: int, repeat: int) -> dict[str, float | bool]:
    total = sum(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    src = np.empty(total, dtype=np.uint8)
    src[:] = np.arange(total, dtype=np.uint64) % 251  # written: resident before timing
    dst = np.ones(total, dtype=np.uint8)  # written: resident before timing
    bounds = [(int(offsets[i]), int(offsets[i + 1])) for i in range(len(sizes))]
    tag = os.urandom(4).hex()
    keys = [f"bench/{tag}/{i}" for i in range(len(sizes))]
    batches = [list(range(i, min(i + batch, len(sizes)))) for i in range(0, len(sizes), batch)]

    def memcpy() -> None:
        for a, b in bounds:
            np.copyto(dst[a:b], src[a:b])

    stored_all = True

    def put() -> None:
        nonlocal stored_all
        for idx in batches:
            ok = store.put_many([(keys[i], [src[bounds[i][0] : bounds[i][1]].data]) for i in idx])
            stored_all = stored_all and all(ok)

    def get() -> None:
        for idx in batches:
            store.get_into([keys[i] for i in idx], [dst[bounds[i][0] : bounds[i][1]].data for i in idx])

    def get_and_checksum() -> None:  # what a verified load costs: the codec hashes every payload
        for idx in batches:
            views = [dst[bounds[i][0] : bounds[i][1]].data for i in idx]
            store.get_into([keys[i] for i in idx], views)
            for v in views:
                checksum(v)

    key = NamespaceKey.derive(os.urandom(32), "bench")
    fingerprint = os.urandom(16)
    headers = [ObjectHeader(ObjectKind.BLOCK, fingerprint, i.to_bytes(16, "little"), length=n)
               for i, n in enumerate(sizes)]
    enc_keys = [f"bench/{tag}/e{i}" for i in range(len(sizes))]
    obj_offsets = np.concatenate([[0], np.cumsum([HEADER_SIZE + n for n in sizes])]).astype(np.int64)
    objects = np.ones(int(obj_offsets[-1]), dtype=np.uint8)  # written: resident before timing
    obj_bounds = [(int(obj_offsets[i]), int(obj_offsets[i + 1])) for i in range(len(sizes))]
    refused: list[str] = []

    def filler(i: int) -> Callable[[memoryview], None]:
        def fill(out: memoryview) -> None:
            encode_into(headers[i], src[bounds[i][0] : bounds[i][1]].data, out, key)
        return fill

    def put_and_encrypt() -> None:  # a save in a namespace with a secret
        nonlocal stored_all
        for idx in batches:
            ok = store.put_filled([(enc_keys[i], HEADER_SIZE + sizes[i], filler(i)) for i in idx])
            stored_all = stored_all and all(ok)

    def get_and_decrypt() -> None:  # a load there: decrypted and verified as it is copied
        for idx in batches:
            views = [objects[obj_bounds[i][0] : obj_bounds[i][1]].data for i in idx]

            def take(j: int, got: memoryview, out: memoryview, idx: list[int] = idx) -> None:
                try:
                    decode(got, headers[idx[j]], key, out=out[HEADER_SIZE:])
                except IntegrityError as e:
                    refused.append(e.reason)

            store.get_taken([enc_keys[i] for i in idx], views, take)

    memcpy_s = best_seconds(memcpy, repeat)
    cold_s = best_seconds(put, 1)
    put_s = best_seconds(put, repeat)
    dst[:] = 1
    get_s = best_seconds(get, repeat)
    verified = bool(np.array_equal(src, dst))
    checked_s = best_seconds(get_and_checksum, repeat)
    best_seconds(put_and_encrypt, 1)  # (the cold put of these objects: not reported)
    encrypt_s = best_seconds(put_and_encrypt, repeat)
    decrypt_s = best_seconds(get_and_decrypt, repeat)
    decrypted = not refused and all(
        np.array_equal(objects[obj_bounds[i][0] + HEADER_SIZE : obj_bounds[i][1]], src[a:b])
        for i, (a, b) in enumerate(bounds))
    store.delete_many(keys + enc_keys)
    memcpy_gbps = gbps(total, memcpy_s)
    put_gbps = gbps(total, put_s)
    get_gbps = gbps(total, get_s)
    return {
        "memcpy_gbps": round(memcpy_gbps, 3),
        "put_gbps": round(put_gbps, 3),
        "get_gbps": round(get_gbps, 3),
        "cold_put_gbps": round(gbps(total, cold_s), 3),
        "put_ratio": round(put_gbps / memcpy_gbps, 3),
        "get_ratio": round(get_gbps / memcpy_gbps, 3),
        "get_checksum_gbps": round(gbps(total, checked_s), 3),
        "get_checksum_ratio": round(gbps(total, checked_s) / memcpy_gbps, 3),
        "put_encrypt_gbps": round(gbps(total, encrypt_s), 3),
        "put_encrypt_ratio": round(gbps(total, encrypt_s) / memcpy_gbps, 3),
        "get_decrypt_gbps": round(gbps(total, decrypt_s), 3),
        "get_decrypt_ratio": round(gbps(total, decrypt_s) / memcpy_gbps, 3),
        "decrypt_vs_checksum": round(checked_s / decrypt_s, 3),  # next to a plain verified load
        "stored_all": stored_all,
        "verified": verified and decrypted,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--uri", help="store to measure (default: a fresh local store in /dev/shm)")
    ap.add_argument("--total", default="256MiB", help="bytes moved per round")
    ap.add_argument("--min-object", default="1MiB")
    ap.add_argument("--max-object", default="4MiB")
    ap.add_argument("--batch", type=int, default=16, help="objects per put_many/get_into call")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per figure; the best counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    lo, hi = parse_size(args.min_object), parse_size(args.max_object)
    if not 0 < lo <= hi:
        ap.error("need 0 < --min-object <= --max-object")
    sizes = object_sizes(total, lo, hi, args.seed)

    cleanup: Path | None = None
    uri = args.uri
    if uri is None:
        uri, cleanup = default_uri(total)
    try:
        with open_store(uri) as store:
            result = run(store, sizes, max(1, args.batch), max(1, args.repeat))
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)

    print(f"store   {uri}")
    print(f"objects {len(sizes)} of {format_size(lo)}..{format_size(hi)}, {format_size(total)}")
    print(f"{'':14}{'GB/s':>8}{'x memcpy':>10}{'target':>8}")
    rows = [
        ("memcpy", result["memcpy_gbps"], 1.0, None),
        ("put_many", result["put_gbps"], result["put_ratio"], TARGETS["put_ratio"]),
        ("get_into", result["get_gbps"], result["get_ratio"], TARGETS["get_ratio"]),
        ("get+checksum", result["get_checksum_gbps"], result["get_checksum_ratio"], None),
        ("put+encrypt", result["put_encrypt_gbps"], result["put_encrypt_ratio"],
         TARGETS["put_encrypt_ratio"]),
        ("get+decrypt", result["get_decrypt_gbps"], result["get_decrypt_ratio"],
         TARGETS["get_decrypt_ratio"]),
        ("cold put", result["cold_put_gbps"], None, None),
    ]
    for name, rate, ratio, target in rows:
        ratio_s = f"{ratio:10.2f}" if ratio is not None else f"{'':10}"
        target_s = f"{target:8.2f}" if target is not None else ""
        print(f"{name:14}{rate:8.2f}{ratio_s}{target_s}")
    if not result["verified"] or not result["stored_all"]:
        print("warning: some objects were not stored or read back intact", file=sys.stderr)
    print(json.dumps({**result, "targets": TARGETS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
