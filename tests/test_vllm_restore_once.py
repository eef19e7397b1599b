"""A restore on a real engine: one step over a local store, and once per engine (issue 33).

A producer engine (vLLM CPU, the GDN hybrid, one request at a time, one block per step) serves
X = P + x, which publishes the shared prefix P (4 blocks), Z1 = Q + z1 and Z2 = Q + z2 (another
4-block prefix Q; each publishes its own boundary Q + 1 block), and the references: Y1, Y2 and
Z2 under cache salts of their own, so computed cold, with steps that end at every block
boundary, P's and Q + 1 block's included. A consumer engine then serves Y1, Y2, Y3 (P + other
suffixes), Z1 and Z2, one at a time:

- Y1 restores P from the store. Its lookup runs in the step that first sees it
  (``restore_in_step``, the default over a local store) and reads P's objects too; the engine's
  one worker runs in the scheduler's process, so the load is synchronous, written before that
  step's forward, which runs Y1's first chunk. Before, the first chunk ran one step later
  (an asynchronous load), and before that about a thousand (empty) steps later (the lookup
  and load lanes waited for the interpreter lock the engine's loop held).
- Y2 and Y3 are hits in vLLM's own prefix cache at P (the restored state is kept there) and
  read nothing from the store: one load for the three.
- Z1 restores its own boundary, Q + 1 block. Z2 shares only Q with it: the engine holds Q's KV
  but no state at Q, and Z2 reads from the store only its state and the block past Q
  (vLLM's full-attention hit, ``supports_divergent_local_hybrid_hits``), where it read Q's KV
  again before.
- Y1, Y2 and Z2 equal their cold references bit for bit (ids and top-5 logprobs): runs whose
  steps end at the restored boundaries.
- With vLLM's multiprocessing executor (its worker a child of the scheduler's process, as in
  vLLM CPU's servers), Y1 restores in the step as well, the bytes handed over in shared memory.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
from vllm_support.seedlib import IN_PROCESS, SUPPORT

from prefixvault.scenarios.engine import EngineSpec, identical
from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.staggered import Arrivals, StaggeredRun, run_staggered

pytestmark = pytest.mark.slow

PROFILE, PREFIX, SUFFIX = "gdn-hybrid", 1024, 300


@dataclass
class Runs:
    producer: StaggeredRun
    consumer: StaggeredRun
    child_worker: StaggeredRun  # Y1 alone, the worker in a child process


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("restore-once")
    model = str(build_model(PROFILE, tmp_path_factory.getbasetemp() / "models" / PROFILE, seed=0))
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    rng = random.Random(33)
    shared = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    x, y1, y2, y3 = ([*shared, *(rng.randrange(3, 1000) for _ in range(SUFFIX))] for _ in range(4))
    other = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    z1, z2 = ([*other, *(rng.randrange(3, 1000) for _ in range(SUFFIX))] for _ in range(2))
    store = f"local://{work}/store?capacity=1GiB"
    env = {**IN_PROCESS, "PYTHONPATH": SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    alone = Arrivals(concurrency=1)

    def run(role: str, prompts: list[list[int]], salts: list[str], **over: str) -> StaggeredRun:
        spec = EngineSpec(model=model, engine={**engine, **over}, prompts=prompts, role=role, store=store,
                          max_tokens=4, salts=salts)
        return run_staggered(spec, alone, work, env)

    producer = run("kv_producer", [x, y1, y2, z1, z2, z2], ["", "ref-1", "ref-2", "", "", "ref-z2"])
    consumer = run("kv_consumer", [y1, y2, y3, z1, z2], [""] * 5)
    # vLLM's multiprocessing executor (vLLM CPU's servers always use it): the worker is a
    # child of the scheduler's process and takes the bytes from shared memory
    child = run("kv_consumer", [y1], [""], distributed_executor_backend="mp")
    return Runs(producer, consumer, child)


def _first_chunk(run: StaggeredRun, req: int) -> tuple[int, int]:
    """(step, start) of request ``req``'s first chunk."""
    first = min((c for c in run.chunks if c.req == req), key=lambda c: c.step)
    return first.step, first.start


def test_a_restore_over_a_local_store_runs_its_first_chunk_in_the_step_that_restores_it(runs: Runs) -> None:
    c = runs.consumer
    assert _first_chunk(c, 0) == (1, PREFIX), "Y1 (asked in step 1) did not start at P in step 1"
    assert c.metrics.get("loads_in_step") == c.metrics.get("loads"), c.metrics
    assert c.metrics.get("loads_in_step_read", 0) == 0, c.metrics  # from the bytes handed over
    # the next request arrives once Y1 finished, and is a local hit: it starts at once
    last = max(ch.step for ch in c.chunks if ch.req == 0)
    assert _first_chunk(c, 1) == (last + 1, PREFIX)


def test_a_worker_in_a_child_process_also_restores_in_the_step(runs: Runs) -> None:
    c = runs.child_worker
    assert _first_chunk(c, 0) == (1, PREFIX), "Y1 (asked in step 1) did not start at P in step 1"
    assert c.metrics.get("loads_in_step") == c.metrics.get("loads") == 1, c.metrics
    assert c.metrics.get("loads_in_step_read", 0) == 0, c.metrics  # handed over through shared memory
    assert identical(runs.producer.completions[1], c.completions[0]), "Y1 parts from cold"


#: Z1's and Z2's own boundary: Q and one block more.
DEEPER = PREFIX + 256


def test_a_prefix_restored_once_is_a_hit_in_the_engines_own_cache_after_it(runs: Runs) -> None:
    c = runs.consumer
    assert [x.cached_tokens for x in c.completions] == [PREFIX] * 3 + [DEEPER] * 2
    # restored: Y1's P, Z1's boundary, and of Z2's only the block past Q (and its state)
    assert c.metrics.get("loads") == 3, c.metrics
    assert c.metrics.get("loaded_tokens") == PREFIX + DEEPER + (DEEPER - PREFIX), c.metrics
    assert c.metrics.get("hit_tokens") == c.metrics.get("loaded_tokens")


def test_a_restore_past_a_prefix_the_engine_holds_reads_only_what_lies_past_it(runs: Runs) -> None:
    assert _first_chunk(runs.consumer, 4)[1] == DEEPER
    assert any(ch.req == 5 and ch.start + ch.tokens == DEEPER for ch in runs.producer.chunks)
    assert identical(runs.producer.completions[5], runs.consumer.completions[4]), "Z2 parts from cold"


def test_every_output_equals_a_cold_run_whose_steps_end_at_the_restored_boundary(runs: Runs) -> None:
    refs = runs.producer.completions[1:3]
    assert all(r.cached_tokens == 0 for r in [*refs, runs.producer.completions[5]])
    assert any(ch.req == 1 and ch.start + ch.tokens == PREFIX for ch in runs.producer.chunks)
    got = runs.consumer.completions
    for i, want in [(0, refs[0]), (1, refs[1])]:
        assert identical(want, got[i]), f"Y{i + 1} parts from cold"
