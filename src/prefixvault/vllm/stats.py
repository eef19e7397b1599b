"""Connector metrics: vLLM's ``KVConnectorStats`` (logged) and Prometheus counters.

Every figure is a counter delta since the last report, keyed by a flat name, so worker and
scheduler reports simply add up. A labelled figure's key carries its label values after the
name, ``name:value[:value]`` (``refused:null_block``, ``lane_failed:load:timeout``).

Naming rules: one name, one meaning (the vault's own lookup counters are ``lookup_asks`` and
``found_tokens``, never the connector's ``lookups`` and ``hit_tokens``); each labelled metric
takes its reasons from one enum (``Refusal``, ``HoldDrop``, ``SaveDrop``, ``LoadFailure``,
``Miss``, ``Failure``, the codec's rejections).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: Prometheus counter name suffix and help text for each figure (refusals and rejections by label).
COUNTERS: dict[str, str] = {
    "put_keys": "Objects written to the store",
    "put_bytes": "Bytes written to the store",
    "put_failed": "Objects the store failed to write",
    "get_keys": "Objects read from the store and verified",
    "get_bytes": "Bytes read from the store and verified",
    "get_failed": "Objects missing or rejected on load",
    "hot_keys": "Objects a load took from the worker's hot set (load_cache_mib), not the store",
    "hot_bytes": "Bytes a load took from the worker's hot set, not the store",
    "reread_bytes": "Bytes read again from the store for objects this worker read before (hot set too small)",
    "torn_reads": "Objects that failed verification on load and verified when read again (the read raced "
                  "another writer's overwrite of the key): that load missed, the object was kept",
    "records_published": "Boundary records published",
    "lookups": "Requests looked up in the store",
    "lookup_errors": "Lookups that failed (counted as misses)",
    "hit_tokens": "Prompt tokens vLLM was told to load from the store",
    "loads": "Loads run by a worker (each rank counts its own)",
    "loaded_tokens": "Tokens loaded from the store into the engine's blocks (each rank counts its own)",
    "loads_in_step": "Loads written before the forward of the step that restored them, from bytes the "
                     "scheduler read ahead (one rank)",
    "loads_in_step_read": "Of loads_in_step, those whose bytes were not handed over and were read from the "
                          "store in the step (an error of ours, or shared memory full)",
    "saved_boundaries": "Boundaries whose objects a worker stored (each rank counts its own)",
    "saves_published": "Boundaries of a worker's saves published (a new record, or one already there)",
    "save_errors": "Boundaries whose objects could not all be stored",
    "verify_samples": "Restored requests sampled for verification (verify_sample), written in the background",
    "verify_sample_errors": "Verification samples not written (a store error, or too many in flight)",
    "internal_errors": "Errors of prefixvault turned into a miss, a skipped save or a recomputed load",
    "breaker_opened": "Times the store's circuit breaker opened (the store failed repeatedly)",
    "breaker_refused": "Store calls not made because the breaker was open (misses, skipped saves)",
    "scheduler_us": "Microseconds vLLM's scheduler spent in the connector's calls (asks answered, "
                    "saves planned, the workers' reports taken); per step, over scheduler_steps",
    "scheduler_steps": "Steps vLLM's scheduler built with the connector (its build_connector_meta calls)",
    "worker_step_us": "Microseconds the engine's thread spent in the connector's calls in its steps "
                      "(synchronous loads written, saves gathered; the ranks' sum)",
}
#: Labelled counters: help text and label names (after the engine's).
LABELLED: dict[str, tuple[str, tuple[str, ...]]] = {
    "refused": ("Boundaries the boundary rule refused to save, by reason", ("reason",)),
    "publish_refused": ("Boundaries a save could not publish (yet), by reason (missing_rank: another rank "
                        "publishes once its part is stored)", ("reason",)),
    "holds_dropped": ("Held output boundaries dropped unstored, by reason", ("reason",)),
    "rejected": ("Objects rejected on load, by reason", ("reason",)),
    "lookup_misses": ("Lookups that restored less than the longest block-aligned prefix, by reason",
                      ("reason",)),
    "restore_judgments": ("What restore_when judged (lookup_ or load_, then pays, unknown, explore or "
                          "not_worth_it; load_to_junction: a hit cut to the request's junction)",
                          ("judgment",)),
    "in_step_lost": ("Restores that lost their synchronous load and loaded one step later, by reason "
                     "(handover_failed: shared memory full; mailbox_gone: the worker's mailbox disappeared)",
                     ("reason",)),
    "load_failures": ("Loads that failed (their requests recomputed), by reason", ("reason",)),
    "save_dropped": ("Saves not stored, by reason (staging_full, too_large: raise save_staging_mib; "
                     "hold_full, hold_too_large: raise save_hold_mib; queue_full; shutdown)", ("reason",)),
    "lane_jobs": ("Jobs run by a background lane (lookup, sample, save, load)", ("lane",)),
    "lane_batches": ("Batches run by a background lane (one store round trip or more each)", ("lane",)),
    "lane_failed": ("Jobs a background lane failed, by lane and reason", ("lane", "reason")),
}


#: Gauges: the scheduler's restore cost estimates (``prefixvault.costs``), as they stand; each
#: report carries the latest value, never a sum.
GAUGES: dict[str, str] = {
    "estimate_compute_us_per_token": "Measured prefill cost per token of this engine (microseconds)",
    "estimate_step_us": "Measured duration of a busy engine step (microseconds)",
    "estimate_lookup_us": "Measured duration of a lookup in the store (microseconds)",
    "estimate_load_bytes_per_s": "Measured load rate from the store beyond one round trip (bytes per second)",
    "estimate_load_in_step_bytes_per_s": "Measured rate of synchronous loads in their step: verifying, "
                                         "copying, reading any not handed over (bytes per second)",
    "estimate_restore_us": "Measured time from a restored request's lookup to when it could be scheduled "
                           "(its load reported done), less its transfer, loaded beside the steps "
                           "(microseconds)",
    "estimate_restore_in_step_us": "The same for restores loaded in the step that asked (microseconds)",
}


class PrefixVaultStats(KVConnectorStats):
    """Counter deltas: ``{"put_keys": 3, "refused:null_block": 2, ...}``, and the latest value of
    each gauge (``GAUGES``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def add(self, figures: Mapping[str, int]) -> None:
        for k, v in figures.items():
            if k in GAUGES:
                self.data[k] = v
            elif v:
                self.data[k] = self.data.get(k, 0) + v

    def set_gauges(self, estimates: Mapping[str, int]) -> None:
        """The cost estimates (``Estimates.figures`` names), as gauges."""
        self.add({f"estimate_{k}": v for k, v in estimates.items() if f"estimate_{k}" in GAUGES})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.add(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in GAUGES)


class Snapshot:
    """Turns running totals into deltas since the previous call."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def delta(self, totals: Mapping[str, int]) -> dict[str, int]:
        out = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        return {k: v for k, v in out.items() if v}


class PrefixVaultPromMetrics(KVConnectorPromMetrics):
    """``vllm:prefixvault_*_total`` counters, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain = {
            name: self._counter_cls(name=f"vllm:prefixvault_{name}", documentation=doc,
                                    labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        self._labelled = {
            name: (self._counter_cls(name=f"vllm:prefixvault_{name}", documentation=doc,
                                     labelnames=[*labelnames, *labels]), len(labels))
            for name, (doc, labels) in LABELLED.items()
        }
        self._gauges = {
            name: self._gauge_cls(name=f"vllm:prefixvault_{name}", documentation=doc, labelnames=labelnames,
                                  multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            name, *labels = key.split(":")
            if name in self._gauges and not labels:
                self._gauges[name].labels(*values).set(value)
            elif name in self._labelled:
                counter, n = self._labelled[name]
                if len(labels) == n:
                    counter.labels(*values, *labels).inc(value)
            elif name in self._plain and not labels:
                self._plain[name].labels(*values).inc(value)
