"""Boundaries over generated tokens (``capture_outputs``): which decode steps publish, and
under which key. Real scheduler side and vault on a memory store; vLLM's scheduler output and
request are stand-ins with the fields the connector reads (the engine test is
tests/test_vllm_conversation.py)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from vllm_support.asking import ask

from prefixvault.admission import Kind
from prefixvault.keys import chain_hashes
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.config import CapturePolicy, ConnectorSettings, OutputBoundaries
from prefixvault.vllm.metadata import SavesSettled
from prefixvault.vllm.scheduler import SchedulerSide

BS = 4
LAYOUT = CacheLayout(
    model="outputs", block_size=BS,
    groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")], 1),
            CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")], 1)),
)
PROMPT = list(range(1, 7))  # 6 tokens: the prompt's last block boundary is 4, its exact end 6


def side(capture_outputs: bool, boundaries: OutputBoundaries = OutputBoundaries.EVERY,
         capture: CapturePolicy = CapturePolicy.STEPS, interval: int = 0, layout: CacheLayout = LAYOUT
         ) -> tuple[SchedulerSide, Any]:
    vault = Vault(MemoryStore(), layout)
    settings = ConnectorSettings(capture=capture, capture_interval=interval, capture_outputs=capture_outputs,
                                 output_boundaries=boundaries)
    s = SchedulerSide(settings, layout, vault, load=True, save=True)
    req = request()
    ask(s, req, 0)
    return s, req


def request(**fields: Any) -> SimpleNamespace:
    """vLLM's request "r" for ``PROMPT``, running, with the fields the connector reads."""
    return SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, num_tokens=6, cache_salt=None,
                           lora_request=None, mm_features=None, all_token_ids=list(PROMPT),
                           status=SimpleNamespace(name="RUNNING"), **fields)


TABLES = ([11, 12, 13, 14], [20, 21, 22, 23])


def step(s: SchedulerSide, start: int, n: int, drafts: dict[str, list[int]] | None = None,
         releases: list[Any] | None = None) -> list[Any]:
    """One engine step computing tokens [start, start + n) of request "r"; its saves (and, in
    ``releases``, the held saves it tells the workers to store or drop)."""
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r"][:n], num_computed_tokens=[start][:n]),
        num_scheduled_tokens={"r": n} if n else {}, scheduled_spec_decode_tokens=drafts or {},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={},
                                                 get_block_ids=lambda r: TABLES))
    meta = s.build_connector_meta(out)
    if releases is not None:
        releases.extend(meta.releases)
    return list(meta.saves)


def test_decode_steps_publish_only_with_capture_outputs() -> None:
    for enabled in (False, True):
        s, req = side(enabled)
        assert [p.tokens for spec in step(s, 0, 4) for p in spec.plans] == [4]  # the prompt's boundary
        end, = step(s, 4, 2)  # the prompt's exact end: a tail boundary, in a save of its own
        assert [p.tokens for p in end.plans] == [6] and end.tail == 6 and end.parent == 4
        req.all_token_ids += [50, 51]  # two generated tokens; the step computes token 7 (id 51)
        saves = step(s, 7, 1)
        if not enabled:
            assert saves == []
            continue
        (spec,) = saves
        assert [p.tokens for p in spec.plans] == [8]
        assert spec.parent == 4 and [b for _, b in spec.plans[0].states] == [21]
        # keyed by prompt + generated tokens, as the next turn's prompt will be
        assert spec.hashes == chain_hashes([*PROMPT, 50, 51], BS)


def test_no_capture_where_the_state_is_not_certain() -> None:
    s, req = side(True)
    step(s, 0, 4)
    req.all_token_ids += [50, 51]
    assert step(s, 7, 1, drafts={"r": [9]}) == []  # a draft token may be rejected
    assert step(s, 6, 1) == []  # a decode step that does not end on a block boundary
    assert len(step(s, 7, 1)) == 1


