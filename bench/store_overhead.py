"""What prefixvault's store layer costs over the raw client API, on the same batches, in one run.

    python bench/store_overhead.py [--total 128MiB] [--min-object 256KiB] [--max-object 2MiB]
                                   [--batch 16] [--repeat 7] [--stores mooncake,redis]

Starts its own servers on 127.0.0.1 (mooncake_master plus a mooncake_client holding the
memory; a valkey-server) and stops them at the end.

Mooncake. raw: ``batch_put_from`` / ``batch_get_into`` on a buffer registered with the
transfer engine, as a program using Mooncake directly would. ours: ``MooncakeStore.put_many``
and ``get_into`` on objects in the memory the store lends (``staging_buffer``: what the vault
builds objects in and loads into, no copy), and on ordinary memory (one copy each way).
Redis. raw: one pipeline of SET / GET with redis-py. ours: ``RedisStore.put_many`` /
``get_into`` into ordinary memory.

Every round writes fresh keys (Mooncake's put leaves an existing key alone, so a rewrite
would time nothing), removed between rounds outside the timing. Raw and ours take turns within
each round. Seconds are the best of ``--repeat`` rounds; a ratio is the median over rounds of
ours / raw seconds in the same round (target <= 1.1). The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from prefixvault.stores import Store, open_store
from prefixvault.units import format_size, parse_size

TARGET = 1.1


def object_sizes(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(int(rng.integers(lo, hi + 1)), total - sum(sizes)))
    return sizes


Timed = Mapping[str, tuple[Callable[[int], None], Callable[[int], None]]]


def timed(pairs: Timed, repeat: int) -> dict[str, list[float]]:
    """Seconds of each ``fn(round)`` in every round, the contenders taking turns within a
    round so that a noisy moment hits all of them; ``reset(round)`` runs untimed."""
    out: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(repeat):
        for name, (fn, reset) in pairs.items():
            t0 = time.perf_counter()
            fn(r)
            out[name].append(time.perf_counter() - t0)
            reset(r)
    return out


def figures(samples: dict[str, list[float]], ratios: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Best seconds of each contender, and each ratio as the median over rounds of ours / raw
    in the same round (robust to load that drifts across rounds on a shared machine)."""
    out = {name: round(min(v), 4) for name, v in samples.items()}
    for ratio, (ours, raw) in ratios.items():
        paired = [o / r for o, r in zip(samples[ours], samples[raw], strict=True)]
        out[ratio] = round(statistics.median(paired), 3)
    return out


class Layout:
    """Object i is bytes [off[i], off[i] + size[i]) of one source buffer, cut into batches."""

    def __init__(self, sizes: list[int], batch: int) -> None:
        self.sizes = sizes
        self.offsets = [0, *np.cumsum(sizes).tolist()][:-1]
        self.total = sum(sizes)
        self.batches = [list(range(i, min(i + batch, len(sizes)))) for i in range(0, len(sizes), batch)]

    def keys(self, tag: str, batch: list[int]) -> list[str]:
        return [f"bench/{tag}/{i}" for i in batch]


def bench_mooncake(lay: Layout, src: np.ndarray, dst: np.ndarray, repeat: int) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    from prefixvault.scenarios.mooncake import MooncakeCluster

    cluster = MooncakeCluster(segment=str(8 * lay.total))  # room below the eviction watermark
    try:
        ours = open_store(cluster.uri(prefix="", staging=str(lay.total)))
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.address) == 0
        reg = np.ones(lay.total, np.uint8)
        reg[:] = src
        assert raw.register_buffer(reg.ctypes.data, reg.nbytes) == 0
        base = reg.ctypes.data

        def raw_put(r: int) -> None:
            for b in lay.batches:
                codes = raw.batch_put_from(lay.keys(f"raw{r}", b), [base + lay.offsets[i] for i in b],
                                           [lay.sizes[i] for i in b])
                assert all(c == 0 for c in codes), codes

        def raw_get(r: int) -> None:
            for b in lay.batches:
                codes = raw.batch_get_into(lay.keys("raw0", b), [base + lay.offsets[i] for i in b],
                                           [lay.sizes[i] for i in b])
                assert all(c >= 0 for c in codes), codes

        def ours_put(r: int) -> None:
            for b in lay.batches:
                items = [(k, [src.data[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]]])
                         for k, i in zip(lay.keys(f"ours{r}", b), b, strict=True)]
                assert all(ours.put_many(items))

        lent = ours.staging_buffer(lay.total)  # objects built in lent memory, as the vault does
        assert lent is not None
        np.frombuffer(lent, np.uint8)[:] = src

        def ours_put_lent(r: int) -> None:
            for b in lay.batches:
                items = [(k, [lent[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]]])
                         for k, i in zip(lay.keys(f"lent{r}", b), b, strict=True)]
                assert all(ours.put_many(items))

        def ours_get(views: Callable[[list[int]], list[memoryview]]) -> Callable[[int], None]:
            def get(r: int) -> None:
                for b in lay.batches:
                    got = ours.get_into(lay.keys("ours0", b), views(b))
                    assert got == [lay.sizes[i] for i in b], got

            return get

        def plain_views(b: list[int]) -> list[memoryview]:
            return [dst.data[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]] for i in b]

        def staged_views(b: list[int]) -> list[memoryview]:
            return [lent[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]] for i in b]

        def drop(tag: str) -> Callable[[int], None]:
            def reset(r: int) -> None:
                if r > 0:  # round 0's keys are what the gets read
                    ours.delete_many([k for b in lay.batches for k in lay.keys(f"{tag}{r}", b)])

            return reset

        def nothing(r: int) -> None:
            pass

        for warm in (raw_put, ours_put, ours_put_lent):  # the holder's fresh pages: touched untimed
            warm(99)
            ours.delete_many([k for t in ("raw99", "ours99", "lent99") for b in lay.batches
                              for k in lay.keys(t, b)])
        puts = {"raw_put_s": (raw_put, drop("raw")), "ours_put_lent_s": (ours_put_lent, drop("lent")),
                "ours_put_plain_s": (ours_put, drop("ours"))}
        gets = {"raw_get_s": (raw_get, nothing), "ours_get_lent_s": (ours_get(staged_views), nothing),
                "ours_get_plain_s": (ours_get(plain_views), nothing)}
        result = figures(timed(puts, repeat) | timed(gets, repeat), {
            "put_lent_ratio": ("ours_put_lent_s", "raw_put_s"),
            "put_plain_ratio": ("ours_put_plain_s", "raw_put_s"),
            "get_lent_ratio": ("ours_get_lent_s", "raw_get_s"),
            "get_plain_ratio": ("ours_get_plain_s", "raw_get_s"),
        })
        ok = bytes(dst[: lay.sizes[0]]) == bytes(src[: lay.sizes[0]])
        raw.close()
        ours.close()
    finally:
        cluster.stop()
    return {**result, "raw_get_gbps": round(lay.total / result["raw_get_s"] / 1e9, 3), "bytes_ok": ok}


