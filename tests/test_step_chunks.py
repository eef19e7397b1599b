"""The chunk-end guard: a state is published only where the step's chunk ended.

vLLM (0.32, align mode) offers a state block as the state at the block's end even when the
chunk that last wrote the block ended mid-block, so the block holds the state at another
token count. These tests drive the scheduler side with scheduler outputs built here, from a
simulated engine that behaves that way, and check every state it plans to save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_support.asking import ask

from prefixvault.admission import SHARING_WINDOW
from prefixvault.boundary import (
    NULL_BLOCK_ID,
    Refusal,
    StateCapture,
    StepChunk,
    plan_saves,
    step_end_captures,
)
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.scheduler import SchedulerSide

BS = 4
LAYOUT = CacheLayout(
    model="chunks", block_size=BS,
    groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")], 1),
            CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")], 1)),
)


def test_a_state_offered_inside_the_chunk_is_refused() -> None:
    tables = {0: [1, 2, 3]}
    inside = plan_saves(LAYOUT, 10, tables, [StateCapture(1, 8, 9, 1)], 1, [8], StepChunk(6, 10))
    assert inside.refused == ((8, Refusal.INSIDE_CHUNK),) and not inside.publishable
    earlier = plan_saves(LAYOUT, 10, tables, [StateCapture(1, 4, 9, 1)], 1, [4], StepChunk(6, 10))
    assert earlier.refused == ((4, Refusal.STALE),)
    at_end = plan_saves(LAYOUT, 8, tables, [StateCapture(1, 8, 9, 1)], 1, [8], StepChunk(6, 8))
    assert [p.tokens for p in at_end.publishable] == [8]


@dataclass
class _Engine:
    """A hybrid engine in align mode whose chunks may end anywhere (as vLLM CPU servers do).

    Each request has a state block table; a chunk [s, e) reads its initial state from index
    (s-1)//BS and leaves the state at e in index (e-1)//BS. Every block boundary b in (s, e]
    whose block is real is offered as "the state at b" — whatever that block holds.
    """

    next_id: int = 1
    holds: dict[int, int] = field(default_factory=dict)  # state block id -> token count of its state

    def new_block(self) -> int:
        self.next_id += 1
        return self.next_id

    def run_chunk(self, table: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
        while len(table) < (end - 1) // BS + 1:
            table.append(NULL_BLOCK_ID)
        last = (end - 1) // BS
        if table[last] == NULL_BLOCK_ID:
            table[last] = self.new_block()
        self.holds[table[last]] = end
        return [(1, table[b // BS - 1], b) for b in range(start // BS * BS + BS, end + 1, BS)
                if table[b // BS - 1] != NULL_BLOCK_ID]


def _side() -> SchedulerSide:
    vault = Vault(MemoryStore(), LAYOUT, "t")
    return SchedulerSide(ConnectorSettings(), LAYOUT, vault, load=False, save=True)


def _output(chunks: dict[str, tuple[int, int]], offers: dict[str, list[tuple[int, int, int]]],
            tables: dict[str, dict[int, list[int]]], new: set[str]) -> Any:
    cached = [r for r in chunks if r not in new]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=chunks[r][0]) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=cached,
                                              num_computed_tokens=[chunks[r][0] for r in cached]),
        num_scheduled_tokens={r: e - s for r, (s, e) in chunks.items()},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers,
                                                 get_block_ids=lambda r: (tables[r][0], tables[r][1])),
    )


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[int, list[int]]]:
    """Per request: prompt length and its chunk ends (anywhere, the last one at the prompt end)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(2, 40))
        ends = sorted(draw(st.sets(st.integers(1, n - 1), max_size=8)) | {n})
        out.append((n, ends))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=schedules(), data=st.data())
