"""``PrefixVaultConnector``: prefixvault as a vLLM KV connector (scheduler and worker roles).

Enable it with::

    --kv-transfer-config '{"kv_connector":"PrefixVaultConnector",
      "kv_connector_module_path":"prefixvault.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"store":"local:///dev/shm/prefixvault"}}'
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.platforms import current_platform
from vllm.v1.outputs import KVConnectorOutput

from prefixvault.guard import Guard
from prefixvault.stores import open_store_or_retry, redact
from prefixvault.stores.breaker import BreakerStore
from prefixvault.vault import Vault
from prefixvault.vllm.alignment import ChunkAlignment
from prefixvault.vllm.compat import (
    EXPORTING_PLATFORMS,
    cache_hit_source,
    internal_checkpoints,
    relies_on_internal_checkpoints,
    resets_cpu_block_size,
    running_version,
    step_budget,
    steps_overlap,
    unsupported_version,
)
from prefixvault.vllm.config import (
    ConnectorSettings,
    hands_over_loads,
    hot_set_bytes,
    in_step_refused,
    restores_in_step,
    save_device_bytes,
    staging_bytes,
)
from prefixvault.vllm.layout import Unsupported, build_layout, cache_shape
from prefixvault.vllm.mailbox import Mailboxes
from prefixvault.vllm.metadata import PrefixVaultMetadata, SavesSettled
from prefixvault.vllm.preflight import can_cache, holds_outputs, outputs_refused, preflight
from prefixvault.vllm.scheduler import SchedulerSide
from prefixvault.vllm.stats import PrefixVaultPromMetrics, PrefixVaultStats, Snapshot
from prefixvault.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.prefixvault")

#: The vault's figures exported as they are, and its tallies by their metric names.
VAULT_FIGURES = ("put_keys", "put_bytes", "put_failed", "get_keys", "get_bytes", "get_failed", "hot_keys",
                 "hot_bytes", "reread_bytes", "torn_reads", "records_published")
VAULT_TALLIES = {"rejected": "rejected", "misses": "lookup_misses", "refused": "publish_refused"}
#: Each side's figures (and tallies, by their reasons) by their metric names.
SCHEDULER_FIGURES = {"lookups": "lookups", "lookup_errors": "lookup_errors", "hit_tokens": "hit_tokens",
                     "samples": "verify_samples", "sample_errors": "verify_sample_errors",
                     "refused": "refused", "holds_dropped": "holds_dropped", "judged": "restore_judgments",
                     "in_step_lost": "in_step_lost", "busy_ns": "scheduler_us", "steps": "scheduler_steps"}
WORKER_FIGURES = {"save_errors": "save_errors", "loads": "loads", "loaded_tokens": "loaded_tokens",
                  "loads_in_step": "loads_in_step", "loads_in_step_read": "loads_in_step_read",
                  "saved_boundaries": "saved_boundaries", "published": "saves_published",
                  "save_dropped": "save_dropped", "failure_reasons": "load_failures",
                  "busy_ns": "worker_step_us"}

F = TypeVar("F", bound=Callable[..., Any])


def spent_in(side: str) -> Callable[[F], F]:
    """Count a vLLM call's wall time in the connector under ``busy_ns`` of ``side``'s counters
    (``scheduler`` or ``worker``): what the connector adds to the engine's steps, on the
    scheduler's thread (asks answered, saves planned, the workers' reports taken) or the
    engine's (synchronous loads written, saves gathered). Not counted in a forked child (its
    counters' lock may be held by a thread that did not fork)."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def timed(self: PrefixVaultConnector, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(self, *args, **kwargs)
            finally:
                owner = getattr(self, "_scheduler" if side == "scheduler" else "_worker", None)
                if owner is not None and os.getpid() == getattr(self, "_pid", None):
                    owner.counters.add(busy_ns=time.perf_counter_ns() - start)
        return cast(F, timed)
    return wrap


class ForkedConnector(RuntimeError):
    """A connector used in a forked child of the process that made it."""


