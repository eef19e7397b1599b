"""A store too small for every state: which boundaries the capture policy keeps, on real engines.

Traffic as the policy simulator's few-shot and agent traces have it, in small: four requests
share a system prompt of two blocks and each goes on with 1000 tokens of its own; a fifth
request, on a fresh consumer engine, shares only the system prompt. One block per prefill
step, so every block boundary is a step end of every run (restores are bit-exact).

- ``steps`` stores a state at every step end: 14 here, most of them boundaries inside prompts
  nobody sends again. Under a budget of four states, the state at the junction (the end of
  the system prompt, the one boundary every later request needs) is evicted by the step ends
  of the requests after it: the consumer restores nothing.
- ``reuse`` stores the junction where vLLM finds it (the second request) and sequence ends
  while prefixes are shared: four states, and the same budget keeps the junction. The
  consumer restores it, and its tokens and logprobs equal a cold engine's.

This is what ``bench/policy_sim.py`` measures at scale (docs/configuration.md, "Choosing a
policy"): under a bounded store ``reuse`` restores more than ``steps`` while writing less.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vllm_support.seedlib import IN_PROCESS, Seed, run_with_metrics

from prefixvault.explain import explain
from prefixvault.scenarios.engine import EngineSpec, identical, max_logprob_diff
from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.stores import open_store
from prefixvault.stores.base import STATE_CLASS, key_class

pytestmark = pytest.mark.slow
PROFILE = "gdn-hybrid"
BUDGET_STATES = 4


def _states(uri: str) -> tuple[int, int]:
    """(number of states, the space one state takes) in a local store (all states of one
    model take the same space: its slot's share of a slab)."""
    with open_store(uri, readonly=True) as store:
        count = sum(1 for key, _ in store.scan("") if key_class(key) == STATE_CLASS)
        held = store.stats().state_bytes or 0
    assert count and held % count == 0, (count, held)
    return count, held // count


def _restorable(uri: str, tokens: list[int]) -> int:
    with open_store(uri, readonly=True) as store:
        found = explain(store, tokens)
    return max((r.restorable for r in found.layouts), default=0)


def test_a_state_budget_keeps_the_junction_under_reuse_and_not_under_steps(tmp_path: Path) -> None:
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    bs = int(engine["block_size"])
    engine["max_num_batched_tokens"] = bs
    seed = Seed(PROFILE, str(model), engine, [], [], bs, bs)
    rng = random.Random(5)
    system = [rng.randrange(3, 1000) for _ in range(2 * bs)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(1000)] for _ in range(5)]
    traffic, query = prompts[:4], prompts[4]

    def produce(policy: str, uri: str) -> None:
        spec = EngineSpec(model=str(model), engine=dict(engine), prompts=traffic, role="kv_both", store=uri,
                          extra_config={"capture": policy})
        run_with_metrics(seed, spec, tmp_path / "runs" / uri.rsplit("/", 1)[-1].split("?")[0], IN_PROCESS)

    # Without a budget, steps keeps every state: the junction restores (2 blocks), so what the
    # budget below takes away is the budget's doing.
    ample = f"local://{tmp_path}/stores/ample?capacity=1GiB"
    produce("steps", ample)
    written, slot = _states(ample)
    assert written > BUDGET_STATES + 2, written
    assert _restorable(ample, query) == 2 * bs

    budget = BUDGET_STATES * slot
    tight_steps = f"local://{tmp_path}/stores/steps?capacity=1GiB&states={budget}"
    tight_reuse = f"local://{tmp_path}/stores/reuse?capacity=1GiB&states={budget}"
    produce("steps", tight_steps)
    produce("reuse", tight_reuse)
    for uri in (tight_steps, tight_reuse):
        with open_store(uri, readonly=True) as store:
            stats = store.stats()
            assert stats.state_budget == budget and stats.state_bytes is not None
            assert stats.state_bytes <= budget
    kept_steps, _ = _states(tight_steps)
    kept_reuse, _ = _states(tight_reuse)
    assert kept_steps == BUDGET_STATES  # full: the budget evicted
    assert kept_reuse <= BUDGET_STATES
    assert _restorable(tight_steps, query) == 0
    assert _restorable(tight_reuse, query) == 2 * bs

    cold_spec = EngineSpec(model=str(model), engine=dict(engine), prompts=[query])
    cold, _ = run_with_metrics(seed, cold_spec, tmp_path / "cold", IN_PROCESS)
    consumer_spec = EngineSpec(model=str(model), engine=dict(engine), prompts=[query], role="kv_consumer",
                               store=tight_reuse)
    got, _ = run_with_metrics(seed, consumer_spec, tmp_path / "consumer", IN_PROCESS)
    assert got[0].cached_tokens == 2 * bs
    assert identical(cold[0], got[0]), (cold[0].token_ids, got[0].token_ids,
                                        max_logprob_diff(cold[0], got[0]))