def test_every_planned_state_is_the_state_at_its_boundary(plan: list[tuple[int, list[int]]],
                                                          data: st.DataObject) -> None:
    side, engine = _side(), _Engine()
    reqs = {f"r{i}": SimpleNamespace(request_id=f"r{i}", prompt_token_ids=list(range(n)), num_tokens=n,
                                     lora_request=None, cache_salt=None, mm_features=None)
            for i, (n, _) in enumerate(plan)}
    for r in reqs.values():
        ask(side, r, 0)
    pending = {f"r{i}": list(ends) for i, (_, ends) in enumerate(plan)}
    done = dict.fromkeys(pending, 0)
    tables = {r: {0: [], 1: []} for r in pending}
    saw_inside = False
    while any(pending.values()):
        # Several requests per step, in an order the test draws.
        step = [r for r in pending if pending[r] and data.draw(st.booleans())] or \
            [next(r for r in pending if pending[r])]
        chunks, offers = {}, {}
        for r in step:
            start, end = done[r], pending[r].pop(0)
            chunks[r] = (start, end)
            tables[r][0].extend(engine.new_block() for _ in range(len(tables[r][0]), (end - 1) // BS + 1))
            offers[r] = engine.run_chunk(tables[r][1], start, end)
            saw_inside |= any(start < t < end for _, _, t in offers[r])
            done[r] = end
        new = {r for r in step if chunks[r][0] == 0}
        meta = side.build_connector_meta(_output(chunks, offers, tables, new))
        for spec in meta.saves:
            for p in spec.plans:
                for _, block_id in p.states:
                    assert engine.holds.get(block_id) == p.tokens, (spec.req_id, p.tokens, chunks)
    refused = side.counters.refused.get(Refusal.INSIDE_CHUNK.value, 0)
    assert refused > 0 or not saw_inside


# -- SchedulerSide, step by step, on scheduler outputs built here -----------------------------


def _request(rid: str, n: int) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100, 100 + n)), num_tokens=n,
                           lora_request=None, cache_salt=None, mm_features=None)


def _planned(meta: Any) -> dict[str, list[tuple[int, tuple[tuple[int, int], ...]]]]:
    return {s.req_id: [(p.tokens, p.states) for p in s.plans] for s in meta.saves}


def test_step_end_capture_needs_an_end_inside_the_prompt() -> None:
    tables = {1: [7, 8, 9]}
    assert step_end_captures(LAYOUT, StepChunk(0, 8), 10, tables, 3) == [StateCapture(1, 8, 8, 3)]
    assert step_end_captures(LAYOUT, StepChunk(4, 12), 12, tables, 3) == [StateCapture(1, 12, 9, 3)]
    # mid-block: the state is in the block the chunk's last token is in (a tail boundary)
    assert step_end_captures(LAYOUT, StepChunk(0, 6), 10, tables, 3) == [StateCapture(1, 6, 8, 3)]
    assert step_end_captures(LAYOUT, StepChunk(8, 12), 10, tables, 3) == []  # past the prompt
    assert step_end_captures(LAYOUT, StepChunk(8, 16), 20, tables, 3) == [StateCapture(1, 16, 0, 3)]


def test_chunk_ends_and_the_last_chunk_publish_their_states() -> None:
    side = _side()
    req = _request("a", 12)
    ask(side, req, 0)
    tables = {"a": {0: [11, 12], 1: [0, 21]}}
    meta = side.build_connector_meta(_output({"a": (0, 8)}, {}, tables, {"a"}))
    assert _planned(meta) == {"a": [(8, ((1, 21),))]}
    assert meta.saves[0].parent == 0
    tables["a"] = {0: [11, 12, 13], 1: [0, 21, 22]}
    meta = side.build_connector_meta(_output({"a": (8, 12)}, {}, tables, set()))
    # The last chunk ends at the prompt's end: its state is exact (for longer prompts).
    assert _planned(meta) == {"a": [(12, ((1, 22),))]}
    assert meta.saves[0].parent == 8 and meta.saves[0].plans[0].blocks == ((0, 2, 13),)