def test_a_streaming_input_session_is_neither_looked_up_nor_saved() -> None:
    """vLLM rewrites a streaming-input session's last token when its next input chunk arrives
    (``resumable``, the realtime API): any boundary keyed over it could name other tokens than
    those computed, so the session is not tracked at all."""
    for boundaries in OutputBoundaries:
        s = SchedulerSide(ConnectorSettings(capture_outputs=True, output_boundaries=boundaries),
                          LAYOUT, Vault(MemoryStore(), LAYOUT), load=True, save=True)
        req = request(resumable=True)
        assert ask(s, req, 0) == (0, False) and s.tracked("r") is None
        assert step(s, 0, 4) == [] and step(s, 4, 2) == []
        req.all_token_ids += [50]  # the step computing token 7 is planned before its id is known
        assert step(s, 7, 1) == []
        req.all_token_ids += [51, 52]
        assert step(s, 8, 1) == []
        assert finish(s, req, "FINISHED_STOPPED") == (False, [])


# -- output_boundaries "last": hold each output boundary, store the last one at finish -----------

def finish(s: SchedulerSide, req: Any, status: str, tables: Any = TABLES
           ) -> tuple[bool, list[tuple[str, bool]]]:
    """The request finishes with ``status``: whether vLLM must keep its blocks, and the held
    saves the next step tells the workers to store or drop."""
    req.status = SimpleNamespace(name=status)
    delay = s.request_finished(req, tables)
    releases: list[Any] = []
    step(s, 0, 0, releases=releases)
    return delay, [(r.req_id, r.store) for r in releases]


def decode_to(s: SchedulerSide, req: Any, end: int) -> list[Any]:
    """Generate tokens until ``end`` are computed (one decode step per token); the saves."""
    saves = []
    for computed in range(len(req.all_token_ids) - 1, end):
        req.all_token_ids.append(100 + computed)
        saves += step(s, computed, 1)
    return saves


def test_last_holds_each_output_boundary_and_stores_the_last_at_finish() -> None:
    s, req = side(True, OutputBoundaries.LAST)
    assert [p.tokens for spec in step(s, 0, 4) for p in spec.plans] == [4]  # prompt: saved now
    assert [p.tokens for spec in step(s, 4, 2) for p in spec.plans] == [6]  # its exact end too
    first, = decode_to(s, req, 8)
    assert first.hold and [p.tokens for p in first.plans] == [8] and first.parent == 4
    second, = decode_to(s, req, 12)
    # The next hold replaces it, and still covers the KV blocks since the prompt's boundary:
    # the boundary at 8 is never published.
    assert second.hold and [p.tokens for p in second.plans] == [12] and second.parent == 4
    assert [(g, i) for g, i, _ in second.plans[0].blocks] == [(0, 1), (0, 2)]
    assert [b for _, b in second.plans[0].states] == [22]
    assert s.counters.plans == 2  # held saves count once stored
    decode_to(s, req, 13)

    assert finish(s, req, "FINISHED_STOPPED") == (True, [("r", True)])  # blocks kept until sent
    assert s.counters.plans == 3
    # Lookups of the finished prefix wait for the save, as for any save in flight.
    assert s.saves.in_flight.names_any([second.hashes[2]])


def test_a_hold_stored_at_finish_is_told_to_the_admission_policy_only_for_a_model_with_state() -> None:
    """The admission policy weighs states (``reuse`` watches whether a stored one comes back):
    a held output boundary stored at finish is told to it as a sequence end where the model has
    state groups, and not at all where it has none (as every other save of such a model)."""
    attention_only = CacheLayout(model="outputs-attention", block_size=BS, groups=LAYOUT.groups[:1])
    for layout, told in ((LAYOUT, 1), (attention_only, 0)):
        s, req = side(True, OutputBoundaries.LAST, layout=layout)
        assert s.saves is not None
        seen: list[Kind] = []
        s.saves.admission.admitted = lambda key, kinds, seen=seen: seen.append(kinds)  # type: ignore[method-assign]
        step(s, 0, 4)
        step(s, 4, 2)
        seen.clear()
        held, = decode_to(s, req, 8)
        assert held.hold
        assert finish(s, req, "FINISHED_STOPPED") == (True, [("r", True)])
        assert seen == [Kind.SEQUENCE_END] * told, layout.model


