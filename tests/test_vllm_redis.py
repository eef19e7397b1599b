"""The seed scenario over a real Valkey server: producer and consumer engines in separate
processes share the cache through Redis instead of the local directory. Then faults on the
wire: a stall mid-lookup and the server gone mid-get and mid-put."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support.seedlib import Seed, SeedRuns, check, run, run_with_metrics, spec

from prefixvault.scenarios.engine import Completion, identical
from prefixvault.scenarios.valkey import Valkey

pytestmark = pytest.mark.slow


def test_seed_scenario_over_redis(tmp_path: Path, seed_runs: SeedRuns) -> None:
    """Over a network store a CPU engine's lookups read their hits ahead, beside the steps, and
    hand them to the worker: every load synchronous, none read from the store by the worker."""
    server = Valkey()
    seed = seed_runs.seed("gdn-hybrid")
    seed.cases = seed.cases[:2]
    salts = [f"redis-{c.name}" for c in seed.cases]
    store = server.url(prefix="pv-seed:")
    cold = seed_runs.cold(seed, [c.tokens for c in seed.cases])
    run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store), tmp_path)
    consumer = spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store)
    got, metrics = run_with_metrics(seed, consumer, tmp_path)
    check(seed, cold, got)
    loads = metrics.get("loads", 0)
    assert loads >= 1 and metrics.get("loads_in_step", 0) == loads, metrics
    assert metrics.get("loads_in_step_read", 0) == 0, metrics


#: Faults on the wire between an engine and a real Valkey server, each at an exact point of
#: the protocol: (engine role, the command that trips it, stall or drop).
WIRE_FAULTS = {
    "lookup-stalls": ("kv_consumer", b"$5\r\nTOUCH\r\n", "stall"),  # a lookup touches what it finds
    "server-gone-mid-get": ("kv_consumer", b"$3\r\nGET\r\n", "drop"),
    "server-gone-mid-put": ("kv_producer", b"$3\r\nSET\r\n", "drop"),
}


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory, seed_runs: SeedRuns
         ) -> Iterator[tuple[Seed, Valkey, list[Completion], Path]]:
    """One server, the seed's crossing case run cold, and a producer that filled the server."""
    tmp = tmp_path_factory.mktemp("wire")
    server = Valkey()
    try:
        seed = seed_runs.seed("gdn-hybrid")
        case = seed.cases[1]
        cold = seed_runs.cold(seed, [case.tokens])
        run(seed, spec(seed, "kv_producer", [seed.producer], [""], server.url(prefix="pv-wire:")), tmp)
        yield seed, server, cold, tmp
    finally:
        server.stop()


@pytest.mark.parametrize("fault", sorted(WIRE_FAULTS))
def test_wire_fault_costs_hits_not_correctness(
    fault: str, wire: tuple[Seed, Valkey, list[Completion], Path]
) -> None:
    """A network stall longer than the timeout, or a server gone mid-call: every request
    completes, the consumer equals cold, no engine crashes."""
    from prefixvault.scenarios.netfault import FaultyLink

    seed, server, cold, tmp = wire
    role, trigger, kind = WIRE_FAULTS[fault]
    case = seed.cases[1]
    prefix = "pv-wire:" if role == "kv_consumer" else f"pv-{fault}:"
    link = FaultyLink(server.port, trigger, kind)
    faulty = f"redis://127.0.0.1:{link.port}/0?prefix={prefix}&timeout=2"
    try:
        if role == "kv_producer":
            produced = run(seed, spec(seed, "kv_producer", [seed.producer], [""], faulty), tmp / fault)
            assert produced and produced[0].token_ids
            consumer_store = server.url(prefix=prefix)
        else:
            consumer_store = faulty
        got = run(seed, spec(seed, "kv_consumer", [case.tokens], [""], consumer_store), tmp / fault)
        assert link.tripped.is_set(), f"{fault}: the fault never happened"
        assert identical(cold[0], got[0]), f"{fault}: consumer differs from cold"
        if role == "kv_producer":
            assert got[0].cached_tokens == 0  # nothing was published past the failed put
    finally:
        link.close()