def test_resumed_after_preemption_never_publishes_a_state_holding_outputs() -> None:
    side = _side()
    req = _request("p", 10)
    ask(side, req, 0)
    # Preempted, then resumed: prompt (10) + 3 output tokens recomputed in one chunk [0, 13).
    tables = {"p": {0: [1, 2, 3, 4], 1: [0, 5, 0, 6]}}
    offers = {"p": [(1, 5, 8), (1, 6, 16)]}  # 8 inside the chunk; 16 past everything
    meta = side.build_connector_meta(_output({"p": (0, 13)}, offers, tables, {"p"}))
    assert meta.saves == []
    assert side.counters.refused == {Refusal.INSIDE_CHUNK.value: 1}
    # Resumed in chunks: [0, 8) ends inside the prompt (exact), [8, 13) runs past it.
    side = _side()
    ask(side, req, 0)
    meta = side.build_connector_meta(_output({"p": (0, 8)}, {}, tables, {"p"}))
    assert _planned(meta) == {"p": [(8, ((1, 5),))]}
    meta = side.build_connector_meta(_output({"p": (8, 13)}, {"p": [(1, 6, 12)]}, tables, set()))
    assert meta.saves == []


def test_several_requests_in_one_step_and_one_finishing() -> None:
    side = _side()
    a, b = _request("a", 9), _request("b", 20)
    for r in (a, b):
        ask(side, r, 0)
    tables = {"a": {0: [1, 2], 1: [0, 3]}, "b": {0: [4, 5, 6], 1: [0, 0, 7]}}
    meta = side.build_connector_meta(_output({"a": (0, 8), "b": (0, 12)}, {}, tables, {"a", "b"}))
    assert _planned(meta) == {"a": [(8, ((1, 3),))], "b": [(12, ((1, 7),))]}
    # "a" computes its last token and finishes in this step; "b" goes on.
    tables["b"] = {0: [4, 5, 6, 8], 1: [0, 0, 7, 9]}
    meta = side.build_connector_meta(_output({"a": (8, 9), "b": (12, 16)}, {}, tables, set()))
    assert _planned(meta) == {"b": [(16, ((1, 9),))]}
    side.request_finished(a)
    meta = side.build_connector_meta(_output({"a": (9, 10), "b": (16, 20)}, {}, tables, set()))
    assert set(_planned(meta)) <= {"b"}  # a finished request is forgotten, never saved again


def test_decode_steps_publish_nothing() -> None:
    side = _side()
    req = _request("d", 8)
    ask(side, req, 0)
    tables = {"d": {0: [1, 2, 3], 1: [0, 4, 5]}}
    side.build_connector_meta(_output({"d": (0, 8)}, {}, tables, {"d"}))
    for t in range(8, 13):
        assert side.build_connector_meta(_output({"d": (t, t + 1)}, {}, tables, set())).saves == []


def test_a_request_asked_again_after_a_load_saves_from_the_first_block() -> None:
    """A load that failed removed its bad object; the request's next saves must write what
    is missing again, not extend the record it was loaded from."""
    store = MemoryStore()
    vault = Vault(store, LAYOUT, "t")
    req = _request("l", 13)
    hashes = vault.hashes(req.prompt_token_ids)
    d = plan_saves(LAYOUT, 8, {0: [1, 2]}, [StateCapture(1, 8, 3, 1)], step=1)
    assert vault.publish(hashes, vault.save(0, hashes, d.publishable, lambda r, b: bytes(8))) == {8: None}
    side = SchedulerSide(ConnectorSettings(), LAYOUT, vault, load=True, save=True)
    assert ask(side, req, 0) == (8, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14], [0, 21, 0, 0]))
    side.update_state_after_alloc(req, blocks, 8)
    store.delete_many([vault.block_ref(0, 0, hashes[0], 0).key])  # found bad at load, removed
    assert ask(side, req, 0) == (0, False)  # asked again: a miss now
    tables = {"l": {0: [11, 12, 13], 1: [0, 0, 22]}}
    meta = side.build_connector_meta(_output({"l": (0, 12)}, {}, tables, {"l"}))
    (spec,) = meta.saves
    assert spec.parent == 0 and [b[1] for b in spec.plans[0].blocks] == [0, 1, 2]


