"""Would a different eviction order pay? Two candidates, replayed against the stores' own order.

    PYTHONPATH=src python bench/eviction_variants.py [--models all|name,...]
        [--workloads chat,fewshot,agent] [--policies reuse,steps] [--capacities 0.1,0.3,1]
        [--weights 1,5,20] [--requests 400] [--jobs 2]

Replays ``bench/policy_sim.py`` (same traces, model geometries, admission code and real local
store) under variants of the order in which the store evicts:

- ``lru``: as prefixvault ranks objects today. A put ranks what it writes and a lookup what
  it hits, each in chain order (a chain ages from its tail within one call).
- ``chain``: also, after every save, the whole chain up to the save's longest boundary (and
  the state of the boundary it continues) is touched again in chain order, so a tail written
  after a hit never outlives the head it needs (the order then holds across calls too).
- ``value:K``: ``chain``, plus Marconi-style value per byte (MLSys 2025): every object of a
  chain is ranked as if used ``K`` requests later per doubling of the FLOPs its newest
  boundary saves per byte it takes, relative to a chain of one block (negative below). The
  value is marginal, as a leaf's in Marconi's tree: FLOPs of the tokens since the boundary
  the save continues, over the state plus their KV. A hit re-ranks its chain with its own
  value. This is greedy-dual-size with recency as the clock; ``K`` plays Marconi's alpha.

The store's code is unchanged: variants only add touches, and ``value:K`` shifts the clock the
local store reads while it ranks a chain (``time.time`` in ``prefixvault.stores.local`` and
``._index``; a "request" is the mean wall time per request of the replay so far). Printed per
variant and policy: the change in token hit rate and in prefill FLOPs saved against ``lru``
(points, mean / worst / best over the cells). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_sim
from policy_traces import WORKLOADS

import prefixvault.stores._index as store_index
import prefixvault.stores.local as store_local
from prefixvault.boundary import SavePlan
from prefixvault.codec import ObjectKind
from prefixvault.geometry import ModelGeometry
from prefixvault.vault import LookupResult, ObjectRef, RankAck, Vault, chain_order


class ShiftedClock:
    """``time`` as the local store sees it: the real clock plus ``offset`` seconds."""

    offset = 0.0
    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)

    @classmethod
    def time(cls) -> float:
        return time.time() + cls.offset


#: The variant this process replays: (name, chain ranking on, weight K or None).
VARIANT: tuple[str, bool, float | None] = ("lru", False, None)
GEOMETRY: dict[str, ModelGeometry] = {}


class RankingVault(Vault):
    """The vault the replay uses, with the variant's extra ranking."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.t0 = time.monotonic()
        self.requests = 0
        self.parent = 0  # the last lookup's hit: the boundary the next save continues
        self.geo = GEOMETRY[self.layout.model]

    def _credit(self, tokens: int, parent: int) -> float:
        _, _, weight = VARIANT
        if weight is None or tokens <= parent:
            return 0.0
        g = self.geo

        def per_byte(n: int, since: int) -> float:
            saved = g.prefill_flops(n) - g.prefill_flops(since)
            return saved / (g.state_bytes + g.kv_bytes_per_token * (n - since))

        per_request = (time.monotonic() - self.t0) / max(1, self.requests)
        return weight * per_request * math.log2(per_byte(tokens, parent) / per_byte(g.block_size, 0))

    def _rank(self, hashes: Sequence[bytes], tokens: int, parent: int, extra: Sequence[ObjectRef]) -> None:
        refs = {r.key: r for r in self.needed(hashes, tokens, [0])}
        if 0 < parent < tokens:
            refs.update((r.key, r) for r in self.needed(hashes, parent, [0]) if r.kind is ObjectKind.STATE)
        refs.update((r.key, r) for r in extra)
        keys = [r.key for r in sorted(refs.values(), key=chain_order)]
        ShiftedClock.offset = self._credit(tokens, parent)
        try:
            self.store.touch_many(keys)
        finally:
            ShiftedClock.offset = 0.0

    def lookup_explained(self, hashes: Sequence[bytes], prompt_tokens: int,
                         min_tokens: int = 0) -> LookupResult:
        self.requests += 1
        found = super().lookup_explained(hashes, prompt_tokens, min_tokens)
        self.parent = found.hit
        if found.hit and VARIANT[2] is not None:
            self._rank(hashes, found.hit, 0, ())
        return found

    def save(self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan], read: Any,
             read_into: Any = None) -> list[RankAck]:
        if not plans or not VARIANT[1]:
            return super().save(rank, hashes, plans, read, read_into)
        top = max(p.tokens for p in plans)
        ShiftedClock.offset = self._credit(top, self.parent)
        try:
            acks = super().save(rank, hashes, plans, read, read_into)
        finally:
            ShiftedClock.offset = 0.0
        objects, _ = self.objects_of(rank, hashes, plans)
        self._rank(hashes, top, self.parent, [r for r, _ in objects])
        return acks