def test_last_drops_the_hold_of_a_failed_preempted_or_moved_request() -> None:
    for how in ("failed", "preempted", "moved", "window"):
        s, req = side(True, OutputBoundaries.LAST)
        step(s, 0, 4)
        step(s, 4, 2)
        held, = decode_to(s, req, 8)
        tables = TABLES
        if how == "preempted":  # vLLM asks for a hit again: it is computed again from the start
            ask(s, req, 0)
        status = "FINISHED_ERROR" if how == "failed" else "FINISHED_LENGTH_CAPPED"
        if how == "moved":  # a block the hold reads is no longer this request's
            tables = ([11, 99, 13, 14], TABLES[1])
        if how == "window":  # a sliding window let it go (vLLM's null block)
            tables = ([11, 0, 13, 14], TABLES[1])
        assert finish(s, req, status, tables) == (False, [("r", False)]), how
        assert not s.saves.in_flight.names_any([held.hashes[1]]), how  # no save of 8 is in flight
        reason = {"failed": "request_failed", "preempted": "preempted"}.get(how, "blocks_moved")
        assert s.counters.holds_dropped.get(reason) == 1, (how, s.counters.holds_dropped)
        assert not s.counters.refused.get(reason), "a held boundary dropped is not a refused boundary"


def test_a_request_without_an_output_boundary_frees_its_blocks_at_once() -> None:
    s, req = side(True, OutputBoundaries.LAST)
    step(s, 0, 4)
    step(s, 4, 2)
    decode_to(s, req, 7)
    assert finish(s, req, "FINISHED_STOPPED") == (False, [])


def test_last_stores_the_hold_of_a_request_stopped_by_a_stop_string() -> None:
    """vLLM ends a request at a stop string by aborting it; the boundary held before is whole."""
    s, req = side(True, OutputBoundaries.LAST)
    step(s, 0, 4)
    step(s, 4, 2)
    decode_to(s, req, 9)
    assert finish(s, req, "FINISHED_ABORTED") == (True, [("r", True)])


def test_marconi_holds_the_prompt_end_until_it_knows_it_is_the_sequence_end() -> None:
    """marconi stores a request's sequence end only: with output boundaries held, the prompt's
    exact end is held, and an output boundary replaces it."""
    for outputs_to in (7, 9):  # no output boundary before finishing; one at 8
        s, req = side(True, OutputBoundaries.LAST, CapturePolicy.MARCONI)
        assert step(s, 0, 4) == []  # the prompt's last block boundary: a step end, not stored
        prompt_end, = step(s, 4, 2)
        assert prompt_end.hold and [p.tokens for p in prompt_end.plans] == [6] and prompt_end.tail == 6
        held = decode_to(s, req, outputs_to)
        if outputs_to > 8:
            assert [p.tokens for spec in held for p in spec.plans] == [8] and held[0].parent == 0
            assert [(g, i) for g, i, _ in held[0].plans[0].blocks] == [(0, 0), (0, 1)]
        else:
            assert held == []
        assert finish(s, req, "FINISHED_STOPPED") == (True, [("r", True)])
        assert s.counters.plans == 1  # one sequence end, nothing else


