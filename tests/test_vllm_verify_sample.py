"""verify_sample and ``prefixvault watch``: a wrong state that got past the rule is caught.

The negative control's producer publishes a state the boundary rule would refuse (the seed
bug); a consumer with ``verify_sample=1`` restores it, diverges from cold, and writes a sample.
``watch`` recomputes the sample on a real cold server and quarantines the record (its KV
segment removed too); the next consumer matches cold exactly, and once a right producer has
written the segment again, restores the shorter, right boundary. A sample from a right
restore agrees with cold and quarantines nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support.seedlib import SeedRuns, run, run_with_metrics, spec

from prefixvault.samples import VerifySample, pending_samples
from prefixvault.scenarios.engine import identical
from prefixvault.scenarios.servers import server
from prefixvault.serve import engine_flags, vllm_command
from prefixvault.stores import open_store
from prefixvault.watch import watch_once

pytestmark = pytest.mark.slow


def test_watch_quarantines_a_wrong_restore_and_keeps_a_right_one(tmp_path: Path, seed_runs: SeedRuns) -> None:
    seed = seed_runs.seed("gdn-hybrid")
    case = seed.cases[0]  # crosses 1280, where the producer kept no state; 1024 restores exactly
    store = f"local://{tmp_path}/store?capacity=1GiB"
    cold = seed_runs.cold(seed, [case.tokens])[0]
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store, connector="UnsafeConnector",
                   connector_module="unsafe_connector"), tmp_path)
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store, extra_config={"namespace": "safe"}),
        tmp_path)
    sampled = {"verify_sample": 1.0}
    (wrong,), metrics = run_with_metrics(seed, spec(seed, "kv_consumer", [case.tokens], [""], store,
                                                    extra_config=sampled), tmp_path)
    assert wrong.cached_tokens == 1280 and not identical(cold, wrong)
    assert metrics.get("verify_samples") == 1
    (right,), _ = run_with_metrics(seed, spec(seed, "kv_consumer", [case.tokens], [""], store,
                                              extra_config={**sampled, "namespace": "safe"}), tmp_path)
    assert right.cached_tokens == case.expected_hit and identical(cold, right)

    s = open_store(store)
    samples = {k.split("/")[0]: v for k, v in pending_samples(s)}
    assert set(samples) == {"default", "safe"}
    bad: VerifySample | None = samples["default"]
    assert bad is not None and bad.hit == 1280 and bad.output == wrong.token_ids[: len(bad.output)]
    engine = {k: v for k, v in seed.engine.items() if k != "tokenizer"}
    with server([*vllm_command(seed.model), *engine_flags(engine)], tmp_path / "cold.log",
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) as url:
        report = watch_once(s, url)
    assert (report.checked, report.agreed) == (2, 1)
    assert [v.sample.record for v in report.quarantined] == [bad.record]
    assert s.get_many([bad.record]) == [None] and not list(pending_samples(s))

    # The quarantine also removed the KV of the boundary's segment (this producer published each
    # boundary whole, from the first block): the next consumer restores less, and matches cold
    again = run(seed, spec(seed, "kv_consumer", [case.tokens], [""], store), tmp_path)[0]
    assert again.cached_tokens < 1280 and identical(cold, again)
    # until a producer writes them fresh; then the shorter, right boundary restores
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store), tmp_path)
    healed = run(seed, spec(seed, "kv_consumer", [case.tokens], [""], store), tmp_path)[0]
    assert healed.cached_tokens == case.expected_hit and identical(cold, healed)