def bench_redis(lay: Layout, src: np.ndarray, dst: np.ndarray, repeat: int) -> dict[str, Any]:
    import redis

    from prefixvault.scenarios.valkey import Valkey

    server = Valkey()
    try:
        ours: Store = open_store(server.url(prefix=""))
        raw = redis.Redis(port=server.port)
        blobs = [src.data[o : o + n] for o, n in zip(lay.offsets, lay.sizes, strict=True)]

        def raw_put(r: int) -> None:
            for b in lay.batches:
                pipe = raw.pipeline(transaction=False)
                for k, i in zip(lay.keys(f"raw{r}", b), b, strict=True):
                    pipe.set(k, blobs[i])
                assert all(pipe.execute())

        def raw_get(r: int) -> None:
            for b in lay.batches:
                pipe = raw.pipeline(transaction=False)
                for k in lay.keys("raw0", b):
                    pipe.get(k)
                for i, data in zip(b, pipe.execute(), strict=True):
                    dst[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]] = np.frombuffer(data, np.uint8)

        def ours_put(r: int) -> None:
            for b in lay.batches:
                keys = lay.keys(f"ours{r}", b)
                assert all(ours.put_many([(k, [blobs[i]]) for k, i in zip(keys, b, strict=True)]))

        def ours_get(r: int) -> None:
            for b in lay.batches:
                views = [dst.data[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]] for i in b]
                assert ours.get_into(lay.keys("ours0", b), views) == [lay.sizes[i] for i in b]

        def drop(tag: str) -> Callable[[int], None]:
            def reset(r: int) -> None:
                if r > 0:
                    raw.delete(*[k for b in lay.batches for k in lay.keys(f"{tag}{r}", b)])

            return reset

        def nothing(r: int) -> None:
            pass

        samples = timed({"raw_put_s": (raw_put, drop("raw")), "ours_put_s": (ours_put, drop("ours"))}, repeat)
        samples |= timed({"raw_get_s": (raw_get, nothing), "ours_get_s": (ours_get, nothing)}, repeat)
        result = figures(samples, {"put_ratio": ("ours_put_s", "raw_put_s"),
                                   "get_ratio": ("ours_get_s", "raw_get_s")})
        raw.close()
        ours.close()
    finally:
        server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", default="128MiB")
    p.add_argument("--min-object", default="256KiB")
    p.add_argument("--max-object", default="2MiB")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--stores", default="mooncake,redis")
    a = p.parse_args(argv)
    if a.repeat < 2:
        p.error("--repeat must be at least 2 (round 0 is kept for the gets)")
    sizes = object_sizes(parse_size(a.total), parse_size(a.min_object), parse_size(a.max_object))
    lay = Layout(sizes, a.batch)
    src = np.empty(lay.total, np.uint8)
    src[:] = np.arange(lay.total, dtype=np.uint64) % 251  # written: resident before timing
    dst = np.ones(lay.total, np.uint8)
    result: dict[str, Any] = {"total_bytes": lay.total, "objects": len(lay.sizes), "batch": a.batch,
                              "target_ratio": TARGET}  # fmt: skip
    print(f"{len(lay.sizes)} objects, {format_size(lay.total)}, batches of {a.batch}, best of {a.repeat}",
          file=sys.stderr)
    benches = {"mooncake": bench_mooncake, "redis": bench_redis}
    for name in a.stores.split(","):
        if name not in benches:
            p.error(f"unknown store {name!r}: choose from {', '.join(benches)}")
        result[name] = benches[name](lay, src, dst, a.repeat)
        print(f"{name}: {result[name]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "1")
    sys.exit(main())
