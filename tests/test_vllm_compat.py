"""The compatibility seam and the page description, on vLLM's own spec classes: what each vLLM
version changes is answered in one place, every spec class is either described as vLLM
describes its page or refused with one line, and a refused engine starts with the connector
inert instead of dying."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_support.asking import ask

from prefixvault.boundary import Refusal, StateCapture, StepChunk, plan_saves
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.serve import serve_command
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm import compat
from prefixvault.vllm.config import AUTO_STAGING_MAX, AUTO_STAGING_MIN, ConnectorSettings, staging_bytes
from prefixvault.vllm.layout import Unsupported, cache_shape, group_shape
from prefixvault.vllm.scheduler import SchedulerSide

BF16 = torch.bfloat16
BASE = FullAttentionSpec(block_size=528, num_kv_heads=2, head_size=256, dtype=BF16)


def test_versions_outside_the_proved_range_are_refused_in_one_line() -> None:
    assert compat.parse_version("0.34.0+cu130") == (0, 34) and compat.parse_version("x") == (0, 0)
    for v in compat.SUPPORTED:
        assert compat.unsupported_version(v) is None
    why = compat.unsupported_version((0, 35))
    assert why is not None and "0.35" in why and "\n" not in why


def test_a_request_that_skips_external_reads_in_each_version() -> None:
    assert compat.skips_external(SimpleNamespace(skip_reading_prefix_cache=True))  # 0.32, 0.33
    assert not compat.skips_external(SimpleNamespace(skip_reading_prefix_cache=False))
    assert compat.skips_external(SimpleNamespace(skip_reading_external_kv=True))  # 0.34
    assert not compat.skips_external(SimpleNamespace())
    assert not compat.skips_external(SimpleNamespace(skip_reading_prefix_cache="yes"))  # only True skips


def test_a_request_that_skips_external_reads_is_never_looked_up() -> None:
    layout = CacheLayout(model="m", block_size=4,
                         groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")]),))
    vault = Vault(MemoryStore(), layout, "t")
    side = SchedulerSide(ConnectorSettings(), layout, vault, load=True, save=False)
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(20)), num_tokens=20, lora_request=None,
                          cache_salt=None, mm_features=None, skip_reading_external_kv=True)
    assert ask(side, req, 0) == (0, False)
    tracked = side.tracked("r")
    assert side.counters.lookups == 0 and tracked is not None and tracked.restore.lookup is None
    assert not tracked.counted


def test_the_mamba_cache_mode_flag_only_where_vllm_has_it() -> None:
    assert compat.needs_mamba_cache_mode_flag((0, 32))
    assert not compat.needs_mamba_cache_mode_flag((0, 33)) and not compat.needs_mamba_cache_mode_flag((0, 34))
    assert compat.prefix_caching_advice((0, 34)) == "--enable-prefix-caching"
    assert "--mamba-cache-mode align" in compat.prefix_caching_advice((0, 32))
    installed = compat.installed_version()
    cmd = serve_command("some/model", "local://")
    assert ("--mamba-cache-mode" in cmd) == (installed is not None and installed < (0, 33))


def test_the_cpu_block_size_reset_is_undone_only_on_vllm_032_cpu() -> None:
    assert compat.resets_cpu_block_size("cpu", (0, 32))
    assert not compat.resets_cpu_block_size("cpu", (0, 33))
    assert not compat.resets_cpu_block_size("cuda", (0, 32))


# -- pages as vLLM describes them ----------------------------------------------------------------


def _page(spec: Any) -> int:
    return sum(t.nbytes for t in group_shape(spec, 1).tensors)


@pytest.mark.parametrize("spec", [
    BASE,
    replace(BASE, dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR),
    # per-token-head scales inline (Triton): a wider content cell than K+V
    replace(BASE, dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD,
            state_content_bytes=2 * 256 + 8),
    # FlashInfer nvfp4: two head slots per KV head, packed content
    replace(BASE, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4, num_head_slots=4,
            state_content_bytes=256 // 2 + 256 // 16),
    FullAttentionSpec(block_size=528, num_kv_heads=2, head_size=192, head_size_v=128, dtype=BF16),
    MLAAttentionSpec(block_size=528, num_kv_heads=1, head_size=576, dtype=BF16),
    SlidingWindowSpec(block_size=64, num_kv_heads=4, head_size=64, dtype=BF16, sliding_window=256),
], ids=["bf16", "fp8", "fp8-per-token-head", "nvfp4", "head-192-128", "mla", "sliding"])
def test_an_attention_object_is_the_page_vllm_describes(spec: Any) -> None:
    assert _page(spec) == spec.real_page_size_bytes == spec.num_heads * spec.num_states \
        * spec.state_content_size_bytes


def test_a_state_object_is_the_state_without_padding() -> None:
    spec = MambaSpec(block_size=544, shapes=((3, 8192), (32, 128, 128)), dtypes=(BF16, BF16),
                     page_size_padded=BASE.page_size_bytes * 2, mamba_type="gdn_attention")
    shape = group_shape(spec, 12)
    assert shape.kind is GroupKind.STATE and len(shape.tensors) == 24
    assert sum(t.nbytes for t in shape.tensors) == 12 * spec.real_page_size_bytes


@pytest.mark.parametrize("spec,needle", [
    (ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16,
                               attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
    (CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16), "CrossAttentionSpec"),
    (replace(BASE, attention_chunk_size=1024), "chunked local"),
    (replace(BASE, non_causal=True), "non-causal"),
])
def test_unproved_spec_classes_are_refused_in_one_line(spec: Any, needle: str) -> None:
    with pytest.raises(Unsupported, match=needle) as err:
        group_shape(spec, 1)
    assert "\n" not in str(err.value)


def test_subclasses_of_full_attention_that_keep_other_tokens_are_refused() -> None:
    import vllm.v1.kv_cache_interface as kvi

    for name in ("RSWASpec", "SinkFullAttentionSpec", "HiddenStateCacheSpec", "CircularBufferSpec"):
        cls = getattr(kvi, name, None)
        if cls is None:
            continue
        spec = object.__new__(cls)  # the refusal is by class, before any field is read
        with pytest.raises(Unsupported, match=name):
            group_shape(spec, 1)


def _config(*groups: tuple[list[str], Any], num_blocks: int = 64) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def test_cache_shape_refuses_an_unsupported_group() -> None:
    mamba = MambaSpec(block_size=528, shapes=((3, 64),), dtypes=(BF16,), mamba_type="gdn_attention")
    assert cache_shape(_config((["a"], BASE), (["s"], mamba))).has_state
    with pytest.raises(Unsupported):
        cache_shape(_config((["a"], replace(BASE, attention_chunk_size=8))))


# -- start-up: refused, never dead ----------------------------------------------------------------


def _vllm_config(**cache: Any) -> Any:
    ktc = SimpleNamespace(kv_connector_extra_config={"store": "memory://compat-startup"}, kv_role="kv_both",
                          kv_load_failure_policy="recompute", is_kv_consumer=True, is_kv_producer=True)
    cache_config = SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align", block_size=16,
                                   cache_dtype="auto", **cache)
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=cache_config,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                           model_config=SimpleNamespace(model="tiny", revision=None, dtype=BF16,
                                                        max_model_len=4096),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
                           shutdown_timeout=30, speculative_config=None)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize("groups,cache,needle", [
    ([(["a"], replace(BASE, attention_chunk_size=8))], {}, "chunked local"),
    ([(["a"], BASE), (["s"], MambaSpec(block_size=528, shapes=((3, 64),), dtypes=(BF16,)))],
     {"use_replayssm": True}, "no exact state"),
])
def test_an_engine_the_adapter_cannot_serve_starts_with_the_connector_inert(
        role: KVConnectorRole, groups: list[tuple[list[str], Any]], cache: dict[str, Any], needle: str,
        caplog: pytest.LogCaptureFixture) -> None:
    from prefixvault.vllm.connector import PrefixVaultConnector

    with caplog.at_level(logging.WARNING, logger="vllm.prefixvault"):
        conn = PrefixVaultConnector(_vllm_config(**cache), role, _config(*groups))
    assert conn.scheduler is None and conn.worker is None and conn.vault is None
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(64)), num_tokens=64)
    assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
    conn.register_kv_caches({})
    if role == KVConnectorRole.SCHEDULER:
        offs = [r.getMessage() for r in caplog.records if "off for this engine" in r.getMessage()]
        assert len(offs) == 1 and needle in offs[0] and "\n" not in offs[0]


def test_a_worker_whose_tensors_do_not_match_is_inert_not_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed.parallel_state as parallel_state

    from prefixvault.vllm.connector import PrefixVaultConnector
    from prefixvault.vllm.metadata import LoadSpec, PrefixVaultMetadata, SaveSpec

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)  # no TP group here
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=BF16)
    conn = PrefixVaultConnector(_vllm_config(), KVConnectorRole.WORKER, _config((["a"], spec)))
    assert conn.worker is not None
    conn.register_kv_caches({"a": torch.zeros(64, 3, 16, 16, dtype=BF16)})  # 3 heads, not 2
    assert conn.guard.errors["register_kv_caches"] == 1
    conn.bind_connector_metadata(PrefixVaultMetadata(step=1, loads=[LoadSpec("r", [], 16, 0, ([1],))],
                                                     saves=[SaveSpec("s", [], [])]))
    conn.start_load_kv(None)
    conn.wait_for_save()
    done = conn.get_transfer_results(set())
    assert done.finished_recving == {"r"} and done.failed_recving == {"r"}  # recomputed, not waited for
    assert conn.build_connector_worker_meta() is not None  # the save is settled: no lookup held for it


@pytest.mark.parametrize("backend,mailbox", [("mp", "SharedMailbox"), ("uni", "MemoryMailbox"),
                                             (None, "MemoryMailbox"), ("ray", None)])
def test_a_worker_takes_synchronous_loads_through_the_mailbox_its_executor_allows(
        monkeypatch: pytest.MonkeyPatch, backend: str | None, mailbox: str | None) -> None:
    """One rank: in the scheduler's process (``uni``, vLLM's default there) a mailbox in memory;
    a child of it (``mp``, vLLM CPU's servers) one in shared memory, gone when the worker
    stops; anywhere else (ray) none: its loads stay asynchronous."""
    import vllm.distributed.parallel_state as parallel_state

    from prefixvault.vllm.connector import PrefixVaultConnector
    from prefixvault.vllm.mailbox import SharedMailbox

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=BF16)
    config = _vllm_config()
    config.kv_transfer_config.engine_id = f"compat-mailbox-{backend}"
    config.parallel_config.distributed_executor_backend = backend
    conn = PrefixVaultConnector(config, KVConnectorRole.WORKER, _config((["a"], spec)))
    assert conn.worker is not None
    conn.register_kv_caches({"a": torch.zeros(64, 2, 16, 16, dtype=BF16)})
    assert not conn.guard.errors.get("register_kv_caches")
    handoff = conn.worker.mailbox
    assert (type(handoff).__name__ if handoff is not None else None) == mailbox
    conn.shutdown()
    assert conn.worker.mailbox is None
    if isinstance(handoff, SharedMailbox):
        assert not handoff.path.exists()


def test_every_figure_the_connector_reports_is_a_metric_it_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: figures were counted and never exported, and one name meant two things. Each
    key the connector reports (both roles, every labelled kind filled) names an exported metric
    with the right number of labels."""
    import vllm.distributed.parallel_state as parallel_state

    from prefixvault.boundary import Refusal
    from prefixvault.lane import Failure
    from prefixvault.vllm.connector import PrefixVaultConnector
    from prefixvault.vllm.stats import COUNTERS, LABELLED

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=BF16)
    keys: set[str] = set()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = PrefixVaultConnector(_vllm_config(), role, _config((["a"], spec)))
        assert conn.vault is not None
        for name in ("rejected", "misses", "refused"):
            conn.vault.counters.tally(name, "x")
        if conn.scheduler is not None:
            conn.scheduler.counters.tally("refused", Refusal.STALE)
            conn.scheduler.counters.tally("holds_dropped", "preempted")
        if conn.worker is not None:
            conn.worker.counters.tally("save_dropped", "staging_full")
            conn.worker.counters.tally("failure_reasons", "missing")
        lanes = conn.scheduler.lanes if conn.scheduler else []
        for lane in [*lanes, *(conn.worker.lanes if conn.worker else [])]:
            lane.counters.add(jobs=1, batches=1)
            lane.counters.tally("failed", Failure.TIMEOUT)
        keys |= set(conn._totals())
        conn.shutdown()
    for key in keys:
        name, *labels = key.split(":")
        plain = name in COUNTERS and not labels
        assert plain or (name in LABELLED and len(labels) == len(LABELLED[name][1])), key
    names = {k.split(":")[0] for k in keys}
    assert {"loads", "loaded_tokens", "saved_boundaries", "saves_published", "publish_refused",
            "holds_dropped", "load_failures", "lane_jobs", "lane_batches", "lane_failed"} <= names