class PrefixVaultConnector(KVConnectorBase_V1, SupportsHMA):
    """Saves exact KV blocks and recurrent states; restores only boundaries that resume."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        self._snapshot = Snapshot()
        # Every entry point vLLM calls goes through this guard (the scheduler side's own ones
        # included): an error of ours becomes a miss, a skipped save or a recomputed load,
        # never an exception into the engine.
        self.guard = Guard()
        self._off_reported = False  # (worker side) its going off was told to the scheduler
        # Invariant: the sides' threads, queues and locks live in the process that made them.
        # A forked child has none of those threads, and a lock one of them held at the fork is
        # never released there: the child gets ``ForkedConnector`` from every call that reaches
        # a side (before any lock), and its ``shutdown`` is a no-op, never a hang.
        self._pid = os.getpid()
        engine_id = getattr(ktc, "engine_id", None)  # vLLM sets one (a uuid) where none is given
        self._engine_id: str | None = str(engine_id) if engine_id else None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.vault: Vault | None = None
        refused = self._refusal(vllm_config, kv_cache_config, role, ktc.kv_role)
        if refused:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("prefixvault: off for this engine: %s; every request is computed", refused)
            return  # inert: vLLM runs as without a connector
        holds = holds_outputs(self.settings, vllm_config)
        refused = outputs_refused(self.layout, self.settings.save_hold_mib << 20 if holds else None) \
            if self.settings.capture_outputs else None
        if refused:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("prefixvault: %s", refused)
            self.settings = dataclasses.replace(self.settings, capture_outputs=False)
        key = self.settings.namespace_key()
        store = open_store_or_retry(self.settings.store)
        hot = hot_set_bytes(self.settings, store.remote) if role != KVConnectorRole.SCHEDULER else 0
        self.vault = Vault(store, self.layout, self.settings.namespace, key, hot_bytes=hot,
                           tenant_namespaces=self.settings.tenant_namespaces)
        in_step = restores_in_step(self.settings, store.remote, current_platform.device_type)
        if role == KVConnectorRole.SCHEDULER:
            refused_in_step = in_step_refused(self.settings, current_platform.device_type)
            if refused_in_step:
                log.warning("prefixvault: %s", refused_in_step)
            source = cache_hit_source(store.medium)
            if source is not None:  # (what vLLM's own get_external_cache_hit_sources labels hits by)
                self._cache_hit_source = source
            if ktc.kv_load_failure_policy != "recompute" and ktc.is_kv_consumer:
                # A bad or missing object must cost a recompute, never a failed request.
                ktc.kv_load_failure_policy = "recompute"
            device = current_platform.device_type
            # A restore's load is synchronous (its first chunk in the step that restores it)
            # where this engine's one worker runs in this process or in a child of it: the
            # worker serving the engine id's mailbox (``vllm/in_step.py``).
            checkpoints = internal_checkpoints(vllm_config, kv_cache_config, device)
            self._scheduler = SchedulerSide(self.settings, self.layout, self.vault,
                                           load=ktc.is_kv_consumer, save=ktc.is_kv_producer, guard=self.guard,
                                           in_step=in_step, engine_id=self._engine_id,
                                           sync_loads=hands_over_loads(self.settings, device),
                                           checkpoints=checkpoints,
                                           overlapped=steps_overlap(vllm_config, device),
                                           step_budget=step_budget(vllm_config))
            self.alignment = ChunkAlignment(vllm_config.cache_config, self.layout.block_size,
                                            enabled=self.layout.has_state,
                                            rewrite=resets_cpu_block_size(device, running_version()))
            log.info("prefixvault: %s on %s, namespace %s%s, layout %s, block size %d, capture %s, "
                     "restores waited for in the step: %s, loads handed to the worker ahead: %s",
                     ktc.kv_role, redact(self.settings.store), self.settings.namespace,
                     " (keyed: secret from " + (self.settings.namespace_secret_file
                                                or "$" + self.settings.namespace_secret_env) + ")"
                     if key is not None else " (no secret: a label, not a tenant boundary)",
                     self.vault.fingerprint.hex()[:12], self.layout.block_size, self.settings.capture.value,
                     "yes" if in_step else "no",
                     "yes" if self._scheduler.handover.budget is not None else "no")
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            groups = [g.layer_names for g in kv_cache_config.kv_cache_groups]
            hold_outputs = holds_outputs(self.settings, vllm_config)
            self._worker = WorkerSide(self.layout, self.vault, get_tensor_model_parallel_rank(), groups,
                                     staging_bytes=staging_bytes(self.settings, self.layout, vllm_config),
                                     hold_bytes=self.settings.save_hold_mib << 20 if hold_outputs else 0,
                                     drain_timeout=self.settings.save_drain_timeout,
                                     load_timeout=self.settings.load_timeout, load_in_step=in_step,
                                     num_blocks=int(kv_cache_config.num_blocks), guard=self.guard,
                                     save_device_bytes=save_device_bytes(self.layout, vllm_config))

    @property
    def scheduler(self) -> SchedulerSide | None:
        self._check_process()
        return self._scheduler

    @property
    def worker(self) -> WorkerSide | None:
        self._check_process()
        return self._worker

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedConnector(
                f"prefixvault: this connector was made in process {self._pid} and this is process "
                f"{os.getpid()}, a fork of it: its threads are not here; make a connector in this process")

    def _refusal(self, vllm_config: Any, kv_cache_config: Any, role: Any, kv_role: str) -> str | None:
        """Why this engine cannot be served exactly (one line; the connector stays inert), or
        None once the layout is built. Start-up never kills an engine: a cache or version this
        adapter cannot handle is a refusal, not an exception."""
        try:
            why = unsupported_version(running_version())
            if why:
                return why
            shape = cache_shape(kv_cache_config)
            if role == KVConnectorRole.SCHEDULER:
                for problem in preflight(vllm_config, shape, self.settings, kv_role):
                    log.warning("prefixvault: %s", problem)
                groups = relies_on_internal_checkpoints(kv_cache_config)
                if groups and current_platform.device_type in EXPORTING_PLATFORMS:
                    log.warning("prefixvault: state groups %s export their prompt checkpoint from inside "
                                "the last prefill chunk; those boundaries are published as vLLM's own "
                                "rule says (not yet proved on a GPU by prefixvault's own tests)", groups)
            if not can_cache(vllm_config, shape):
                return "the engine keeps no exact state at block boundaries (see above)"
            self.layout = build_layout(vllm_config, kv_cache_config, self.settings.model_id)
        except Unsupported as e:
            return str(e)
        except Exception as e:  # a cache config this adapter did not expect: refused, said once
            log.debug("prefixvault: reading the cache configuration failed", exc_info=e)
            return f"cannot read the engine's cache configuration ({type(e).__name__}: {e})"
        return None

    # -- properties vLLM asks -------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache, not a transfer: preempted work is simply recomputed

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Whether vLLM may offer a hybrid request the full-attention groups' local hit where
        its state groups kept no state (a prefix whose KV this engine holds, read for a deeper
        boundary it restored): a load past it brings the state, and only the KV past it. Else
        such a request reads the shared prefix's KV from the store once more."""
        return self._scheduler is not None and self._scheduler.offers_divergent_hits

    # -- scheduler side ---------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        scheduler = self.scheduler
        if scheduler is not None:  # an error leaves divergent hits unoffered (never watched)
            self.guard.call("bind_kv_cache_manager", lambda: scheduler.bind(kv_cache_manager), lambda: None)

    @spent_in("scheduler")
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False  # off for this engine
        self.guard.call("alignment", self.alignment.check, lambda: None)  # before the first chunk
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)  # never raises

    @spent_in("scheduler")
    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @spent_in("scheduler")
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.scheduler is None:
            return PrefixVaultMetadata()
        self.guard.call("alignment", self.alignment.check, lambda: None)
        return self.scheduler.build_connector_meta(scheduler_output)  # never raises

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    @spent_in("scheduler")
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves are copied out in the step that computes them, so blocks are freed now; except
        # a held output boundary's (output_boundaries: last): its KV blocks are read in the next
        # step, and the workers report the request sent (``get_finished``) once they are.
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request, block_ids), None

    def reset_cache(self) -> bool | None:
        """vLLM resets the engine's prefix cache with the connector's part (0.32-0.34: as after
        an in-place weight update): nothing stored before is restored or saved by this engine
        from now on (``SchedulerSide.reset``)."""
        scheduler = self.scheduler
        if scheduler is None:
            return None  # (no store in use: nothing to reset)
        return bool(self.guard.call("reset_cache", scheduler.reset, lambda: False))

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        worker = self.worker
        if worker is None:
            return

        def inert() -> None:  # never a dead engine: its loads fail (recomputed), nothing is saved
            worker.disable("its cache tensors could not be registered")
            log.warning("prefixvault: off for this worker (rank %d): its cache tensors do not match the "
                        "layout (logged above); every request it serves is computed", worker.rank)
        self.guard.call("register_kv_caches", lambda: worker.register_kv_caches(kv_caches), inert)
        if (worker.disabled is None and self.layout.world_size == 1 and worker.mailbox is None
                and self._engine_id is not None):
            # synchronous loads: the scheduler of this process, or of the parent process (vLLM's
            # multiprocessing executor), may hand this worker their bytes
            backend = getattr(self._vllm_config.parallel_config, "distributed_executor_backend", None)
            worker.mailbox = Mailboxes.serve(self._engine_id, backend)

    def _withdraw_mailbox(self) -> None:
        """The worker takes no more synchronous loads (``vllm/mailbox.py``)."""
        worker = self._worker
        if worker is not None and worker.mailbox is not None:
            worker.mailbox.withdraw()
            worker.mailbox = None

    def unregister_kv_caches(self) -> None:
        """vLLM (0.34) releases the cache tensors (its extensible cache): the worker stops
        touching them for good; every request is computed from then on."""
        worker = self.worker
        if worker is not None:
            self._withdraw_mailbox()
            worker.disable("the engine released its cache tensors")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM (0.33+) asks before it enables sleep mode: a load thread may still write into the
        cache that sleep releases, so sleep mode stays refused with this connector."""
        return False

    @spent_in("worker")
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        worker = self.worker
        assert isinstance(meta, PrefixVaultMetadata)
        if meta.loads and worker is not None:
            self.guard.call("start_load_kv", lambda: worker.load(meta.loads, meta.step),
                            lambda: worker.fail_loads([spec for spec in meta.loads if not spec.in_step]))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    @spent_in("worker")
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of synchronous loads that could not be written (``vllm/mailbox.py``)."""
        worker = self.worker
        return worker.take_unloaded() if worker is not None else set()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    @spent_in("worker")
    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        worker = self.worker
        assert isinstance(meta, PrefixVaultMetadata)
        if (meta.saves or meta.releases) and worker is not None:
            self.guard.call("wait_for_save", lambda: worker.step(meta.saves, meta.releases, meta.step),
                            lambda: worker.fail_releases(meta.releases, meta.step))

    @spent_in("worker")
    def build_connector_worker_meta(self) -> SavesSettled | None:
        worker = self.worker
        if worker is None:
            return None
        settled: list[tuple[str, bool]] = self.guard.call("build_connector_worker_meta", worker.take_settled,
                                                          lambda: [])
        off = worker.disabled is not None and not self._off_reported
        load_bytes, load_s = self.guard.call("build_connector_worker_meta", worker.take_load_measured,
                                             lambda: (0, 0.0))
        in_step_bytes, in_step_s = self.guard.call("build_connector_worker_meta",
                                                   worker.take_in_step_measured, lambda: (0, 0.0))
        caps: dict[str, int] = self.guard.call("build_connector_worker_meta", worker.take_load_caps, dict)
        if not settled and not off and not load_bytes and not in_step_s and not caps:
            return None
        self._off_reported = self._off_reported or off
        return SavesSettled(Counter(sid for sid, _ in settled), Counter(sid for sid, ok in settled if not ok),
                            off=int(off), load_bytes=load_bytes, load_s=load_s, in_step_bytes=in_step_bytes,
                            in_step_s=in_step_s, caps=caps)

    @spent_in("scheduler")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        scheduler = self.scheduler
        if scheduler is None:
            return
        loaded = connector_output.finished_recving
        if loaded:
            self.guard.call("update_connector_output", lambda: scheduler.loads_done(loaded), lambda: None)
        if isinstance(report, SavesSettled):
            self.guard.call("update_connector_output", lambda: scheduler.settle(report), lambda: None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    @spent_in("worker")
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        worker = self.worker
        meta = getattr(self, "_connector_metadata", None)  # bound for the step (vLLM base class)
        idle = isinstance(meta, PrefixVaultMetadata) and meta.idle
        done, failed = self.guard.call("get_finished", lambda: worker.take_finished(idle),
                                       lambda: (set(), set()))
        sent: set[str] = self.guard.call("get_finished", worker.take_sent, set)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    # -- metrics ----------------------------------------------------------------------------------

    def _totals(self) -> dict[str, int]:
        """Every figure of this side, by its metric name (``vllm/stats.py``)."""
        if self.vault is None:
            return {}
        totals: dict[str, int] = {}
        for name, value in self.vault.counters.snapshot().items():
            kind, _, reason = name.partition(":")
            if kind in VAULT_FIGURES:
                totals[name] = value
            elif reason and kind in VAULT_TALLIES:
                totals[f"{VAULT_TALLIES[kind]}:{reason}"] = value
        totals["internal_errors"] = self.guard.total
        if isinstance(self.vault.store, BreakerStore):
            totals["breaker_opened"] = self.vault.store.breaker.opened
            totals["breaker_refused"] = self.vault.store.breaker.refused
        sides = ((self.scheduler, SCHEDULER_FIGURES), (self.worker, WORKER_FIGURES))
        for side, names in sides:
            for name, value in side.counters.snapshot().items() if side is not None else ():
                kind, _, reason = name.partition(":")
                if kind in names:  # (a figure counted in nanoseconds is exported in microseconds)
                    totals[names[kind] + (f":{reason}" if reason else "")] = \
                        value // 1000 if kind.endswith("_ns") else value
        lanes = [*(self.scheduler.lanes if self.scheduler is not None else []),
                 *(self.worker.lanes if self.worker is not None else [])]
        for lane in lanes:
            for k, v in lane.counters.snapshot().items():
                name, _, reason = k.partition(":")
                totals[f"lane_{name}:{lane.name}" + (f":{reason}" if reason else "")] = v
        return totals

    def get_kv_connector_stats(self) -> PrefixVaultStats | None:
        stats = PrefixVaultStats()
        stats.add(self._snapshot.delta(self.guard.call("get_kv_connector_stats", self._totals, dict)))
        scheduler = self.scheduler
        if scheduler is not None:  # its cost estimates, as they stand (gauges)
            figures: dict[str, int] = self.guard.call(
                "get_kv_connector_stats", lambda: scheduler.costs.estimates().figures(), dict)
            stats.set_gauges(figures)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixVaultStats | None:
        return PrefixVaultStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PrefixVaultPromMetrics:
        return PrefixVaultPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child: the threads and what they hold are the parent's to close
        drained = self.scheduler.close() if self.scheduler is not None else True
        if self.scheduler is not None:
            Mailboxes.close(self._engine_id)  # its worker's mailbox, where one served it
        if self.worker is not None:
            self._withdraw_mailbox()
            drained = self.worker.close() and drained
        if self.vault is None:
            return
        if drained:
            self.vault.store.close()
        else:  # a call still running keeps its store open (memory it lent, a connection)
            log.warning("prefixvault: a store call was still running at shutdown: the store is left "
                        "open for it and goes with the process")