def _planned_by(policy: str, junction: int, load: bool = True) -> list[int]:
    """Boundaries one request plans under ``policy``: an 18-token prompt computed one block
    per step; the engine offers its junction (8) and its prompt checkpoint (16)."""
    side = SchedulerSide(ConnectorSettings.from_extra({"capture": policy}), LAYOUT,
                         Vault(MemoryStore(), LAYOUT, "t"), load=load, save=True)
    req = _request("a", 18)
    req.shared_prefix_boundary = junction
    ask(side, req, 0)
    tables = {"a": {0: [11, 12, 13, 14, 15], 1: [21, 22, 23, 24, 25]}}
    planned: list[int] = []
    offers = {8: [(1, 22, 8)] if junction == 8 else [], 16: [(1, 24, 16)]}
    for start in range(0, 18, BS):
        end = min(start + BS, 18)
        meta = side.build_connector_meta(
            _output({"a": (start, end)}, {"a": offers.get(end, [])}, tables, {"a"} if start == 0 else set()))
        planned += [p.tokens for spec in meta.saves for p in spec.plans]
    return planned


def test_the_capture_policy_picks_among_the_engine_reports() -> None:
    """``steps`` keeps every step end (the prompt's exact end, 18, a tail boundary, too);
    ``checkpoints`` what the engine offers; ``marconi`` and ``reuse`` the junction vLLM found and
    the sequence end, the prompt's exact end (where a longer prompt resumes), no step end between."""
    assert _planned_by("steps", 8) == [4, 8, 12, 16, 18]
    assert _planned_by("interval:8", 8) == [8, 16]
    assert _planned_by("checkpoints", 8) == [8, 16]
    assert _planned_by("marconi", 8) == [8, 18]
    assert _planned_by("reuse", 8) == [8, 18]
    assert _planned_by("reuse", 0) == [18]
    assert _planned_by("reuse", 0, load=False) == [18]  # a producer cannot learn: as marconi


def test_reuse_stops_storing_prompt_ends_while_nothing_is_shared() -> None:
    side = SchedulerSide(ConnectorSettings.from_extra({"capture": "reuse"}), LAYOUT,
                         Vault(MemoryStore(), LAYOUT, "t"), load=True, save=True)
    tables: dict[str, dict[int, list[int]]] = {}
    saved = []
    for i in range(40):  # distinct prompts, no hit, no junction: nothing is shared
        rid = f"r{i}"
        req = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(1000 * i, 1000 * i + 6)),
                              num_tokens=6, lora_request=None, cache_salt=None, mm_features=None)
        assert ask(side, req, 0) == (0, False)
        tables[rid] = {0: [11, 12], 1: [21, 22]}
        meta = side.build_connector_meta(_output({rid: (0, 6)}, {}, tables, {rid}))  # to its end
        saved.append(bool(meta.saves))
    # Until the window of recent requests is full there is no evidence either way; once it is
    # and none shared a prefix, prompt ends are not stored (a probe only every 64).
    assert saved == [True] * (SHARING_WINDOW - 1) + [False] * (40 - SHARING_WINDOW + 1)


def test_reuse_counts_a_local_prefix_cache_hit_as_sharing() -> None:
    """Traffic served from vLLM's own prefix cache shares prefixes: ``reuse`` keeps storing."""
    side = SchedulerSide(ConnectorSettings.from_extra({"capture": "reuse"}), LAYOUT,
                         Vault(MemoryStore(), LAYOUT, "t"), load=True, save=True)
    tables: dict[str, dict[int, list[int]]] = {}
    saved = []
    for i in range(40):
        rid = f"r{i}"
        req = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(1000 * i, 1000 * i + 10)),
                              num_tokens=10, lora_request=None, cache_salt=None, mm_features=None)
        assert ask(side, req, 4) == (0, False)  # vLLM has the first block locally
        assert ask(side, req, 4) == (0, False)  # asked again: counted once
        tables[rid] = {0: [11, 12, 13], 1: [21, 22, 23]}
        meta = side.build_connector_meta(_output({rid: (4, 10)}, {}, tables, {rid}))  # to its end
        saved.append(bool(meta.saves))
    assert side.admission.sharing() == 1.0
    # Past the window where unshared traffic stops (the test above); it stops later only
    # because none of these sequence ends is ever restored (the tracker's horizon).
    assert all(saved[: side.admission.tracker.horizon])
