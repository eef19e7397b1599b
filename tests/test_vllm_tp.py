"""Tensor parallel (TP=2): one worker process per rank, objects per rank, records after both.

The producer also publishes its answers' last output boundaries (``capture_outputs``, held by
both workers until the requests finish, stored from blocks vLLM keeps until both report them
sent): restorable with both ranks' objects."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support.seedlib import check, make_seed, run, spec

from prefixvault.explain import explain
from prefixvault.inventory import audit
from prefixvault.stores import open_store

pytestmark = pytest.mark.slow

TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_seed_scenario_with_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    seed = make_seed("gdn-hybrid", tmp_path / "models")
    seed.engine["tensor_parallel_size"] = 2
    seed.cases = seed.cases[:2]
    salts = [f"tp-{c.name}" for c in seed.cases]
    store_uri = f"local://{tmp_path}/store?capacity=1GiB"
    cold = run(seed, spec(seed, "cold", [c.tokens for c in seed.cases], salts), tmp_path, TP_ENV)
    produced = run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store_uri,
                              extra_config={"capture_outputs": True}, max_tokens=300, ignore_eos=True),
                   tmp_path, TP_ENV)
    store = open_store(store_uri)
    bs = seed.block_size
    for salt, out in zip(salts, produced, strict=True):
        computed = [*seed.producer, *out.token_ids[:-1]]  # the last token is never computed
        last = len(computed) // bs * bs
        assert last > len(seed.producer), "the answer crosses no block boundary"
        found = explain(store, computed[: last + 1], cache_salt=salt)
        assert found.restorable == last, (salt, last, found)
    ranks = {k.split("/")[4] for k, _ in store.scan() if "/s/" in k or "/b/" in k}
    assert ranks == {"0", "1"}
    report = audit(store)
    assert report.records > 0 and not report.findings
    got = run(seed, spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store_uri),
              tmp_path, TP_ENV)
    check(seed, cold, got)
