"""Property tests of the boundary rule through the whole protocol (publish → lookup → load).

A simulated engine fills block tables (with null blocks), reports state captures (some on
the null block, some stale, most exact), stores through a store where one rank may fail to
write, and objects get evicted afterwards. Whatever happens, a consumer's hit must be the
longest boundary that truly resumes, and every byte it loads must equal the bytes a cold
computation of its own prompt gives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixvault.boundary import (
    NULL_BLOCK_ID,
    Refusal,
    StateCapture,
    choose_hit,
    max_resume_tokens,
    plan_saves,
)
from prefixvault.codec import ObjectKind
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.base import Buffer
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import ObjectRef, Vault

BS = 4
PAYLOAD = 8  # bytes per object


class FlakyStore(MemoryStore):
    """A memory store whose puts fail for one rank's objects (a rank that fails to write)."""

    def __init__(self, failing_rank: int | None) -> None:
        super().__init__()
        self.failing_rank = failing_rank
        self.touched: list[str] = []  # every key a call marked as used, in the order given

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        marks = touch if touch is not None else [True] * len(keys)
        self.touched += [k for k, t in zip(keys, marks, strict=True) if t]
        return super().touch_many(keys, touch)

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        ok = super().put_many([it for it in items if not self._fails(it[0])])
        it = iter(ok)
        return [False if self._fails(k) else next(it) for k, _ in items]

    def _fails(self, key: str) -> bool:
        parts = key.split("/")
        return self.failing_rank is not None and parts[2] in "bs" and parts[4] == str(self.failing_rank)


def truth(kind: str, group: int, rank: int, tokens: Sequence[int], end: int) -> bytes:
    """What a cold engine holds: a function of every token before ``end``."""
    h = hashlib.blake2b(f"{kind}:{group}:{rank}:{end}:".encode(), digest_size=PAYLOAD)
    h.update(bytes(str(list(tokens[:end])), "ascii"))
    return h.digest()


@st.composite
def layouts(draw: st.DrawFn) -> CacheLayout:
    world = draw(st.integers(1, 2))
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(GroupKind)))
        window = draw(st.integers(1, 3 * BS)) if kind is GroupKind.SLIDING_WINDOW else None
        groups.append(CacheGroup.uniform(kind, [TensorSpec((PAYLOAD,), "uint8")], world, window=window))
    return CacheLayout(model="prop", block_size=BS, groups=tuple(groups), tp_size=world)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), layout=layouts())
