"""Connector pieces that need vLLM's classes but no engine: settings, metrics, the schedule."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefixvault.scenarios import scenario
from prefixvault.vllm.config import (
    CapturePolicy,
    ConnectorSettings,
    OutputBoundaries,
    hands_over_loads,
    in_step_refused,
    restores_in_step,
)
from prefixvault.vllm.stats import PrefixVaultPromMetrics, PrefixVaultStats, Snapshot


def test_settings_defaults_and_policies() -> None:
    s = ConnectorSettings.from_extra(None)
    assert (s.store, s.namespace, s.capture) == ("local://", "default", CapturePolicy.STEPS)
    s = ConnectorSettings.from_extra({"capture": "interval:1024", "namespace": "team-a"})
    assert (s.capture, s.capture_interval, s.namespace) == (CapturePolicy.INTERVAL, 1024, "team-a")
    assert (s.output_boundaries, s.save_hold_mib) == (OutputBoundaries.LAST, 256)
    s = ConnectorSettings.from_extra({"capture_outputs": True, "output_boundaries": "every",
                                      "save_hold_mib": 0})
    assert (s.capture_outputs, s.output_boundaries, s.save_hold_mib) == (True, OutputBoundaries.EVERY, 0)


def test_steps_wait_for_restores_on_cpu_over_a_local_store_unless_told_otherwise() -> None:
    auto = ConnectorSettings.from_extra({"restore_in_step": "auto"})
    assert restores_in_step(auto, remote=False, device="cpu")
    assert not restores_in_step(auto, remote=True, device="cpu")
    assert not restores_in_step(auto, remote=False, device="cuda")
    on, off = (ConnectorSettings.from_extra({"restore_in_step": v}) for v in (True, "false"))
    assert not restores_in_step(on, remote=True, device="cuda"), "refused: a failed load stops the engine"
    assert restores_in_step(on, remote=True, device="cpu")
    assert in_step_refused(on, "cuda") is not None and in_step_refused(on, "cpu") is None
    assert in_step_refused(auto, "cuda") is None  # (auto never asks for it there)
    assert not restores_in_step(off, remote=False, device="cpu")


def test_loads_are_handed_to_a_cpu_worker_over_any_store_unless_told_otherwise() -> None:
    """Over a network store no step waits for a lookup, but the lookup still reads its hit
    ahead (on its lane) for a synchronous load; not on a GPU, nor with restore_in_step false."""
    auto, on, off = (ConnectorSettings.from_extra({"restore_in_step": v}) for v in ("auto", True, "false"))
    assert hands_over_loads(auto, "cpu") and hands_over_loads(on, "cpu")
    assert not hands_over_loads(off, "cpu")
    assert not hands_over_loads(auto, "cuda") and not hands_over_loads(on, "cuda")


@pytest.mark.parametrize(
    "extra,needle",
    [({"stor": "x"}, "unknown kv_connector_extra_config"), ({"capture": "sometimes"}, "capture must be"),
     ({"capture": "interval"}, "positive capture_interval"), ({"namespace": "a b"}, "invalid namespace"),
     ({"verify_sample": 1.5}, "verify_sample must be"),
     ({"verify_sample": "often"}, "verify_sample must be"),
     ({"output_boundaries": "first"}, "output_boundaries must be last or every"),
     ({"save_hold_mib": -1}, "save_hold_mib must be"),
     ({"restore_in_step": "sometimes"}, "restore_in_step must be")],
)
def test_settings_errors_are_clear(extra: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ConnectorSettings.from_extra(extra)


def test_stats_add_up_across_ranks_and_steps() -> None:
    snap = Snapshot()
    assert snap.delta({"put_keys": 3, "refused:null_block": 1}) == {"put_keys": 3, "refused:null_block": 1}
    assert snap.delta({"put_keys": 5, "refused:null_block": 1}) == {"put_keys": 2}
    a = PrefixVaultStats(data={"put_keys": 2})
    b = PrefixVaultStats(data={"put_keys": 1, "hit_tokens": 512})
    merged = a.aggregate(b)
    assert merged.reduce() == {"hit_tokens": 512, "put_keys": 3}
    assert not merged.is_empty() and PrefixVaultStats().is_empty()
    gauges = PrefixVaultStats()
    gauges.set_gauges({"lookup_us": 900, "step_us": 40000, "not_a_gauge": 1})
    assert gauges.is_empty(), "estimates alone are nothing to report"
    gauges.aggregate(PrefixVaultStats(data={"estimate_lookup_us": 700, "put_keys": 1}))
    assert gauges.reduce() == {"estimate_lookup_us": 700, "estimate_step_us": 40000, "put_keys": 1}  # latest


def test_prometheus_counters_by_reason() -> None:
    registry = CollectorRegistry()

    def counter(*args: object, **kw: object) -> Counter:
        return Counter(*args, registry=registry, **kw)  # type: ignore[arg-type]

    def gauge(*args: object, **kw: object) -> Gauge:
        return Gauge(*args, registry=registry, **kw)  # type: ignore[arg-type]

    class Cfg:
        kv_transfer_config = None

    prom = PrefixVaultPromMetrics(Cfg(), {Counter: counter, Gauge: gauge, Histogram: Histogram},
                                  ["engine"], {0: ["0"]})
    prom.observe({"estimate_lookup_us": 900})
    prom.observe({"estimate_lookup_us": 700, "restore_judgments:load_not_worth_it": 2})
    assert registry.get_sample_value("vllm:prefixvault_estimate_lookup_us", {"engine": "0"}) == 700
    assert registry.get_sample_value("vllm:prefixvault_restore_judgments_total",
                                     {"engine": "0", "judgment": "load_not_worth_it"}) == 2
    prom.observe({"hit_tokens": 768, "refused:null_block": 2, "refused:not_captured": 1})
    assert registry.get_sample_value("vllm:prefixvault_hit_tokens_total", {"engine": "0"}) == 768
    assert registry.get_sample_value("vllm:prefixvault_refused_total",
                                     {"engine": "0", "reason": "null_block"}) == 2
    prom.observe({"lane_failed:load:timeout": 3, "lane_jobs:save": 5, "load_failures:missing": 1,
                  "lane_failed:load": 9, "unknown_name": 4})  # a key of the wrong shape is not exported
    assert registry.get_sample_value("vllm:prefixvault_lane_failed_total",
                                     {"engine": "0", "lane": "load", "reason": "timeout"}) == 3
    assert registry.get_sample_value("vllm:prefixvault_lane_jobs_total", {"engine": "0", "lane": "save"}) == 5
    assert registry.get_sample_value("vllm:prefixvault_load_failures_total",
                                     {"engine": "0", "reason": "missing"}) == 1


def test_schedule_follows_align_mode() -> None:
    # Two-block steps, split at the prompt checkpoint (last block boundary before the last token).
    assert scenario.schedule(1764, 512, 256) == [512, 1024, 1536, 1764]
    assert scenario.schedule(1310, 512, 256) == [512, 1024, 1280, 1310]
    assert scenario.captured(1764, 512, 256) == [512, 1024, 1536, 1764]  # the prompt's exact end too
    assert scenario.captured(1764, 512, 256, "marconi") == [1764]
    assert scenario.captured(1764, 512, 256, "checkpoints") == [1536]
    assert scenario.expected_hit([512, 1024, 1536], 1310, 1292, 256) == 1024
    assert scenario.expected_hit([512, 1024, 1536], 1536, 1536, 256) == 1024  # leaves a token
    assert scenario.expected_hit([512, 1024, 1536, 1764], 1900, 1800, 256) == 1764  # a longer prompt


def test_a_budget_smaller_than_a_block_ends_steps_inside_blocks() -> None:
    assert scenario.schedule(1008, 240, 256) == [240, 256, 496, 512, 752, 768, 1008]
    assert scenario.schedule(100, 256, 256) == [100]


def test_the_prefill_estimate_knows_the_engines_step_budget() -> None:
    """``max_num_batched_tokens`` from vLLM's config (``RestoreCosts.step_budget``); None where
    a config has none, rather than a guess."""
    from types import SimpleNamespace

    from vllm.config import SchedulerConfig

    from prefixvault.vllm.compat import step_budget

    real = SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096, is_encoder_decoder=False)
    assert step_budget(SimpleNamespace(scheduler_config=real)) == 512
    assert step_budget(SimpleNamespace()) is None
    assert step_budget(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=None))) is None


def test_no_step_waits_for_lookups_where_the_engine_overlaps_its_steps() -> None:
    """Async scheduling or a GPU: a wait in ``schedule()`` would hold the next step's launch, so
    lookups are never waited for there, not even the yield (asked again in a later step)."""
    from types import SimpleNamespace

    from prefixvault.vllm.compat import steps_overlap
    from prefixvault.vllm.restores import LOOKUP_WAIT_S, StepWait

    def config(async_scheduling: bool) -> SimpleNamespace:
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    assert steps_overlap(config(True), "cpu") and steps_overlap(config(False), "cuda")
    assert not steps_overlap(config(False), "cpu")
    never = StepWait(LOOKUP_WAIT_S, never=True)
    for _ in range(2):
        never.next_step(LOOKUP_WAIT_S)
        assert never.for_new() == 0.0 and never.for_running() == 0.0
    waits = StepWait(LOOKUP_WAIT_S)
    waits.next_step()
    assert waits.for_new() == LOOKUP_WAIT_S and 0 < waits.for_running() <= LOOKUP_WAIT_S