# -- prefill checkpoints exported inside a chunk ---------------------------------------------------


BS = 4
LAYOUT = CacheLayout(
    model="chunks", block_size=BS,
    groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((8,), "uint8")], 1),
            CacheGroup.uniform(GroupKind.STATE, [TensorSpec((8,), "uint8")], 1)),
)


def test_an_offer_inside_the_chunk_is_taken_only_at_the_exported_checkpoint() -> None:
    tables = {0: [1, 2, 3]}
    chunk = StepChunk(0, 10, checkpoint=8)
    at = plan_saves(LAYOUT, 10, tables, [StateCapture(1, 8, 9, 1)], 1, [8], chunk)
    assert [p.tokens for p in at.publishable] == [8] and at.publishable[0].states == ((1, 9),)
    other = plan_saves(LAYOUT, 10, tables, [StateCapture(1, 4, 9, 1)], 1, [4], chunk)
    assert other.refused == ((4, Refusal.INSIDE_CHUNK),)
    stale = plan_saves(LAYOUT, 10, tables, [StateCapture(1, 8, 9, 0)], 1, [8], chunk)  # an older step's
    assert stale.refused == ((8, Refusal.STALE),)
    with pytest.raises(ValueError):
        StepChunk(0, 8, checkpoint=8)


def test_vllms_rule_names_the_checkpoint_of_the_prompts_last_chunk() -> None:
    rule = compat.InternalCheckpoints(hash_block_size=BS, block_size=BS, alignment=1, drop_eagle_block=False)
    assert rule.position(0, 10, 10) == 8  # one chunk: the last block boundary that leaves a token
    assert rule.position(0, 8, 10) is None  # not the chunk that reaches the prompt's end
    assert rule.position(4, 10, 10) == 8
    assert rule.position(6, 10, 10) is None  # starts mid-block: vLLM exports nothing there
    assert rule.position(0, 9, 9) == 8
    coarse = compat.InternalCheckpoints(hash_block_size=BS, block_size=BS, alignment=8,
                                        drop_eagle_block=False)
    assert coarse.position(0, 10, 10) == 8 and coarse.position(4, 10, 10) is None
    # partial hits: vLLM puts the checkpoint on the hash unit (96 of 100): a tail boundary of ours
    fine = compat.InternalCheckpoints(hash_block_size=16, block_size=64, alignment=1, drop_eagle_block=False,
                                      granularity=16)
    assert fine.position(0, 100, 100) == 96
    assert fine.position(0, 130, 130) == 128


