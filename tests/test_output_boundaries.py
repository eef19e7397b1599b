"""Boundaries over generated tokens (``capture_outputs``): which decode steps publish, and
under which key. Real scheduler side and vault on a memory store; vLLM's scheduler output and
request are stand-ins with the fields the connector reads (the engine test is
tests/test_vllm_conversation.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_support.asking import ask

from prefixvault.keys import chain_hashes
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.scheduler import SchedulerSide

BS = 4
LAYOUT = CacheLayout(
    model="outputs", block_size=BS,
    groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")], 1),
            CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")], 1)),
)
PROMPT = list(range(1, 7))  # 6 tokens: the prompt's last block boundary is 4


def side(capture_outputs: bool) -> tuple[SchedulerSide, Any]:
    vault = Vault(MemoryStore(), LAYOUT)
    s = SchedulerSide(ConnectorSettings(capture_outputs=capture_outputs), LAYOUT, vault, load=True, save=True)
    req = SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, num_tokens=6, cache_salt=None,
                          lora_request=None, mm_features=None, all_token_ids=list(PROMPT))
    ask(s, req, 0)
    return s, req


def step(s: SchedulerSide, start: int, n: int, drafts: dict[str, list[int]] | None = None) -> list[Any]:
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], num_computed_tokens=[start]),
        num_scheduled_tokens={"r": n}, scheduled_spec_decode_tokens=drafts or {},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={},
                                                 get_block_ids=lambda r: ([11, 12, 13], [20, 21, 22])))
    return list(s.build_connector_meta(out).saves)


def test_decode_steps_publish_only_with_capture_outputs() -> None:
    for enabled in (False, True):
        s, req = side(enabled)
        assert [p.tokens for spec in step(s, 0, 4) for p in spec.plans] == [4]  # the prompt's boundary
        assert step(s, 4, 2) == []
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


def test_no_capture_where_the_tokens_or_the_state_are_not_certain() -> None:
    s, req = side(True)
    step(s, 0, 4)
    req.all_token_ids += [50]  # async scheduling: token 7 is not known when its step is planned
    assert step(s, 7, 1) == []
    req.all_token_ids += [51]
    assert step(s, 7, 1, drafts={"r": [9]}) == []  # a draft token may be rejected
    assert step(s, 6, 1) == []  # a decode step that does not end on a block boundary
    assert len(step(s, 7, 1)) == 1
