"""Whatever a request carries, the scheduler side answers vLLM and never raises into it.

vLLM validates requests for itself, not for us: a cache salt may hold a lone surrogate
(valid JSON), a LoRA request or a multimodal feature may look like anything a plugin makes.
Every entry point must turn an error of ours into a miss, a skipped save, or a load that
fails and is recomputed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_support.asking import ask

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.keys import ExtraKeys, chain_hashes
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.restored import RestoredBlocks
from prefixvault.vllm.scheduler import SchedulerSide

BS = 4
LAYOUT = CacheLayout(
    model="inputs", block_size=BS,
    groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")], 1),
            CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")], 1)),
)
PROMPT = list(range(1, 14))

any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=12)  # surrogates too
anything = st.one_of(st.none(), any_text, st.integers(), st.floats(), st.binary(max_size=8),
                     st.lists(st.integers(), max_size=3), st.builds(object))


@st.composite
def requests(draw: st.DrawFn) -> Any:
    prompt = draw(st.one_of(
        st.just(PROMPT), st.just([*PROMPT[:9], 99, 98]), st.none(),
        st.lists(st.integers(-(2**70), 2**70), max_size=40), st.lists(anything, max_size=5)))
    lora = draw(st.one_of(st.none(), st.builds(SimpleNamespace, lora_name=anything, lora_path=anything)))
    position = st.builds(SimpleNamespace, offset=anything, length=anything)
    features = draw(st.one_of(st.none(), st.lists(st.builds(SimpleNamespace, identifier=anything,
                                                              mm_position=position), max_size=2)))
    return SimpleNamespace(
        request_id=draw(st.one_of(any_text, st.integers())), prompt_token_ids=prompt,
        num_tokens=draw(st.one_of(st.integers(-3, 60), anything)),
        cache_salt=draw(st.one_of(st.none(), any_text, anything)), lora_request=lora, mm_features=features,
        skip_reading_prefix_cache=draw(st.one_of(st.booleans(), anything)),
        sampling_params=SimpleNamespace(temperature=draw(st.one_of(st.just(0.0), anything))),
        output_token_ids=draw(st.one_of(st.lists(st.integers(0, 50), max_size=4), anything)),
    )


def _store_with_prefix() -> Vault:
    vault = Vault(MemoryStore(), LAYOUT, "inputs")
    hashes = vault.hashes(PROMPT)
    d = plan_saves(LAYOUT, 8, {0: [1, 2]}, [StateCapture(1, 8, 3, 1)], step=1)
    vault.publish(hashes, vault.save(0, hashes, d.publishable, lambda r, b: bytes(8)))
    return vault


VAULT = _store_with_prefix()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=requests(), computed=st.integers(0, 20), data=st.data())
def test_no_request_makes_the_scheduler_side_raise(req: Any, computed: Any, data: st.DataObject) -> None:
    side = SchedulerSide(ConnectorSettings(verify_sample=1.0), LAYOUT, VAULT, load=True, save=True)
    n, load = ask(side, req, computed)
    assert isinstance(n, int) and isinstance(load, bool) and n >= 0
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14], [0, 21, 0, 0]))
    side.update_state_after_alloc(req, blocks, n)
    start = data.draw(st.integers(0, 12))
    end = data.draw(st.integers(start + 1, 16))
    rid = req.request_id
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=start)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: end - start},
        kv_connector_block_state=SimpleNamespace(
            boundary_state_offloads=data.draw(st.one_of(st.just({}), st.just({rid: [(1, 21, 8)]}),
                                                        st.just({rid: [("x", None, 8)]}))),
            get_block_ids=lambda r: ([11, 12, 13, 14], [0, 21, 22, 23])),
    )
    meta = side.build_connector_meta(out)
    assert all(spec.req_id == rid for spec in meta.saves)
    # A load vLLM was promised is always handed to the workers (it may fail and be recomputed).
    assert len(meta.loads) == (1 if n else 0)
    side.request_finished(req)


def test_a_lone_surrogate_salt_is_keyed_apart_from_every_other_salt() -> None:
    salts = ["\ud800", "\udfff", "\ud800\udc00", "\U00010000", "?", ""]
    seeds = {ExtraKeys(cache_salt=s).seed() for s in salts}
    assert len(seeds) == len(salts)
    assert chain_hashes(PROMPT, BS, ExtraKeys(cache_salt="\ud800")) != chain_hashes(PROMPT, BS)
    side = SchedulerSide(ConnectorSettings(), LAYOUT, VAULT, load=True, save=True)
    req = SimpleNamespace(request_id="s", prompt_token_ids=PROMPT, num_tokens=13, cache_salt="\ud800",
                          lora_request=None, mm_features=None)
    assert ask(side, req, 0) == (0, False)  # another salt: a miss, no error
    assert side.guard.total == 0


def test_a_failed_alloc_is_loaded_as_a_failure_once_then_computed() -> None:
    """An error of ours in update_state_after_alloc queues a failing load; asked again, the
    request is computed (no loop of lookups and failing loads)."""
    side = SchedulerSide(ConnectorSettings(), LAYOUT, VAULT, load=True, save=True)
    req = SimpleNamespace(request_id="f", prompt_token_ids=PROMPT, num_tokens=13, cache_salt=None,
                          lora_request=None, mm_features=None)
    n, load = ask(side, req, 0)
    assert n == 8 and load
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: 1 / 0), n)  # raises inside
    meta = side.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                     scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                                          num_computed_tokens=[])))
    assert [spec.req_id for spec in meta.loads] == ["f"] and meta.loads[0].hashes == []
    assert ask(side, req, 0) == (0, False)


def test_vllm_is_told_a_load_completes_a_divergent_hit_only_where_it_brings_every_object() -> None:
    """A load past vLLM's full-attention hit brings the state at its boundary and the KV past
    the hit: all a resume needs for full attention and states, not a sliding window's blocks
    before the hit (the engine may have let them go), and nothing for an engine that only saves."""
    assert SchedulerSide(ConnectorSettings(), LAYOUT, VAULT, load=True, save=True).completes_divergent_hits
    saves_only = SchedulerSide(ConnectorSettings(), LAYOUT, VAULT, load=False, save=True)
    assert not saves_only.completes_divergent_hits
    attention = CacheLayout(model="inputs", block_size=BS, groups=LAYOUT.groups[:1])
    assert not SchedulerSide(ConnectorSettings(), attention, Vault(MemoryStore(), attention, "inputs"),
                             load=True, save=True).completes_divergent_hits
    windowed = CacheLayout(model="inputs", block_size=BS, groups=(
        *LAYOUT.groups,
        CacheGroup.uniform(GroupKind.SLIDING_WINDOW, [TensorSpec((8,), "uint8")], 1, window=2 * BS)))
    assert not SchedulerSide(ConnectorSettings(), windowed, Vault(MemoryStore(), windowed, "inputs"),
                             load=True, save=True).completes_divergent_hits


def test_a_block_a_load_wrote_is_forgotten_when_vllms_pool_hands_it_out_again() -> None:
    """vLLM's own block pool: a block loaded, then freed and handed out to be computed into, is
    no longer one a load wrote."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BS)
    restored = RestoredBlocks()
    restored.watch(pool)
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    restored.loaded(0, ids)
    restored.loaded(1, ids[:1])
    assert restored.all_loaded(0, ids) and restored.all_loaded(1, ids[:1]) and not restored.all_loaded(1, ids)
    pool.free_blocks(blocks[:1])
    assert restored.all_loaded(0, ids)  # freed, not written: no hit can name it uncached
    again = pool.get_new_blocks(1)[0]
    assert again.block_id == ids[0]
    assert not restored.all_loaded(0, ids[:1]) and not restored.all_loaded(1, ids[:1])
    assert restored.all_loaded(0, ids[1:]) and len(restored) == 2
    restored.forget([ids[2]])
    assert len(restored) == 1 and restored.all_loaded(0, [ids[1]]) and restored.all_loaded(0, [])