def test_other_policies_save_the_prompt_end_at_once_with_held_outputs() -> None:
    """Only a boundary admitted for being a sequence end alone is held: steps and interval admit
    the prompt's end as a step end, and save it now; the output hold continues from it."""
    for capture in (CapturePolicy.STEPS, CapturePolicy.INTERVAL):
        s, req = side(True, OutputBoundaries.LAST, capture, interval=4)
        saved, = step(s, 0, 4)
        assert not saved.hold and [p.tokens for p in saved.plans] == [4], capture
        end = step(s, 4, 2)  # steps: the exact end too (a step end); interval:4 crosses none
        expected = [6] if capture is CapturePolicy.STEPS else []
        assert [p.tokens for spec in end for p in spec.plans] == expected
        held, = decode_to(s, req, 9)
        assert held.hold and held.parent == 4, capture


def test_last_holds_an_output_boundary_whose_token_is_not_known_yet_and_names_it_at_finish() -> None:
    """Async scheduling (vLLM's default on GPUs): the token a decode step consumes is still
    being sampled when the step is planned. ``last`` holds the state all the same and names its
    boundary when the request finishes, every token known."""
    s, req = side(True, OutputBoundaries.LAST)
    step(s, 0, 4)
    step(s, 4, 2)
    req.all_token_ids += [50]  # token 7 (id 51) not known yet
    held, = step(s, 7, 1)
    assert held.hold and held.deferred and held.hashes == [] and [p.tokens for p in held.plans] == [8]
    assert [b for _, b in held.plans[0].states] == [21] and held.parent == 4
    req.all_token_ids += [51, 52]
    req.status = SimpleNamespace(name="FINISHED_STOPPED")
    assert s.request_finished(req, TABLES) is True
    releases: list[Any] = []
    step(s, 0, 0, releases=releases)
    (rel,) = releases
    assert rel.store and rel.hashes == chain_hashes([*PROMPT, 50, 51], BS)
    assert s.saves is not None and s.saves.in_flight.names_any([rel.hashes[1]])


# -- output_boundaries "every" under async scheduling: held until the token is known ----------------

def metadata(s: SchedulerSide, start: int, n: int) -> Any:
    """One step's whole metadata (``step``'s, with its step number and releases)."""
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], num_computed_tokens=[start]),
        num_scheduled_tokens={"r": n}, scheduled_spec_decode_tokens={},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={}, get_block_ids=lambda r: TABLES))
    return s.build_connector_meta(out)


def held_at_8() -> tuple[SchedulerSide, Any, Any]:
    """``every``: the prompt saved, then the decode step ending at 8 planned while the token it
    consumes (7, id 51) is still being sampled: its hold."""
    s, req = side(True, OutputBoundaries.EVERY)
    step(s, 0, 4)
    step(s, 4, 2)
    req.all_token_ids += [50]
    held, = step(s, 7, 1)
    return s, req, held


def test_every_holds_a_boundary_whose_token_is_not_known_yet_and_stores_it_once_known() -> None:
    """Under async scheduling ``every`` holds the step's output boundary as ``last`` does, but
    stores it while its request still runs, in the first step planned once its tokens are known:
    keyed as a synchronous engine keys it, never reported sent (the blocks are the running
    request's), and a save that is not published sends the request's next one back to its parent."""
    s, req, held = held_at_8()
    assert held.hold and held.deferred and held.hashes == [] and [p.tokens for p in held.plans] == [8]
    assert held.parent == 4 and [b for _, b in held.plans[0].states] == [21]
    late = metadata(s, 8, 1)  # the next step: token 8 unknown too (two steps in flight)
    assert late.saves == [] and late.releases == []
    req.all_token_ids += [51, 52]
    known = metadata(s, 9, 1)
    (rel,) = known.releases
    assert rel.store and rel.running and rel.hashes == chain_hashes([*PROMPT, 50, 51], BS)
    assert known.saves == [] and s.counters.plans == 3  # the prompt's two and this one
    assert s.saves is not None and s.saves.in_flight.names_any([rel.hashes[1]])
    # Not published (a store error, say): the next output boundary's save starts from 4 again.
    sid = rel.sid(known.step)
    s.settle(SavesSettled(Counter({sid: 1}), Counter({sid: 1})))
    assert not s.saves.in_flight.names_any([rel.hashes[1]])
    req.all_token_ids += [53, 54, 55]
    nxt, = step(s, 11, 1)  # token 12's id known: a synchronous save, from the prompt's boundary
    assert not nxt.hold and [p.tokens for p in nxt.plans] == [12] and nxt.parent == 4
    assert [(g, i) for g, i, _ in nxt.plans[0].blocks] == [(0, 1), (0, 2)]
    # Its hold released, the request holds nothing: vLLM frees its blocks when it finishes.
    assert finish(s, req, "FINISHED_STOPPED") == (False, [])
    # The request finishes before its deferred hold is known: stored at finish, as with ``last``.
    s2, req2, _ = held_at_8()
    req2.all_token_ids += [51]
    assert finish(s2, req2, "FINISHED_LENGTH_CAPPED") == (True, [("r", True)])


