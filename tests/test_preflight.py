"""Start-up warnings: every configuration that cannot hit or cannot save is named, with the fix."""

from __future__ import annotations

from types import SimpleNamespace

from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec
from prefixvault.vllm.config import ConnectorSettings, OutputBoundaries
from prefixvault.vllm.layout import CacheShape
from prefixvault.vllm.preflight import can_cache, holds_outputs, outputs_refused, preflight

HYBRID = CacheShape(has_state=True, block_size=16)
ATTENTION = CacheShape(has_state=False, block_size=16)


def config(prefix: bool = True, mode: str = "align", max_len: int = 4096,
           shutdown: int = 30) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix, mamba_cache_mode=mode),
                           model_config=SimpleNamespace(max_model_len=max_len), shutdown_timeout=shutdown)


def _with(cfg: SimpleNamespace, **fields: object) -> SimpleNamespace:
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def test_a_good_configuration_says_nothing() -> None:
    assert preflight(config(), HYBRID, ConnectorSettings(), "kv_both") == []
    assert preflight(config(prefix=False, mode="none"), ATTENTION, ConnectorSettings(), "kv_both") == []
    # async scheduling silences only output boundaries: said where they are asked for
    asynchronous = _with(config(), scheduler_config=SimpleNamespace(async_scheduling=True))
    assert preflight(asynchronous, HYBRID, ConnectorSettings(), "kv_both") == []
    # ...and output boundaries are published under it too (held, keyed once their tokens are known)
    for boundaries in OutputBoundaries:
        settings = ConnectorSettings(capture_outputs=True, output_boundaries=boundaries)
        assert preflight(asynchronous, HYBRID, settings, "kv_both") == []
        assert holds_outputs(settings, asynchronous)  # (so save_hold_mib is allocated)
    every = ConnectorSettings(capture_outputs=True, output_boundaries=OutputBoundaries.EVERY)
    assert not holds_outputs(every, config()) and not holds_outputs(ConnectorSettings(), asynchronous)


def test_each_bad_configuration_is_one_line_with_its_fix() -> None:
    cases = [
        (config(prefix=False), HYBRID, ConnectorSettings(), "kv_both", "--enable-prefix-caching"),
        (config(mode="all"), HYBRID, ConnectorSettings(), "kv_both", "--mamba-cache-mode align"),
        (config(max_len=2048), HYBRID, ConnectorSettings.from_extra({"capture": "interval:100000"}),
         "kv_both", "use a shorter interval"),
        (config(), HYBRID, ConnectorSettings(), "kv_producer", "never restores"),
        (config(), HYBRID, ConnectorSettings(), "kv_consumer", "never saves"),
        (config(max_len=8), HYBRID, ConnectorSettings(), "kv_both", "nothing ever hits"),
        (config(shutdown=0), HYBRID, ConnectorSettings(), "kv_both", "--shutdown-timeout 45"),
        (config(max_len=100_000), CacheShape(False, 2048),
         ConnectorSettings(), "kv_both", "smaller --block-size"),
        (_with(config(), speculative_config=SimpleNamespace(method="ngram")), HYBRID,
         ConnectorSettings(capture_outputs=True), "kv_both", "only prompt boundaries"),
    ]
    for cfg, lay, settings, role, fix in cases:
        lines = preflight(cfg, lay, settings, role)
        assert len(lines) == 1 and fix in lines[0] and "\n" not in lines[0], (fix, lines)


def test_a_hybrid_without_exact_states_turns_the_connector_off() -> None:
    assert can_cache(config(), HYBRID) and can_cache(config(prefix=False, mode="none"), ATTENTION)
    assert not can_cache(config(prefix=False), HYBRID)
    assert not can_cache(config(mode="none"), HYBRID)


def test_saves_in_the_step_need_no_shutdown_grace() -> None:
    settings = ConnectorSettings.from_extra({"save_staging_mib": 0})
    assert preflight(config(shutdown=0), HYBRID, settings, "kv_both") == []
    assert preflight(config(shutdown=0), HYBRID, ConnectorSettings(), "kv_consumer") == [
        preflight(config(), HYBRID, ConnectorSettings(), "kv_consumer")[0]]


def test_capture_outputs_is_refused_for_shortconv_models() -> None:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((4, 8), "float16")])

    def layout(family: StateFamily) -> CacheLayout:
        state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((16,), "float32")], family=family)
        return CacheLayout(model="m", block_size=4, groups=(attn, state))

    assert outputs_refused(layout(StateFamily.GDN)) is None
    assert outputs_refused(CacheLayout(model="m", block_size=4, groups=(attn,))) is None
    why = outputs_refused(layout(StateFamily.SHORTCONV))
    assert why is not None and "ShortConv" in why and "\n" not in why


def test_output_boundaries_last_is_refused_when_save_hold_mib_cannot_hold_one_boundary() -> None:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((4, 8), "float16")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((16,), "float32")], family=StateFamily.GDN)
    gdn = CacheLayout(model="m", block_size=4, groups=(attn, state))  # 64 bytes of state per boundary
    assert outputs_refused(gdn, hold_bytes=64) is None
    assert outputs_refused(gdn, hold_bytes=None) is None  # no output boundary held (every, synchronous)
    why = outputs_refused(gdn, hold_bytes=0)
    assert why is not None and "save_hold_mib" in why and "\n" not in why
    assert outputs_refused(CacheLayout(model="m", block_size=4, groups=(attn,)), hold_bytes=0) is None