def test_lookup_returns_exactly_the_longest_resumable_boundary(
    data: st.DataObject, layout: CacheLayout
) -> None:
    n_blocks = data.draw(st.integers(1, 12))
    vocab = st.integers(0, 3)
    prompt = data.draw(st.lists(vocab, min_size=n_blocks * BS, max_size=n_blocks * BS + BS - 1))
    shared = data.draw(st.integers(0, len(prompt)))
    consumer = prompt[:shared] + data.draw(st.lists(vocab, min_size=1, max_size=3 * BS))
    failing_rank = data.draw(st.one_of(st.none(), st.integers(0, layout.world_size - 1)))
    store = FlakyStore(failing_rank)
    vault = Vault(store, layout, "prop")
    hashes = vault.hashes(prompt)

    # The producer engine: block tables with nulls, memory per (group, block id).
    memory: dict[tuple[int, int, int], bytes] = {}  # (group, rank, block id) -> bytes
    tables: dict[int, list[int]] = {}
    captures: list[StateCapture] = []
    next_id = 1
    for gi, g in enumerate(layout.groups):
        if g.is_state:
            continue
        table = []
        for i in range(n_blocks):
            bid = NULL_BLOCK_ID if data.draw(st.integers(0, 5)) == 0 else next_id
            next_id += 1
            table.append(bid)
            for r in range(layout.world_size):
                memory[(gi, r, bid)] = truth("kv", gi, r, prompt, (i + 1) * BS) if bid else bytes(PAYLOAD)
        tables[gi] = table
    # The prompt runs in chunks; step k computes chunk k and reports its captures in step k.
    chunk = data.draw(st.sampled_from([BS, 2 * BS, 3 * BS, n_blocks * BS]))

    def step_of(b: int) -> int:
        return (b - 1) // chunk + 1

    for gi, g in enumerate(layout.groups):
        if not g.is_state:
            continue
        for b in range(BS, n_blocks * BS + 1, BS):
            what = data.draw(st.sampled_from(["exact", "exact", "none", "null", "stale"]))
            if what == "none":
                continue
            bid = NULL_BLOCK_ID if what == "null" else next_id
            next_id += 1
            captures.append(StateCapture(gi, b, bid, step=step_of(b) - 1 if what == "stale" else step_of(b)))
            for r in range(layout.world_size):
                memory[(gi, r, bid)] = truth("state", gi, r, prompt, b) if bid else bytes(PAYLOAD)

    def read(rank: int) -> object:
        def _read(ref: ObjectRef, block_id: int) -> bytes:
            assert block_id != NULL_BLOCK_ID, "the null block must never be read"
            return memory[(ref.group, rank, block_id)]

        return _read

    # The production path: plans list the blocks after the last boundary handed to the store,
    # and every rank saves and then publishes on its own, as the connector's workers do.
    published: set[int] = set()
    parent = 0
    for start in range(0, n_blocks * BS, chunk):
        end = min(start + chunk, n_blocks * BS)
        step = step_of(end)
        decision = plan_saves(layout, end, tables, [c for c in captures if start < c.tokens <= end],
                              step=step, candidates=range(max(start, parent) + BS, end + 1, BS), since=parent)
        for r in range(layout.world_size):
            acks = vault.save(r, hashes, decision.publishable, read(r))  # type: ignore[arg-type]
            for b, why in vault.publish(hashes, acks, parent).items():
                if why is None:
                    published.add(b)
        if decision.publishable:
            parent = max(p.tokens for p in decision.publishable)
    if failing_rank is not None:
        assert not published, "a boundary was published although a rank failed to write"

    # Random evictions of objects (not records) after publishing.
    object_keys = sorted(k for k, _ in store.scan() if k.split("/")[2] in "bs")
    evicted = data.draw(st.lists(st.sampled_from(object_keys), unique=True) if object_keys else st.just([]))
    store.delete_many(evicted)

    # Independent oracle: which boundaries can the consumer truly resume from?
    common = next(
        (i for i, (a, b) in enumerate(zip(prompt, consumer, strict=False)) if a != b),
        min(len(prompt), len(consumer)),
    )

    def resumable(b: int) -> bool:
        if b > common or b not in published:
            return False
        return all(not store._fails(r.key) and r.key not in evicted for r in vault.needed(hashes, b))

    def rule_allows(b: int) -> bool:
        for gi, g in enumerate(layout.groups):
            if g.is_state:
                caps = [c for c in captures if c.group == gi and c.tokens == b]
                if not caps or caps[-1].block_id == NULL_BLOCK_ID or caps[-1].step != step_of(b):
                    return False
            else:
                first = 0 if g.kind is GroupKind.FULL_ATTENTION else max(0, b - (g.window or 0)) // BS
                if any(tables[gi][i] == NULL_BLOCK_ID for i in range(first, b // BS)):
                    return False
        return True

    assert set(published) <= {b for b in range(BS, n_blocks * BS + 1, BS) if rule_allows(b)}
    if failing_rank is None:
        assert set(published) == {b for b in range(BS, n_blocks * BS + 1, BS) if rule_allows(b)}
    limit = max_resume_tokens(len(consumer), BS)
    expected = max([b for b in range(BS, limit + 1, BS) if resumable(b)] or [0])

    c_hashes = vault.hashes(consumer)
    store.touched.clear()
    hit = vault.lookup(c_hashes, len(consumer))
    assert hit == expected
    assert hit < len(consumer)
    # Checking every candidate's objects beside the records (one round trip, as on a network
    # store) answers, explains and touches exactly as the two round trips do.
    touched = list(store.touched)
    for min_tokens in (0, data.draw(st.integers(0, limit))):
        answers = []
        for remote in (True, False):
            with patch.object(store, "remote", remote):
                store.touched.clear()
                found = vault.lookup_explained(c_hashes, len(consumer), min_tokens)
                answers.append((found, store.touched[:]))
        assert answers[0] == answers[1]
        if min_tokens == 0:
            assert answers[0][0].hit == hit and answers[0][1] == touched
    if hit:
        loaded = vault.load(vault.needed(c_hashes, hit))
        assert loaded.ok
        for ref, payload in loaded.payloads.items():
            kind = "state" if ref.kind is ObjectKind.STATE else "kv"
            assert bytes(payload) == truth(kind, ref.group, ref.rank, consumer, ref.tokens)


@given(st.integers(0, 200), st.sampled_from([1, 4, 16]))
def test_a_hit_always_leaves_a_token_to_compute(prompt: int, bs: int) -> None:
    limit = max_resume_tokens(prompt, bs)
    assert limit % bs == 0 and (limit < prompt or prompt == 0)
    assert prompt == 0 or limit + bs >= prompt  # and it is the longest such
    assert choose_hit(range(0, 400, bs), prompt, bs, lambda b: True) == limit


def test_refusal_reasons() -> None:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((1,), "uint8")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((1,), "uint8")])
    layout = CacheLayout(model="m", block_size=4, groups=(attn, state))
    caps = [StateCapture(1, 4, 7, 1), StateCapture(1, 8, NULL_BLOCK_ID, 1), StateCapture(1, 12, 9, 0)]
    d = plan_saves(layout, 14, {0: [1, 2, 3, NULL_BLOCK_ID]}, caps, step=1, candidates=[3, 4, 8, 12, 16, 20])
    assert [p.tokens for p in d.publishable] == [4]
    assert dict(d.refused) == {
        3: Refusal.NOT_CAPTURED,  # (with state, a boundary inside a block is a tail: it needs a state too)
        8: Refusal.NULL_BLOCK,
        12: Refusal.STALE,
        16: Refusal.NOT_COMPUTED,
        20: Refusal.NOT_COMPUTED,
    }
    d = plan_saves(
        layout, 16, {0: [1, 2, 3, NULL_BLOCK_ID]}, [StateCapture(1, 16, 5, 1)], step=1, candidates=[16]
    )
    assert dict(d.refused) == {16: Refusal.NULL_BLOCK}
    d = plan_saves(layout, 8, {0: [1, 2]}, [], candidates=[8])
    assert dict(d.refused) == {8: Refusal.NOT_CAPTURED}
    attention_only = CacheLayout(model="m", block_size=4, groups=(attn,))
    d = plan_saves(attention_only, 8, {0: [1, 2]}, [], candidates=[3, 4])
    assert dict(d.refused) == {3: Refusal.NOT_ALIGNED} and [p.tokens for p in d.publishable] == [4]
    # Fail closed: a capture, or a save, whose step is unknown is not evidence.
    d = plan_saves(layout, 8, {0: [1, 2]}, [StateCapture(1, 8, 5, None)], step=1, candidates=[8])
    assert dict(d.refused) == {8: Refusal.STALE}
    d = plan_saves(layout, 8, {0: [1, 2]}, [StateCapture(1, 8, 5, 1)], candidates=[8])
    assert dict(d.refused) == {8: Refusal.STALE}
