"""Lookup time and record bytes as prompts grow, on the memory store (or a slow Redis).

    python bench/lookup.py [--tokens 1024,8192,32768,131072] [--block-sizes 16,256]
                           [--layouts attention,hybrid] [--repeat 5] [--max-blocks N]
                           [--redis-delay-ms D | --mooncake-delay-ms D] [--tails]

For each prompt length, block size and layout, a producer publishes *every* block boundary
of one prompt through the vault's save and publish path (what a connector does, with tiny
payloads: this measures the protocol, not memcpy), then a consumer whose prompt extends it by
one token looks it up. Printed per case: the lookup time (best of ``--repeat``), the time
to hash the consumer's prompt (done once per request, beside the lookup), and the record
bytes per published boundary. ``attention`` is one full-attention group; ``hybrid`` adds a
state group, so every boundary also needs a state. Goal: a 131072-token prompt at block
size 16 looks up in <= 20 ms; record bytes per boundary constant in the prompt length.

With ``--redis-delay-ms D`` the store is a real valkey-server behind a loopback link that adds
D ms to every round trip (``scenarios.netfault.SlowLink``); with ``--mooncake-delay-ms D`` it
is a real Mooncake cluster (``mooncake_master`` and a holder) whose master is behind such a link
(the transfers themselves go straight to the holder; the link runs in a process of its own, as
Mooncake's client holds the interpreter lock in some calls). The lookup is timed as the
connector makes it: until the answer, with the touch of what the hit uses made after it (also
timed). Each case is also looked up with objects never checked beside the records
(``SPECULATIVE_KEYS = 0``: two round trips, as before that was done), and the ratio printed.

With ``--tails`` (hybrid layouts) the producer's prompt goes on half a block past its last block
boundary, and that prompt's end is published as a tail boundary: the block boundary's tail
index then exists. Two more lookups are timed, each as a connector makes it (with the prompt's
tokens, so tails are looked up): a prompt that shares the blocks but not the tail and goes a
block further (the index is read, no tail is this prompt's), and the producer's prompt one token
longer (a tail hit). Each is timed with the store's ``touch_and_get`` as it is (one pipeline on
Redis; on Mooncake a check and one read that guesses the index's size) and as two calls
(``Store.touch_and_get``'s default: how the index was read before), in one run.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from prefixvault import lookup as lookup_module
from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.keys import PromptTokens
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.base import Store
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import ObjectRef, Vault

GOAL_MS = 20.0


def make_layout(kind: str, block_size: int) -> CacheLayout:
    groups = [CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")])]
    if kind == "hybrid":
        groups.append(CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")]))
    elif kind != "attention":
        raise SystemExit(f"unknown layout {kind!r}: use attention or hybrid")
    return CacheLayout(model=f"bench-{kind}", block_size=block_size, groups=tuple(groups))


def payload(ref: ObjectRef, block_id: int) -> bytes:
    return bytes([block_id % 251]) * 8


def publish_every_boundary(vault: Vault, tokens: list[int], chunk: int) -> int:
    """Publish every block boundary of ``tokens`` as a connector would, chunk by chunk."""
    bs = vault.layout.block_size
    hashes = vault.hashes(tokens)
    n = len(hashes)
    table = list(range(1, n + 1))
    state_groups = [i for i, g in enumerate(vault.layout.groups) if g.is_state]
    parent = 0
    for step, start in enumerate(range(0, n * bs, chunk)):
        end = min(start + chunk, n * bs)
        ends = range(start + bs, end + 1, bs)
        caps = [StateCapture(g, b, b // bs, step) for g in state_groups for b in ends]
        decision = plan_saves(vault.layout, end, {0: table}, caps, step, since=parent)
        acks = vault.save(0, hashes, decision.publishable, payload)
        vault.publish(hashes, acks, parent=parent)
        parent = end
    return n


def record_bytes(vault: Vault) -> tuple[int, int]:
    sizes = [size for _, size in vault.store.scan(vault.keys.record_prefix())]
    return len(sizes), sum(sizes)


def timed_lookups(vault: Vault, hashes: list[bytes], prompt: int, repeat: int, speculative: int
                  ) -> tuple[list[float], list[float], int]:
    """Milliseconds to each answer and to each touch after it, and the hit."""
    answers, touches, hit = [], [], 0
    default = lookup_module.SPECULATIVE_KEYS
    lookup_module.SPECULATIVE_KEYS = speculative
    try:
        for _ in range(repeat):
            later: list[tuple[list[str], list[bool]]] = []
            t0 = time.perf_counter()
            hit = vault.lookup_many([(hashes, prompt, 0)], touch_later=later)[0].hit
            t1 = time.perf_counter()
            vault.touch(later)
            answers.append((t1 - t0) * 1e3)
            touches.append((time.perf_counter() - t1) * 1e3)
    finally:
        lookup_module.SPECULATIVE_KEYS = default
    return answers, touches, hit


def publish_tail(vault: Vault, tokens: list[int]) -> None:
    """Publish the end of ``tokens`` (inside a block; its block boundary already published) as
    a tail boundary, as a connector does for a prompt's exact end."""
    bs = vault.layout.block_size
    end, parent = len(tokens), len(tokens) // bs * bs
    n = -(-end // bs)
    caps = [StateCapture(g, end, n, 0) for g, group in enumerate(vault.layout.groups) if group.is_state]
    table = {0: list(range(1, n + 1))}
    decision = plan_saves(vault.layout, end, table, caps, 0, candidates=[end], since=parent)
    hashes = vault.prefix_hashes(tokens)
    vault.publish(hashes, vault.save(0, hashes, decision.publishable, payload), parent, seed=vault.seed())


def timed_tail_lookups(vault: Vault, prompt: list[int], repeat: int, separate: bool) -> tuple[float, int]:
    """Best milliseconds to the answer of a lookup of ``prompt`` with its tails, and its hit;
    ``separate``: the store's check and read made as two calls."""
    store = vault.store
    kind = type(store)
    own = kind.__dict__.get("touch_and_get")
    if separate and own is not None:
        kind.touch_and_get = Store.touch_and_get  # type: ignore[method-assign]
    best, hit = float("inf"), 0
    try:
        hashes = vault.hashes(prompt)
        for _ in range(repeat):
            later: list[tuple[list[str], list[bool]]] = []
            t0 = time.perf_counter()
            hit = vault.lookup_many([(hashes, len(prompt), 0)], touch_later=later,
                                    prompts=[PromptTokens(prompt)])[0].hit
            best = min(best, (time.perf_counter() - t0) * 1e3)
            vault.touch(later)
    finally:
        if separate and own is not None:
            kind.touch_and_get = own  # type: ignore[method-assign]
    return best, hit


def tail_case(vault: Vault, prompt: list[int], repeat: int) -> dict[str, Any]:
    """The two tail lookups (``--tails``), each both ways."""
    bs = vault.layout.block_size
    produced = [*prompt, *range(11, 11 + bs // 2)]
    publish_tail(vault, produced)
    out: dict[str, Any] = {}
    other = [*prompt, *[7] * (bs + 1)]  # past the published tail's block boundary: its index read
    for name, consumer, expected in (("index_read", other, len(prompt)),
                                     ("tail_hit", [*produced, 7], len(produced))):
        one, hit = timed_tail_lookups(vault, consumer, repeat, separate=False)
        two, hit_two = timed_tail_lookups(vault, consumer, repeat, separate=True)
        if hit != expected or hit_two != expected:
            raise SystemExit(f"{name}: lookup hit {hit} / {hit_two}, expected {expected}")
        out[name] = {"ms": round(one, 3), "separate_ms": round(two, 3), "ratio": round(one / two, 3)}
    return out


def run_case(kind: str, block_size: int, tokens: int, repeat: int, shared: Store | None = None,
             tails: bool = False) -> dict[str, Any]:
    store = shared if shared is not None else MemoryStore()
    vault = Vault(store, make_layout(kind, block_size), namespace=f"bench-{kind}-{block_size}-{tokens}")
    rng = np.random.default_rng(tokens + block_size)
    prompt = rng.integers(0, 150_000, tokens).tolist()
    chunk = max(block_size, 2048 // block_size * block_size)
    t0 = time.perf_counter()
    publish_every_boundary(vault, prompt, chunk)
    publish_s = time.perf_counter() - t0
    records, rbytes = record_bytes(vault)
    consumer = [*prompt, 7]
    t0 = time.perf_counter()
    hashes = vault.hashes(consumer)
    hash_ms = (time.perf_counter() - t0) * 1e3
    times, touches, hit = timed_lookups(vault, hashes, len(consumer), repeat, lookup_module.SPECULATIVE_KEYS)
    two, _, hit_two = timed_lookups(vault, hashes, len(consumer), repeat, 0)
    if hit != tokens or hit_two != tokens:
        raise SystemExit(f"{kind} bs={block_size} {tokens} tokens: lookup hit {hit} / {hit_two}, "
                         f"expected {tokens}")
    tail_figures = tail_case(vault, prompt, repeat) if tails and vault.layout.has_state else {}
    return {
        **({"tails": tail_figures} if tail_figures else {}),
        "layout": kind, "block_size": block_size, "tokens": tokens, "records": records,
        "lookup_ms": round(min(times), 3), "touch_after_ms": round(min(touches), 3),
        "two_round_trips_ms": round(min(two), 3), "ratio": round(min(times) / min(two), 3),
        "hash_ms": round(hash_ms, 3),
        "record_bytes_per_boundary": round(rbytes / max(records, 1), 1),
        "publish_s": round(publish_s, 3),
    }


def _serve_link(target: int, delay: float, conn: Connection) -> None:
    from prefixvault.scenarios.netfault import SlowLink

    conn.send(SlowLink(target, delay).port)
    threading.Event().wait()


def slow_link_process(target: int, delay: float) -> tuple[int, multiprocessing.Process]:
    """A ``SlowLink`` to ``target`` in a process of its own, and its port."""
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=_serve_link, args=(target, delay, theirs),
                                                        daemon=True)
    proc.start()
    return int(ours.recv()), proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768,131072")
    ap.add_argument("--block-sizes", default="16,256")
    ap.add_argument("--layouts", default="attention,hybrid")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-blocks", type=int, default=0, help="skip cases with more blocks (0: none)")
    ap.add_argument("--redis-delay-ms", type=float, default=None,
                    help="look up in a real valkey-server behind a link adding this many ms per round trip")
    ap.add_argument("--mooncake-delay-ms", type=float, default=None,
                    help="look up in a real Mooncake cluster, its master behind a link adding this many ms")
    ap.add_argument("--tails", action="store_true",
                    help="hybrid layouts: also time lookups where a tail index exists (see above)")
    args = ap.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
        sizes = [int(b) for b in args.block_sizes.split(",")]
    except ValueError as e:
        ap.error(f"bad number: {e}")
    if args.repeat < 1 or any(t < 1 for t in lengths) or any(b < 1 for b in sizes):
        ap.error("--repeat, --tokens and --block-sizes must be positive")
    delays = [d for d in (args.redis_delay_ms, args.mooncake_delay_ms) if d is not None]
    if any(d < 0 for d in delays):
        ap.error("a delay must not be negative")
    if len(delays) > 1:
        ap.error("--redis-delay-ms and --mooncake-delay-ms: one store at a time")
    store: Store | None = None
    stop: list[Any] = []
    store_name = "memory"
    if args.mooncake_delay_ms is not None:
        from prefixvault.scenarios.mooncake import MooncakeCluster
        from prefixvault.stores import open_store

        cluster = MooncakeCluster(segment="1GiB")
        port, linker = slow_link_process(cluster.rpc_port, args.mooncake_delay_ms / 1000)
        store = open_store(f"mooncake://127.0.0.1:{port}?admin=127.0.0.1:{cluster.admin_port}&timeout=30")
        stop = [store.close, linker.kill, cluster.stop]
        store_name = f"mooncake+{args.mooncake_delay_ms}ms"
    if args.redis_delay_ms is not None:
        from prefixvault.scenarios.netfault import SlowLink
        from prefixvault.scenarios.valkey import Valkey
        from prefixvault.stores import open_store

        valkey = Valkey()
        link = SlowLink(valkey.port, args.redis_delay_ms / 1000)
        store = open_store(f"redis://127.0.0.1:{link.port}/0?timeout=30")
        stop = [store.close, link.close, valkey.stop]
        store_name = f"redis+{args.redis_delay_ms}ms"
    cases = []
    print(f"{'layout':<10} {'block':>5} {'tokens':>7} {'records':>7} {'lookup ms':>10} {'2 RT ms':>9} "
          f"{'touch ms':>9} {'hash ms':>8} {'record B/boundary':>18} {'publish s':>9}")
    try:
        for kind in args.layouts.split(","):
            for bs in sizes:
                for t in lengths:
                    if args.max_blocks and t // bs > args.max_blocks:
                        continue
                    c = run_case(kind, bs, t // bs * bs, args.repeat, store, args.tails)
                    cases.append(c)
                    print(f"{kind:<10} {bs:>5} {c['tokens']:>7} {c['records']:>7} {c['lookup_ms']:>10.3f} "
                          f"{c['two_round_trips_ms']:>9.3f} {c['touch_after_ms']:>9.3f} {c['hash_ms']:>8.3f} "
                          f"{c['record_bytes_per_boundary']:>18.1f} {c['publish_s']:>9.3f}", flush=True)
                    for name, f in c.get("tails", {}).items():
                        print(f"  {name}: {f['ms']:.3f} ms, index read in a second call "
                              f"{f['separate_ms']:.3f} ms ({f['ratio']:.2f})", flush=True)
    finally:  # (the servers and the link go, whatever a case raised)
        for done in stop:
            done()
    goal = [c for c in cases if c["block_size"] == 16 and c["tokens"] == 131072]
    summary = {
        "bench": "lookup",
        "store": store_name,
        "goal_ms": GOAL_MS,
        "goal_met": all(c["lookup_ms"] <= GOAL_MS for c in goal) if goal and store is None else None,
        "cases": cases,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
