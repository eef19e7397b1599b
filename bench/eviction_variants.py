"""Would a different eviction order pay? Two candidates, replayed against the stores' own order.

    PYTHONPATH=src python bench/eviction_variants.py [--models all|name,...]
        [--workloads chat,fewshot,agent] [--policies reuse,steps] [--capacities 0.1,0.3,1]
        [--weights 1,5,20] [--requests 400] [--jobs 2]

Replays ``bench/policy_sim.py`` (same traces, model geometries, admission code and real local
store) under variants of the order in which the store evicts:

- ``lru``: as prefixvault ranks objects today. A put ranks what it writes and a lookup what
  it hits, each in chain order (a chain ages from its tail within one call).
- ``chain``: also, after every publish, what restoring its longest boundary needs (the layout,
  the records, the KV blocks, the states stored, the state of the boundary the save continues)
  is touched again in a lookup's order, so a tail written after a hit never outlives the head
  it needs (the order then holds across calls too).
- ``value:K``: ``chain``, plus value per byte as Marconi (MLSys 2025) weighs it against
  recency: everything a boundary needs (records and layout included) is ranked as if used
  ``K`` requests later per doubling of the FLOPs a restore of that boundary saves per byte it
  needs, against a one-block boundary's (greedy-dual-size with recency as the clock; ``K``
  plays Marconi's alpha). A hit re-ranks what it restores with its own value.

The store's code is unchanged: variants only add touches, and every variant (``lru`` too)
replays with the clock the local store reads (``time.time`` in ``prefixvault.stores.local``
and ``._index``) counting one second per request, so recency is counted in requests and
results do not depend on the machine's speed; ``value:K`` adds its credit to that clock while
it ranks a chain. The patches reach the worker processes by ``fork``. Printed per variant and
policy: the change in token hit rate and in prefill FLOPs saved against ``lru`` (points, mean /
worst / best over the cells); the JSON also has every cell. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_sim
from geometry import ModelGeometry
from policy_traces import WORKLOADS

import prefixvault.stores._index as store_index
import prefixvault.stores.local as store_local
from prefixvault.boundary import Refusal, SavePlan
from prefixvault.codec import ObjectKind
from prefixvault.vault import LookupResult, ObjectRef, RankAck, Vault, chain_order


class RequestClock:
    """``time`` as the local store sees it during a replay: one second per request (plus the
    real time since the request began, under a second, so calls keep their order), plus
    ``offset``. Recency is then counted in requests, whatever the machine's speed, and a
    credit of ``K`` seconds is ``K`` requests of extra life."""

    request = 0
    began = 0.0
    offset = 0.0
    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)

    @classmethod
    def next_request(cls) -> None:
        cls.request += 1
        cls.began = time.monotonic()

    @classmethod
    def time(cls) -> float:
        return cls.request + min(0.9, time.monotonic() - cls.began) + cls.offset


#: The variant this process replays: (name, chain ranking on, weight K or None).
VARIANT: tuple[str, bool, float | None] = ("lru", False, None)
GEOMETRY: dict[str, ModelGeometry] = {}


class RankingVault(Vault):
    """The vault the replay uses, with the variant's extra ranking."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.geo = GEOMETRY[self.layout.model]
        self.parent = 0  # the last lookup's hit: the boundary the next save continues

    def _credit(self, tokens: int) -> float:
        """``K`` requests of life per doubling of the FLOPs a restore of ``tokens`` saves per
        byte it needs (a state and the KV of every token before it), against one block's:
        greedy-dual-size's value per byte, on a log scale so that one weight suits every
        model. Every object a boundary needs gets its credit (a chain is ranked as a whole)."""
        weight = VARIANT[2]
        if weight is None or tokens <= 0:
            return 0.0
        g = self.geo

        def per_byte(n: int) -> float:
            return g.prefill_flops(n) / (g.state_bytes + g.kv_bytes_per_token * n)

        return weight * math.log2(per_byte(tokens) / per_byte(g.block_size))

    def _rank(self, hashes: Sequence[bytes], tokens: int, parent: int, extra: Sequence[ObjectRef]) -> None:
        """Touch, with the boundary's credit, what restoring ``tokens`` needs, in a lookup's
        order: the layout, the records, then the chain (and the parent's state in its place)."""
        bs = self.layout.block_size
        refs = {r.key: r for r in self.needed(hashes, tokens, [0])}
        if 0 < parent < tokens:
            refs.update((r.key, r) for r in self.needed(hashes, parent, [0]) if r.kind is ObjectKind.STATE)
        refs.update((r.key, r) for r in extra)
        records = [self.keys.record(hashes[b // bs - 1]) for b in (parent, tokens) if b > 0]
        keys = [self.keys.layout(), *records[::-1], *(r.key for r in sorted(refs.values(), key=chain_order))]
        RequestClock.offset = self._credit(tokens)
        try:
            self.store.touch_many(keys)
        finally:
            RequestClock.offset = 0.0

    def lookup_explained(self, hashes: Sequence[bytes], prompt_tokens: int,
                         min_tokens: int = 0) -> LookupResult:
        RequestClock.next_request()
        found = super().lookup_explained(hashes, prompt_tokens, min_tokens)
        self.parent = found.hit
        if found.hit and VARIANT[2] is not None:
            self._rank(hashes, found.hit, 0, ())
        return found

    def save(self, rank: int, hashes: Sequence[bytes], plans: Sequence[SavePlan], read: Any,
             read_into: Any = None) -> list[RankAck]:
        RequestClock.offset = self._credit(max((p.tokens for p in plans), default=0))
        try:
            return super().save(rank, hashes, plans, read, read_into)
        finally:
            RequestClock.offset = 0.0

    def publish(self, hashes: Sequence[bytes], acks: Iterable[RankAck], parent: int = 0
                ) -> dict[int, Refusal | None]:
        acks = list(acks)
        top = max((a.tokens for a in acks), default=0)
        RequestClock.offset = self._credit(top)
        try:
            out = super().publish(hashes, acks, parent)
        finally:
            RequestClock.offset = 0.0
        published = [b for b, why in out.items() if why is None]
        if VARIANT[1] and published:
            bs = self.layout.block_size
            states = [self.state_ref(gi, 0, hashes[b // bs - 1], b // bs - 1)
                      for b in published for gi, g in enumerate(self.layout.groups) if g.is_state]
            self._rank(hashes, max(published), parent, states)
        return out


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
        setattr(module, "time", RequestClock)  # noqa: B010 (a module's global, swapped on purpose)
    setattr(policy_sim, "Vault", RankingVault)  # noqa: B010
    variants: list[tuple[str, bool, float | None]] = [("lru", False, None), ("chain", True, None)]
    variants += [(f"value:{k:g}", True, k) for k in weights]
    base = [(geo, w, args.policies.split(","), c, args.requests, args.scale, args.chunk, "", args.seed,
             16.0, [0.0], ["local"])
            for geo in models.values() for w in args.workloads.split(",") for c in caps]
    t0 = time.monotonic()
    figs: list[policy_sim.Figures] = []
    # The patches above reach the workers by fork (spawned ones would replay plain ``lru``).
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=fork) as pool:
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