def _replay_variant(job: tuple[str, bool, float | None, tuple[Any, ...]]) -> list[policy_sim.Figures]:
    global VARIANT
    name, chain, weight, args = job
    VARIANT = (name, chain, weight)
    figs = policy_sim._job(args)
    for f in figs:
        f.policy = f"{f.policy}/{name}"
    return figs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="all")
    ap.add_argument("--workloads", default="chat,fewshot,agent")
    ap.add_argument("--policies", default="reuse,steps")
    ap.add_argument("--capacities", default="0.1,0.3,1")
    ap.add_argument("--weights", default="1,5,20", help="K of value:K (requests per doubling)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--scale", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    models = policy_sim.load_models([] if args.models == "all" else args.models.split(","))
    GEOMETRY.update((g.name, g) for g in models.values())
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {sorted(WORKLOADS)}")
    try:
        weights = [float(k) for k in args.weights.split(",") if k]
    except ValueError:
        raise SystemExit(f"--weights: numbers, not {args.weights!r}") from None
    caps = [float(c) for c in args.capacities.split(",")]
    for module in (store_local, store_index):
        setattr(module, "time", ShiftedClock)  # noqa: B010 (a module's global, swapped on purpose)
    setattr(policy_sim, "Vault", RankingVault)  # noqa: B010
    variants: list[tuple[str, bool, float | None]] = [("lru", False, None), ("chain", True, None)]
    variants += [(f"value:{k:g}", True, k) for k in weights]
    base = [(geo, w, args.policies.split(","), c, args.requests, args.scale, args.chunk, False, args.seed,
             16.0, [0.0], ["local"])
            for geo in models.values() for w in args.workloads.split(",") for c in caps]
    t0 = time.monotonic()
    figs: list[policy_sim.Figures] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done in pool.map(_replay_variant, [(*v, job) for v in variants for job in base]):
            figs.extend(done)
    by = {(f.model, f.workload, f.capacity, f.policy): f for f in figs}
    summary: dict[str, Any] = {"bench": "eviction_variants", "requests": args.requests, "cells": len(base),
                               "variants": {}}
    print(f"{'variant':>10} {'policy':>8} {'hit rate, points vs lru':>32} {'FLOPs saved, points vs lru':>32}")
    print(f"{'':>10} {'':>8} {'mean':>10} {'worst':>10} {'best':>10} {'mean':>10} {'worst':>10} {'best':>10}")
    for name, _, _ in variants[1:]:
        for policy in args.policies.split(","):
            dh, df = [], []
            for (m, w, c, p), f in by.items():
                if p == f"{policy}/{name}":
                    ref = by[(m, w, c, f"{policy}/lru")]
                    dh.append(100 * (f.hit_rate - ref.hit_rate))
                    df.append(100 * (f.flops_saved_share - ref.flops_saved_share))
            row = {"hit_mean": round(sum(dh) / len(dh), 2), "hit_worst": round(min(dh), 2),
                   "hit_best": round(max(dh), 2), "flops_mean": round(sum(df) / len(df), 2),
                   "flops_worst": round(min(df), 2), "flops_best": round(max(df), 2)}
            summary["variants"][f"{policy}/{name}"] = row
            print(f"{name:>10} {policy:>8} {row['hit_mean']:>10.2f} {row['hit_worst']:>10.2f} "
                  f"{row['hit_best']:>10.2f} {row['flops_mean']:>10.2f} {row['flops_worst']:>10.2f} "
                  f"{row['flops_best']:>10.2f}")
    summary["runs"] = [{"model": m, "workload": w, "capacity": c, "policy": p,
                        "hit_rate": round(f.hit_rate, 4), "flops_saved_share": round(f.flops_saved_share, 4)}
                       for (m, w, c, p), f in sorted(by.items())]
    summary["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