def test_a_platform_whose_kernels_do_not_export_gets_no_checkpoint_rule() -> None:
    mamba = MambaSpec(block_size=16, shapes=((3, 64),), dtypes=(BF16,), num_prefill_checkpoint_blocks=1,
                      prefill_checkpoint_alignment=1)
    cfg = _config((["a"], replace(BASE, block_size=16)), (["s"], mamba))
    vcfg = _vllm_config()
    assert compat.internal_checkpoints(vcfg, cfg, "cpu") is None
    assert compat.internal_checkpoints(vcfg, cfg, "cuda") == compat.InternalCheckpoints(16, 16, 1, False, 16)
    assert compat.relies_on_internal_checkpoints(cfg) == [1]
    none = _config((["a"], replace(BASE, block_size=16)),
                   (["s"], replace(mamba, num_prefill_checkpoint_blocks=0)))
    assert compat.internal_checkpoints(vcfg, none, "cuda") is None
    assert not compat.relies_on_internal_checkpoints(none)


def test_the_hash_unit_is_read_from_the_cache_config_the_engine_core_resolved() -> None:
    """In the engine core (vLLM's multiprocessing executors) only the ``KVCacheConfig`` carries
    the hash unit and the hit alignment; ``cache_config`` has them only beside a worker."""
    mamba = MambaSpec(block_size=64, shapes=((3, 64),), dtypes=(BF16,), num_prefill_checkpoint_blocks=1,
                      prefill_checkpoint_alignment=1)
    cfg = _config((["a"], replace(BASE, block_size=64)), (["s"], mamba))
    vcfg = _vllm_config()
    cfg.hash_block_size, cfg.cache_hit_alignment_tokens = 16, 16
    assert compat.hash_unit(vcfg, cfg, 64) == (16, 16)
    assert compat.internal_checkpoints(vcfg, cfg, "cuda") == compat.InternalCheckpoints(16, 64, 1, False, 16)
    cfg.hash_block_size = cfg.cache_hit_alignment_tokens = None
    assert compat.hash_unit(vcfg, cfg, 64) == (64, 64)  # nothing resolved: the block


