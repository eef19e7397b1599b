"""A short, honest end-to-end run of the vault protocol on a real store.

A toy hybrid "engine" (one attention group, one recurrent-state group) computes
deterministically in float32: a KV block is a function of its tokens and position, the
state after t tokens is a recurrence over every token so far. A producer process runs a
prompt in chunks, like an engine with ``max_num_batched_tokens``: states exist only where
a chunk ended on a block boundary, every other state position is the null block. It
publishes what the boundary rule allows. A consumer process with another prompt sharing
a long prefix looks up, loads, verifies and resumes; its final state and KV must equal a
cold run's bit for bit.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixvault.boundary import NULL_BLOCK_ID, StateCapture, plan_saves
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec
from prefixvault.stores import open_store, redact
from prefixvault.vault import ObjectRef, Vault

BLOCK = 16
DIM = 64
STATE_SHAPE = (DIM, DIM)


def toy_layout() -> CacheLayout:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, BLOCK, DIM), "float32")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec(STATE_SHAPE, "float32")],
                               family=StateFamily.GDN)
    return CacheLayout(model="prefixvault-demo-toy", block_size=BLOCK, groups=(attn, state))


def _embed(token: int, position: int) -> np.ndarray:
    rng = np.random.default_rng(token * 1_000_003 + position)
    return rng.standard_normal(DIM).astype(np.float32)


def kv_block(tokens: Sequence[int], index: int) -> np.ndarray:
    lo = index * BLOCK
    rows = np.stack([_embed(t, lo + j) for j, t in enumerate(tokens[lo : lo + BLOCK])])
    return np.stack([rows, rows * np.float32(0.5)])


def advance(state: np.ndarray, tokens: Sequence[int], start: int, end: int) -> np.ndarray:
    """The recurrence: each token decays the state and adds an outer product."""
    s = state.copy()
    for t in range(start, end):
        e = _embed(tokens[t], 0)
        s = np.float32(0.97) * s + np.outer(e, e).astype(np.float32) * np.float32(0.01)
    return s


@dataclass
class ToyEngine:
    """Block pool of two groups; block 0 is the null block, as in vLLM."""

    kv: np.ndarray
    states: np.ndarray

    @classmethod
    def new(cls, n_blocks: int = 512) -> ToyEngine:
        return cls(np.zeros((n_blocks, 2, BLOCK, DIM), np.float32),
                   np.zeros((n_blocks, *STATE_SHAPE), np.float32))


def make_prompts() -> tuple[list[int], list[int], int]:
    rng = np.random.default_rng(7)
    shared = rng.integers(1, 30000, 700).tolist()
    producer = shared + rng.integers(1, 30000, 140).tolist()
    consumer = shared + rng.integers(1, 30000, 90).tolist()
    return producer, consumer, len(shared)


def produce(uri: str, prompt: list[int], chunk: int) -> dict[str, object]:
    """Run the prompt in chunks; publish every boundary the rule allows."""
    layout = toy_layout()
    vault = Vault(open_store(uri), layout, namespace="demo")
    hashes = vault.hashes(prompt)
    engine = ToyEngine.new()
    attn_table: list[int] = []
    state = np.zeros(STATE_SHAPE, np.float32)
    next_state_block = 1
    published: list[int] = []
    refused = []
    done = parent = 0
    for step, start in enumerate(range(0, len(prompt), chunk)):
        end = min(start + chunk, len(prompt))
        for i in range(len(attn_table), end // BLOCK):
            attn_table.append(1 + i)
            engine.kv[1 + i] = kv_block(prompt, i)
        state = advance(state, prompt, start, end)
        captures = []
        if end % BLOCK == 0:  # the engine keeps a state only where a step ends on a block
            bid = 256 + next_state_block
            next_state_block += 1
            engine.states[bid] = state
            captures.append(StateCapture(1, end, bid, step))
        # A naive connector would publish every block boundary; the rule decides instead.
        candidates = range(done + BLOCK, end // BLOCK * BLOCK + 1, BLOCK)
        decision = plan_saves(layout, end, {0: attn_table}, captures, step, candidates, since=parent)

        def read(ref: ObjectRef, block_id: int) -> memoryview:
            assert block_id != NULL_BLOCK_ID
            src = engine.kv if ref.kind is ObjectKind.BLOCK else engine.states
            return np.ascontiguousarray(src[block_id]).data.cast("B")

        acks = vault.save(0, hashes, decision.publishable, read)
        ok = sorted(b for b, why in vault.publish(hashes, acks, parent).items() if why is None)
        published.extend(ok)
        parent = max([parent, *ok])
        for b, why in decision.refused:
            vault.refuse(why)
            refused.append((b, why.value))
        done = end // BLOCK * BLOCK
    c = vault.counters
    return {"published": published, "refused": len(refused),
            "refused_reasons": sorted({r for _, r in refused}),
            "put_keys": c.put_keys, "put_bytes": c.put_bytes, "put_failed": c.put_failed}


def consume(uri: str, prompt: list[int], naive_at: int) -> dict[str, object]:
    """Look up, load and verify, resume, and compare with a cold run bit for bit."""
    layout = toy_layout()
    vault = Vault(open_store(uri), layout, namespace="demo")
    hashes = vault.hashes(prompt)
    hit = vault.lookup(hashes, len(prompt))
    state = np.zeros(STATE_SHAPE, np.float32)
    kv = [kv_block(prompt, i) for i in range(len(prompt) // BLOCK)]
    failed: dict[str, str] = {}
    if hit:
        loaded = vault.load(vault.needed(hashes, hit))
        failed = {r.key: why for r, why in loaded.failed.items()}
        if loaded.ok:
            for ref, payload in loaded.payloads.items():
                arr = np.frombuffer(payload, np.float32)
                if ref.kind is ObjectKind.STATE:
                    state = arr.reshape(STATE_SHAPE).copy()
                else:
                    kv[ref.block_index] = arr.reshape(2, BLOCK, DIM).copy()
        else:
            hit = 0  # recompute everything rather than use anything unverified
    resumed = advance(state, prompt, hit, len(prompt))
    cold = advance(np.zeros(STATE_SHAPE, np.float32), prompt, 0, len(prompt))
    kv_equal = all(np.array_equal(a, kv_block(prompt, i)) for i, a in enumerate(kv))
    # What the seed bug did: resume at the last shared block from the null block's zeros.
    naive = advance(np.zeros(STATE_SHAPE, np.float32), prompt, naive_at, len(prompt))
    c = vault.counters
    return {"hit_tokens": hit, "state_equal": bool(np.array_equal(resumed, cold)),
            "naive_state_equal": bool(np.array_equal(naive, cold)),
            "kv_equal": kv_equal, "get_keys": c.get_keys, "get_bytes": c.get_bytes,
            "get_failed": c.get_failed, "failed": failed}


def _in_process(fn: object, *args: object) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        result: dict[str, object] = pool.apply(fn, args)  # type: ignore[arg-type]
    return result


def run(uri: str, chunk: int = 200, as_json: bool = False) -> bool:
    """Producer and consumer in separate processes over ``uri``; True if the consumer is exact."""
    from rich.console import Console
    from rich.table import Table

    console = Console(quiet=as_json)
    producer, consumer, shared = make_prompts()
    t0 = time.perf_counter()
    console.print(f"[bold]prefixvault demo[/] store={redact(uri)} block={BLOCK} chunk={chunk} "
                  f"shared prefix={shared} tokens")
    console.print(f"producer: {len(producer)} tokens in chunks of {chunk} (separate process)")
    p = _in_process(produce, uri, producer, chunk)
    console.print(f"consumer: {len(consumer)} tokens (separate process)")
    c = _in_process(consume, uri, consumer, shared // BLOCK * BLOCK)
    aligned = [b for b in range(chunk, len(producer) + 1, chunk) if b % BLOCK == 0]
    expected_hit = max([b for b in aligned if b <= shared // BLOCK * BLOCK] or [0])
    table = Table(title="publish → look up → load → verify")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("boundaries published", ", ".join(map(str, p["published"]))),  # type: ignore[call-overload]
        ("boundaries refused (no exact state)", str(p["refused"])),
        ("put keys / bytes / failed", f"{p['put_keys']} / {p['put_bytes']} / {p['put_failed']}"),
        ("last full shared block", str(shared // BLOCK * BLOCK)),
        ("longest resumable boundary", str(expected_hit)),
        ("external hit tokens", str(c["hit_tokens"])),
        ("get keys / bytes / failed", f"{c['get_keys']} / {c['get_bytes']} / {c['get_failed']}"),
        ("restored state == cold (bit-exact)", str(c["state_equal"])),
        ("restored KV == cold (bit-exact)", str(c["kv_equal"])),
        (f"null-block state at {shared // BLOCK * BLOCK} == cold (the seed bug)",
         str(c["naive_state_equal"])),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    ok = bool(c["state_equal"] and c["kv_equal"] and c["hit_tokens"] == expected_hit
              and not c["naive_state_equal"])
    console.print(("[green]OK[/]" if ok else "[red]MISMATCH[/]") +
                  f" in {time.perf_counter() - t0:.1f}s")
    if as_json:
        print(json.dumps({"ok": ok, "expected_hit": expected_hit, "producer": p, "consumer": c}))
    return ok
