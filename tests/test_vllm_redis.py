"""The seed scenario over a real Valkey server: producer and consumer engines in separate
processes share the cache through Redis instead of the local directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Valkey
from vllm_support.seedlib import check, make_seed, run, spec

pytestmark = pytest.mark.slow


def test_seed_scenario_over_redis(tmp_path: Path) -> None:
    server = Valkey()
    seed = make_seed("gdn-hybrid", tmp_path / "models")
    seed.cases = seed.cases[:2]
    salts = [f"redis-{c.name}" for c in seed.cases]
    store = server.url(prefix="pv-seed:")
    cold = run(seed, spec(seed, "cold", [c.tokens for c in seed.cases], salts), tmp_path)
    run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store), tmp_path)
    got = run(seed, spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store), tmp_path)
    check(seed, cold, got)