def test_staging_is_sized_from_the_geometry_unless_set() -> None:
    small = LAYOUT
    assert staging_bytes(ConnectorSettings(), small, _vllm_config()) == AUTO_STAGING_MIN
    for mib in (64, 0):
        settings = ConnectorSettings.from_extra({"save_staging_mib": mib})
        assert staging_bytes(settings, small, _vllm_config()) == mib << 20
    # Qwen3-Next-80B at TP1: 12 attention layers of 2 x 256 bf16 at block 544, 3 GDN groups
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, 544, 1024), "uint8")] * 12)
    gdn = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((3, 8192), "bfloat16"),
                                               TensorSpec((32, 128, 128), "bfloat16")] * 12)
    big = CacheLayout(model="q3n", block_size=544, groups=(attn, gdn, gdn, gdn))
    cfg = _vllm_config()
    cfg.scheduler_config.max_num_batched_tokens = 8192
    step = (8192 // 544 + 1) * attn.nbytes(0) + 2 * 3 * gdn.nbytes(0)
    assert staging_bytes(ConnectorSettings(), big, cfg) == min(2 * step, AUTO_STAGING_MAX) > 256 << 20


def test_page_packing_that_keeps_the_size_still_changes_the_fingerprint() -> None:
    """vLLM 0.34's ``kv_head_major_slots`` (H2ND packing) and a KV quantization mode reorder or
    reinterpret a page's bytes without changing its size: other bytes, other key."""
    import copy

    packed = copy.copy(BASE)
    object.__setattr__(packed, "kv_head_major_slots", True)
    fp8 = replace(BASE, dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    fp8_int = replace(fp8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    shapes = [group_shape(s, 1) for s in (BASE, packed, fp8, fp8_int)]
    assert shapes[0].tensors == shapes[1].tensors and shapes[2].tensors == shapes[3].tensors
    assert len({s.description for s in shapes}) == 4


def test_sleep_mode_is_refused_with_this_connector() -> None:
    from prefixvault.vllm.connector import PrefixVaultConnector

    assert PrefixVaultConnector.supports_sleep_mode(None) is False


# -- fork -------------------------------------------------------------------------------------------


def test_a_forked_child_gets_a_clear_error_from_the_connector_never_a_hang() -> None:
    """Issue 31: a child forked while the connector's threads run (one holding a lock) has none
    of those threads; every call that reaches a side says so at once, and shutdown returns."""
    import os
    import signal
    import threading
    import time

    from prefixvault.vllm.connector import ForkedConnector, PrefixVaultConnector

    conn = PrefixVaultConnector(_vllm_config(), KVConnectorRole.SCHEDULER, _config((["a"], BASE)))
    side = conn.scheduler
    assert side is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a connector thread inside a critical section at the fork
        assert side.restores is not None
        with side.restores.lane._cond, side.counters._lock:  # the lookup lane's lock, the counters'
            held.set()
            release.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(64)), num_tokens=64)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit code
        code = 3
        try:
            conn.get_num_new_matched_tokens(request, 0)
        except ForkedConnector as e:
            code = 0 if "fork" in str(e) else 4
        except BaseException:
            code = 5
        try:
            conn.shutdown()
        except BaseException:
            code = 6
        os._exit(code)
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    release.set()
    assert status is not None and os.waitstatus_to_exitcode(status) == 0
    # The parent is untouched: its lookup runs as usual.
    assert conn.get_num_new_matched_tokens(request, 0) in ((None, False), (0, False))
    conn.shutdown()


def test_the_store_stays_open_while_a_worker_call_is_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: the connector closed the store whatever its worker said; a put still running
    in memory the store lent (Mooncake) would then write into memory given back."""
    import vllm.distributed.parallel_state as parallel_state

    from prefixvault.vllm.connector import PrefixVaultConnector

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    conn = PrefixVaultConnector(_vllm_config(), KVConnectorRole.WORKER, _config((["a"], BASE)))
    assert conn.worker is not None and conn.vault is not None
    closed: list[bool] = []
    monkeypatch.setattr(conn.vault.store, "close", lambda: closed.append(True))
    monkeypatch.setattr(conn.worker, "close", lambda: False)  # a save still in the store's hands
    conn.shutdown()
    assert closed == []
    monkeypatch.setattr(conn.worker, "close", lambda: True)
    conn.shutdown()
    assert closed == [True]
