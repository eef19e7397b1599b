"""The seed scenario on real vLLM engines (CPU), tiny random hybrid models, the local store.

Per profile: a cold engine without connector, a producer engine that fills the store, and a
separate consumer engine, each in its own process. Every consumer request must give the
same token ids and the same top-5 logprobs as cold, bit for bit, and restore exactly the
longest resumable boundary, which the test computes from the producer's schedule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support.seedlib import BATCHED, SeedRuns, check, run, spec

from prefixvault.keys import prefix_hashes
from prefixvault.scenarios import scenario
from prefixvault.scenarios.engine import identical
from prefixvault.stores import open_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.mark.parametrize("profile", list(BATCHED))
def test_seed_scenario_restores_exactly(profile: str, workdir: Path, seed_runs: SeedRuns) -> None:
    seed = seed_runs.seed(profile)
    salts = [f"case-{c.name}" for c in seed.cases]
    store = f"local://{workdir}/{profile}-store?capacity=1GiB"
    cold = seed_runs.cold(seed, [c.tokens for c in seed.cases])
    assert all(c.cached_tokens == 0 for c in cold)
    # The producer runs its own prompt once per case salt (a salt isolates each case).
    run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store), workdir)
    got = run(seed, spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store), workdir)
    check(seed, cold, got)
    assert any(c.expected_hit > 0 for c in seed.cases)


def test_negative_control_publishing_uncaptured_states_diverges(workdir: Path, seed_runs: SeedRuns) -> None:
    """The same scenario with the seed bug's publisher: the consumer restores a null state.
    (The GDN hybrid's negative control opens tests/test_vllm_verify_sample.py.)"""
    seed = seed_runs.seed("shortconv-hybrid")
    case = seed.cases[0]  # crosses a boundary (1280) where the producer kept no state
    store = f"local://{workdir}/{seed.profile}-unsafe?capacity=1GiB"
    cold = seed_runs.cold(seed, [case.tokens])
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store, connector="UnsafeConnector",
                     connector_module="unsafe_connector"), workdir)
    got = run(seed, spec(seed, "kv_consumer", [case.tokens], [""], store), workdir)
    assert got[0].cached_tokens == 1280 > case.expected_hit
    assert not identical(cold[0], got[0]), "a null state restored at 1280 went unnoticed"


def test_step_end_states_equal_the_engines_own_dense_checkpoints(workdir: Path, seed_runs: SeedRuns) -> None:
    """Each state captured at a step end equals, byte for byte, the state vLLM keeps there."""
    seed = seed_runs.seed("gdn-hybrid")
    store = f"local://{workdir}/dense-store?capacity=1GiB"
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store), workdir)
    dense = spec(seed, "kv_producer", [seed.producer], [""], store,
                  extra_config={"namespace": "dense", "capture": "checkpoints"})
    dense.engine["prefix_cache_retention_interval"] = None  # vLLM keeps a state at every step end
    run(seed, dense, workdir)
    s = open_store(store)
    ours = {k.split("/", 2)[2]: k for k, _ in s.scan("default/") if "/s/" in k}
    engine = {k.split("/", 2)[2]: k for k, _ in s.scan("dense/") if "/s/" in k}
    captured = scenario.captured(len(seed.producer), seed.batched, seed.block_size)
    state_groups = {suffix.split("/")[1] for suffix in ours}
    assert len(ours) == len(captured) * len(state_groups)
    # vLLM keeps states at block boundaries only: the prompt's exact end (a tail) is ours alone
    named = prefix_hashes(seed.producer, seed.block_size)
    tail = len(seed.producer) % seed.block_size
    tails = {f"s/{g}/0/{named[-1].hex()}" for g in state_groups} if tail else set()
    assert set(ours) - tails == set(engine)
    ours = {k: v for k, v in ours.items() if k not in tails}
    for suffix, key in ours.items():
        a, b = s.get_many([key, engine[suffix]])
        assert a is not None and b is not None and a[128:] == b[128:], suffix