def test_every_drops_a_deferred_hold_whose_blocks_moved_or_whose_request_was_preempted() -> None:
    for how in ("window", "preempted"):
        s, req, _ = held_at_8()
        req.all_token_ids += [51]
        if how == "preempted":  # asked again: computed again from the start
            ask(s, req, 0)
            meta = metadata(s, 0, 4)
            assert [(r.req_id, r.store) for r in meta.releases] == [("r", False)]
        else:
            TABLES[0][1] = 0  # a sliding window let block 1 go
            try:
                meta = metadata(s, 8, 1)
            finally:
                TABLES[0][1] = 12
            assert [(r.req_id, r.store) for r in meta.releases] == [("r", False)]
        assert s.counters.holds_dropped == {"preempted" if how == "preempted" else "blocks_moved": 1}, how


def test_a_request_ended_before_its_held_token_was_sampled_drops_the_hold_as_unsampled() -> None:
    """Async scheduling: a request aborted while the token its deferred hold ends on was being
    sampled (vLLM drops that token): nothing names the hold, which is dropped, and counted as
    such, not as an error of ours."""
    for mode in (OutputBoundaries.EVERY, OutputBoundaries.LAST):
        s, req = side(True, mode)
        step(s, 0, 4)
        step(s, 4, 2)
        req.all_token_ids += [50]
        held, = step(s, 7, 1)  # token 7 (id 51) still being sampled
        assert held.deferred
        assert finish(s, req, "FINISHED_ABORTED") == (False, [("r", False)])
        assert s.counters.holds_dropped == {"unsampled": 1}, mode


def test_every_drops_a_deferred_hold_whose_parent_save_was_not_published() -> None:
    """The save a deferred hold extends settles unpublished before the hold is known: the hold
    would name that save's missing record, so it is dropped, and the request's next save
    starts from the parent that was published."""
    s, req = side(True, OutputBoundaries.EVERY)
    step(s, 0, 4)
    step(s, 4, 2)
    req.all_token_ids += [50, 51]
    first = metadata(s, 7, 1)  # token 8's id known: saved at once, from the prompt's boundary 4
    (saved,) = first.saves
    assert not saved.hold and saved.parent == 4 and [p.tokens for p in saved.plans] == [8]
    req.all_token_ids += [52, 53, 54]  # tokens up to 10; token 11 (id 55) still being sampled
    (held,) = step(s, 11, 1)
    assert held.deferred and held.parent == 8
    sid = saved.sid(first.step)
    s.settle(SavesSettled(Counter({sid: 1}), Counter({sid: 1})))  # the save of 8: not published
    req.all_token_ids += [55, 56]
    late = metadata(s, 12, 1)
    assert [(r.req_id, r.store) for r in late.releases] == [("r", False)]
    assert s.counters.holds_dropped == {"parent_unpublished": 1}
    req.all_token_ids += [57, 58, 59]
    (nxt,) = step(s, 15, 1)  # token 16's id known: saved from 4, the last boundary published
    assert nxt.parent == 4 and [p.tokens for p in nxt.plans] == [16]
