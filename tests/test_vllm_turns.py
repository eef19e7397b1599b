"""A conversation's next turn restores to where the previous turn's prompt ended (issue 45).

Real engines (vLLM CPU, the GDN hybrid, block size 256), one request at a time, a prefill budget
of ``BUDGET`` tokens (less than a block: a chunk may end inside one):

- A producer serves turn 1, a prompt of ``TURN1`` tokens (not a block multiple). Its last
  chunk ends at the prompt's exact end, and the connector publishes that tail boundary: the
  state the chunk left (in the block the prompt's last token is in) and the KV of the partly
  filled last block, named by the prompt's exact tokens.
- A consumer (another engine, its own cache empty) serves turn 2: turn 1's prompt and a new
  message (a template that drops the previous answer). It restores exactly ``TURN1`` tokens:
  nothing that turn 1 computed is computed again.
- The reference: a cold run of turn 2 (an engine with a connector on an empty namespace: every
  engine compared carries one) whose steps end at ``TURN1``: the budget makes its chunks end
  where turn 1's did (``TURN1`` = 3 blocks + one budget), and from there where the consumer's
  do. The consumer's turn 2 equals it bit for bit (ids and top-5 logprobs). (vLLM's own
  fine-grained hit, ``--prefix-match-unit``, would be the other reference; on vLLM CPU 0.32 the
  KV a request reads through it was measured to differ from what the first request computed,
  so it is not used here.)
- The same prompt again never restores its own end: the consumer serving turn 1 itself
  restores at most ``TURN1 - 1`` tokens (a state restored at a request's very end would have
  its last token applied twice).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
from vllm_support.seedlib import IN_PROCESS, SUPPORT

from prefixvault.scenarios.engine import EngineSpec, identical, max_logprob_diff
from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.staggered import Arrivals, StaggeredRun, run_staggered

pytestmark = pytest.mark.slow

PROFILE = "gdn-hybrid"
BUDGET = 240
TURN1 = 3 * 256 + BUDGET  # not a block multiple
MESSAGE = 200


@dataclass
class Runs:
    producer: StaggeredRun
    consumer: StaggeredRun  # turn 2, then turn 1 again
    reference: StaggeredRun  # turn 2, cold, its steps ending at TURN1


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("turns")
    model = str(build_model(PROFILE, tmp_path_factory.getbasetemp() / "models" / PROFILE, seed=0))
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = BUDGET
    rng = random.Random(45)
    turn1 = [rng.randrange(3, 1000) for _ in range(TURN1)]
    turn2 = [*turn1, *(rng.randrange(3, 1000) for _ in range(MESSAGE))]
    store = f"local://{work}/store?capacity=1GiB"
    env = {**IN_PROCESS, "PYTHONPATH": SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(role: str, prompts: list[list[int]], namespace: str = "turns") -> StaggeredRun:
        spec = EngineSpec(model=model, engine=engine, prompts=prompts, role=role, store=store,
                          extra_config={"namespace": namespace}, max_tokens=6)
        return run_staggered(spec, Arrivals(concurrency=1), work, env)

    producer = run("kv_producer", [turn1])
    consumer = run("kv_consumer", [turn2, turn1])
    reference = run("kv_consumer", [turn2], namespace="empty")
    return Runs(producer, consumer, reference)


def _first_chunk_start(run: StaggeredRun, req: int) -> int:
    return min((c for c in run.chunks if c.req == req), key=lambda c: c.step).start


def test_the_producer_publishes_the_exact_end_of_its_prompt(runs: Runs) -> None:
    assert TURN1 in runs.producer.chunk_ends(0)
    assert runs.producer.metrics.get("records_published", 0) >= 4, runs.producer.metrics  # 3 blocks + the end


def test_the_next_turn_restores_to_where_the_previous_prompt_ended(runs: Runs) -> None:
    c = runs.consumer
    assert _first_chunk_start(c, 0) == TURN1, "turn 2 did not resume at turn 1's exact end"
    assert c.completions[0].cached_tokens == TURN1


def test_the_restored_turn_equals_a_cold_run_whose_steps_end_there(runs: Runs) -> None:
    ref = runs.reference
    assert TURN1 in ref.chunk_ends(0) and ref.completions[0].cached_tokens == 0
    assert ref.chunk_ends(0) >= runs.consumer.chunk_ends(0)  # and from there, where the consumer's end
    restored, cold = runs.consumer.completions[0], ref.completions[0]
    assert identical(restored, cold), (restored.token_ids, cold.token_ids, max_logprob_diff(restored, cold))


def test_the_same_prompt_again_never_restores_its_own_end(runs: Runs) -> None:
    again = runs.consumer.completions[1]
    assert again.cached_tokens < TURN1, again.cached_tokens
    assert _first_chunk_start(runs.consumer, 1) < TURN1
