"""The seed scenario and the fault matrix over a real Mooncake Store (mooncake_master plus a
mooncake_client holding the memory, loopback only), with producer and consumer vLLM engines
in separate processes.

Faults: the holder killed or stalled while a consumer loads, the holder stalled while a
producer saves, the master restarted between producer and consumer, the master down when
an engine starts. Every request completes, output equals cold, and no engine crashes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm_support.freeze import freeze
from vllm_support.seedlib import Seed, SeedRuns, check, run, run_with_metrics, spec

from prefixvault.scenarios.engine import Completion, identical
from prefixvault.scenarios.mooncake import MooncakeCluster
from prefixvault.stores import open_store

pytestmark = pytest.mark.slow

#: Store timeout in the engines (seconds): a stalled server costs at most about this per call.
TIMEOUT = "2"
#: The master keeps a silent client's segment this long, so that a stalled or killed holder
#: is still listed when the consumer loads (the case where a get really meets the fault).
CLIENT_TTL = "--client_ttl=600"


@pytest.fixture(scope="module")
def seed(seed_runs: SeedRuns) -> Seed:
    seed = seed_runs.seed("gdn-hybrid")
    seed.cases = seed.cases[:2]
    return seed


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mooncake")


@pytest.fixture(scope="module")
def cold(seed: Seed, seed_runs: SeedRuns) -> list[Completion]:
    return seed_runs.cold(seed, [c.tokens for c in seed.cases])


@pytest.fixture
def cluster(workdir: Path, request: pytest.FixtureRequest) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(logs=workdir / "logs" / request.node.name, master_flags=[CLIENT_TTL])
    try:
        yield c
    finally:
        c.stop()


def engine(seed: Seed, role: str, prompts: list[list[int]], store: str, workdir: Path
           ) -> tuple[list[Completion], dict[str, float]]:  # fmt: skip
    return run_with_metrics(seed, spec(seed, role, prompts, [""] * len(prompts), store), workdir)


def test_seed_scenario_over_mooncake(seed: Seed, cold: list[Completion], cluster: MooncakeCluster,
                                     workdir: Path) -> None:  # fmt: skip
    """The producer exits before the consumer starts: its objects live on in the holder.

    Each case has a salt of its own, as in the local and Redis seed tests: without one, vLLM's
    own prefix cache gives the second case the first one's 1280-token prefix, computed in a
    256-token chunk where cold computes 512, and that differs from cold in the last bits with
    no connector at all (measured)."""
    store = cluster.uri(timeout=TIMEOUT)
    salts = [f"mooncake-{c.name}" for c in seed.cases]
    run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store), workdir)
    got = run(seed, spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store), workdir)
    check(seed, cold, got)
    with open_store(store) as s:
        assert any("/r/" in k for k, _ in s.scan()), "no boundary record in the store"


def _stop(pid: int) -> None:
    freeze(pid)


def _holder_pid(c: MooncakeCluster) -> int:
    assert c.holder is not None
    return c.holder.pid


def _restart_master(c: MooncakeCluster) -> None:
    c.kill_master()
    c.start_master()
    import time

    deadline = time.monotonic() + 30  # the holder re-mounts its memory on the new master
    while c.capacity() == 0 and time.monotonic() < deadline:
        time.sleep(0.1)


LOAD_FAULTS: dict[str, Callable[[MooncakeCluster], None]] = {
    "holder-killed": lambda c: c.kill_holder(),
    "holder-stalled": lambda c: _stop(_holder_pid(c)),
    "master-restarted": _restart_master,
    "master-down": lambda c: c.kill_master(),
}


@pytest.mark.parametrize("fault", sorted(LOAD_FAULTS))
def test_fault_between_producer_and_consumer(fault: str, seed: Seed, cold: list[Completion],
                                             cluster: MooncakeCluster, workdir: Path) -> None:  # fmt: skip
    store = cluster.uri(timeout=TIMEOUT)
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store), workdir)
    LOAD_FAULTS[fault](cluster)
    case = seed.cases[1]
    got, metrics = engine(seed, "kv_consumer", [case.tokens], store, workdir / fault)
    assert identical(cold[1], got[0]), f"{fault}: consumer differs from cold"
    if fault in ("holder-killed", "holder-stalled"):
        # The master still listed the objects, so the consumer looked them up, tried to read
        # them (the tail index of the prompt's exact end, in the lookup; else the load), failed
        # within the timeout and recomputed.
        failed = sum(v for k, v in metrics.items() if k.startswith("load_failures:"))  # by reason
        assert failed + metrics.get("lookup_errors", 0) >= 1, metrics
    else:
        assert got[0].cached_tokens == 0


def test_holder_stalled_while_the_producer_saves(
    seed: Seed, cold: list[Completion], cluster: MooncakeCluster, workdir: Path
) -> None:
    """Puts time out: the producer completes, publishes nothing it could not store, and a
    consumer afterwards still matches cold. Saves are stored in the step here
    (``save_staging_mib: 0``) so that the failed puts are counted before the engine reports its
    metrics; staged saves meet the same errors on the save thread (tests/test_worker_saves.py)."""
    store = cluster.uri(timeout=TIMEOUT)
    pid = _holder_pid(cluster)
    _stop(pid)
    try:
        produced, metrics = run_with_metrics(
            seed, spec(seed, "kv_producer", [seed.cases[1].tokens], [""], store,
                       extra_config={"save_staging_mib": 0}), workdir / "save-stall")
        assert identical(cold[1], produced[0])
        assert metrics.get("save_errors", 0) >= 1, metrics  # the puts really met the stall
        assert metrics.get("records_published", 0) == 0, metrics
    finally:
        os.kill(pid, signal.SIGCONT)
    got, _ = engine(seed, "kv_consumer", [seed.cases[1].tokens], store, workdir / "save-stall")
    assert identical(cold[1], got[0])
