"""Exact under load: requests sharing prefixes arrive while others run (issue: a producer
published a recurrent state that was not the state at its boundary).

Every engine here runs as an OpenAI server's engine core does: built without ``block_size``,
then ``VllmConfig.__post_init__`` re-run (``Arrivals.as_server``), which on vLLM CPU resets
the scheduler's chunk alignment to 128 tokens while the hybrid blocks hold 256. Requests
arrive staggered (at most 8 in flight, random waits, seeded), so prefill chunks start and end
wherever the shared token budget falls. Per scenario (model, token budget, arrival seed):

- ``ref``: a reference producer, one request at a time, one block per step: every state it
  publishes is a chunk-end state computed alone; and where blocks hold more than 128 tokens,
  one more at 128 tokens per step, for the states of chunks that end inside a block (tail
  boundaries: ``unaligned`` ends chunks on multiples of 128).
- ``unaligned``: a producer whose chunks are left as vLLM misaligns them (test connector):
  vLLM offers states strictly inside chunks; the boundary rule must refuse every one.
- ``producer``: the real connector, which also puts vLLM's chunk alignment back.
- ``cold1`` / ``cold_load``: no connector, a unique cache salt per request (nothing reused),
  one at a time and under the same load; where their texts agree, cold is invariant to load.
- ``consumer_load`` / ``consumer1``: the real connector restoring from ``producer``'s store,
  with the hot set of recent loads on; requests of one prefix after the first find its KV in
  the engine's own cache and restore only their own state and what lies past the prefix.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_support.compare import SAME_VALUES, compare_namespaces, published_state_boundaries
from vllm_support.seedlib import IN_PROCESS, SUPPORT

from prefixvault.scenarios.engine import EngineSpec, divergence
from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.staggered import Arrivals, StaggeredRun, run_staggered
from prefixvault.stores import open_store

pytestmark = pytest.mark.slow

PREFIX, SUFFIX, PREFIXES, REQUESTS = 2048, 512, 4, 16
HOT = {"load_cache_mib": 256}
#: The least and the most drift of cold under load (|Δlogprob|) the text check works with: a
#: floor should cold happen not to move at all, a ceiling past which the check means nothing.
#: The drift is the host's: vLLM CPU picks its bf16 kernels by ISA, and the GDN scenario's cold
#: server drifts under load by about 0.2 on AVX2 hosts, 0.501 on an AVX512-BF16 host (two runs,
#: the same value) and 0.654 on an AMX host (Xeon, amx_bf16). The ceiling leaves room above the
#: largest seen; the bound stays relative (twice the drift measured in the same run), and the check
#: that finds a wrong state is the state-by-state comparison with the reference producer
#: (``_check_published``), not this one.
NOISE_FLOOR, NOISE_CEILING = 0.02, 1.0


@dataclass(frozen=True)
class Scenario:
    profile: str
    batched: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.profile}-{self.batched}-s{self.seed}"


#: GDN: 256-token blocks, so the reset misaligns chunks (chunks then end on multiples of 128
#: tokens, half of them inside a block, under any budget that is one: 384 would add no other
#: offset, so one GDN budget is run). ShortConv, as LFM2-MoE (ShortConv + attention layers, MoE
#: feed-forwards: what the dense LFM2 profile has, and experts routed per token, under load):
#: vLLM picks 128-token blocks (the reset changes nothing), and vLLM CPU's ShortConv prefill moves
#: by up to ~0.4 in a first-token logprob with where chunks end (transformers' LFM2: 5e-6), so it
#: runs with one block per step, where chunking cannot depend on load. (The dense LFM2 profile ran
#: here before; it takes as long, and its seed scenario stays in tests/test_vllm_seed.py.) Pure
#: Mamba2 needs one block per step on vLLM CPU (its scan cannot emit the states a longer chunk needs).
SCENARIOS = [
    Scenario("gdn-hybrid", 512, 7),
    Scenario("lfm2-moe", 128, 7),
    Scenario("mamba2", 256, 5),
]


@dataclass
class Runs:
    scenario: Scenario
    prompts: list[list[int]]
    store: str
    block_size: int
    unaligned: StaggeredRun
    producer: StaggeredRun
    cold1: StaggeredRun
    cold_load: StaggeredRun
    consumer_load: StaggeredRun
    consumer1: StaggeredRun

    @property
    def invariant(self) -> list[int]:
        """Requests whose cold text is the same one at a time and under load."""
        return [i for i, (a, b) in enumerate(zip(self.cold1.completions, self.cold_load.completions,
                                                 strict=True)) if a.token_ids == b.token_ids]


def prompts_for(seed: int) -> list[list[int]]:
    """vLLM's prefix_repetition workload in token ids: 4 shared prefixes, random suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(PREFIX)] for _ in range(PREFIXES)]
    return [prefixes[i % PREFIXES] + [rng.randrange(3, 1000) for _ in range(SUFFIX)] for i in range(REQUESTS)]


@pytest.fixture(scope="module", params=SCENARIOS, ids=lambda s: s.name)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    sc: Scenario = request.param
    work = tmp_path_factory.mktemp(sc.name)
    model = str(build_model(sc.profile, tmp_path_factory.getbasetemp() / "models" / sc.profile, seed=0))
    engine = engine_kwargs(sc.profile, model)
    for key in ("model", "block_size"):  # as a server is started: vLLM picks the block size
        engine.pop(key)
    prompts = prompts_for(sc.seed)
    store = f"local://{work}/store?capacity=2GiB"
    env = {**IN_PROCESS, "PYTHONPATH": SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load = Arrivals(concurrency=8, max_wait=3, seed=sc.seed, as_server=True)
    alone = Arrivals(as_server=True)
    salts = [f"cold-{i}" for i in range(len(prompts))]

    def run(role: str, arrivals: Arrivals, max_tokens: int = 8, batched: int = sc.batched, **kw: Any
            ) -> StaggeredRun:
        spec = EngineSpec(model=model, engine={**engine, "max_num_batched_tokens": batched}, prompts=prompts,
                          role=role, store=store if role != "cold" else "", max_tokens=max_tokens, **kw)
        return run_staggered(spec, arrivals, work, env)

    producer = run("kv_producer", load, max_tokens=2)
    bs = producer.block_size
    unaligned = run("kv_producer", load, max_tokens=2, extra_config={"namespace": "unaligned"},
                    connector="UnalignedConnector", connector_module="unaligned_connector")
    run("kv_producer", alone, max_tokens=1, batched=bs, extra_config={"namespace": "ref"})
    if bs > 128:  # (states already stored, at block boundaries, are kept: the one-block ones)
        run("kv_producer", alone, max_tokens=1, batched=128, extra_config={"namespace": "ref"})
    return Runs(
        sc, prompts, store, bs, unaligned, producer,
        cold1=run("cold", alone, salts=salts),
        cold_load=run("cold", load, salts=salts),
        # With the hot set of recent loads on (off by default over a local store): requests of
        # one prefix restore its objects from memory the first one read.
        consumer_load=run("kv_consumer", load, extra_config=HOT),
        consumer1=run("kv_consumer", alone, extra_config=HOT),
    )


def _check_published(runs: Runs, namespace: str, producer: StaggeredRun) -> int:
    """Every state sits where a chunk of its request ended; every object has the reference's values."""
    store = open_store(runs.store)
    states = published_state_boundaries(store, namespace, runs.prompts, runs.block_size)
    assert states, f"{namespace}: nothing published"
    off = [key for key, where in states.items()
           if not any(b in producer.chunk_ends(req) for req, b in where)]
    assert not off, f"{namespace}: states published where no chunk ended: {off[:4]}"
    matches = compare_namespaces(store, namespace, "ref")
    missing = [m.suffix for m in matches if m.error is None]
    assert not missing, f"{namespace}: objects the reference never computed: {missing[:4]}"
    wrong = [(m.suffix, round(m.error or 0.0, 3)) for m in matches if (m.error or 0.0) > SAME_VALUES]
    assert not wrong, f"{namespace}: objects that are not the reference's values: {wrong[:6]}"
    return len(states)


def test_server_engines_end_chunks_mid_block_and_offer_states_inside_them(runs: Runs) -> None:
    """The reproduction: left as vLLM CPU's server sets it up, chunks end off block boundaries
    and vLLM offers states for boundaries strictly inside a chunk (blocks larger than the 128
    tokens vLLM resets the alignment to)."""
    if runs.block_size <= 128:
        assert not runs.unaligned.mid_block_chunk_ends([len(p) for p in runs.prompts])
        return
    assert runs.unaligned.mid_block_chunk_ends([len(p) for p in runs.prompts]), "chunks all aligned"
    assert runs.unaligned.offers_inside_chunks(), "no offer fell inside a chunk"


def test_offers_inside_chunks_are_refused_and_nothing_wrong_is_published(runs: Runs) -> None:
    inside = runs.unaligned.offers_inside_chunks()
    refused = runs.unaligned.metrics.get("refused:inside_chunk", 0.0)
    assert refused >= len({(o.step, o.req, o.tokens) for o in inside})
    _check_published(runs, "unaligned", runs.unaligned)


def test_the_connector_realigns_chunks_and_publishes_reference_states(runs: Runs) -> None:
    lens = [len(p) for p in runs.prompts]
    assert not runs.producer.mid_block_chunk_ends(lens)
    assert not runs.producer.offers_inside_chunks()
    assert _check_published(runs, "default", runs.producer) >= REQUESTS


def test_consumer_under_load_departs_from_cold_no_more_than_cold_does(runs: Runs) -> None:
    """Where cold is invariant to load, the consumer (under load and alone) gives cold's texts,
    except where a near tie flips: vLLM CPU is not batch-invariant, so the states the producer
    published under load differ from cold's in the last bits, and the random test models have
    close runner-ups at many positions (cold's own logprobs move by up to ~0.2 with load here).
    So each request's logprobs must stay within twice cold's own drift under load, measured in
    the same run; ids may part only where cold ranked the consumer's pick within twice that (the
    most two tokens each moved by the bound can swap); at most a quarter of the requests part.
    This bounds what reaches users; it is not what finds a wrong state. A null ShortConv state
    restored at 1280 moves logprobs by 0.46 before the ids part (the seed negative control,
    measured), about what load does to cold: the state-by-state comparison with the reference
    producer (``_check_published``) is the check that catches one."""
    invariant = runs.invariant
    # Cold itself moves under load (vLLM CPU is not batch-invariant); most requests must not.
    assert len(invariant) >= REQUESTS // 2, f"cold is invariant on only {invariant}"
    cold = runs.cold1.completions
    drifts = [divergence(cold[i], runs.cold_load.completions[i]).drift for i in range(REQUESTS)]
    noise = max(drifts)
    shown = [round(d, 3) for d in drifts]
    assert noise <= NOISE_CEILING, f"cold drifts by {noise:.3g} with load ({shown}): the bound means nothing"
    bound = 2 * max(noise, NOISE_FLOOR)
    for name in ("consumer_load", "consumer1"):
        got: StaggeredRun = getattr(runs, name)
        assert sum(c.cached_tokens for c in got.completions) >= REQUESTS * PREFIX, name
        if runs.scenario.profile != "mamba2":  # (pure Mamba2: every restore is its own state, nothing shared)
            # A shared prefix's KV is restored about once per engine: the requests after the
            # first find it in the engine's own cache (vLLM's full-attention hit) and load only
            # their own state and the KV past it.
            loaded = got.metrics.get("loaded_tokens", 0)
            assert loaded < REQUESTS * PREFIX, f"{name}: {loaded} tokens restored, shared prefixes again"
        parted = {i: divergence(cold[i], got.completions[i]) for i in invariant}
        far = {i: d for i, d in parted.items() if d.drift > bound or (d.margin or 0.0) > 2 * bound}
        assert not far, f"{name}: past drift {bound:.3g} (cold's own: {noise:.3g}): {far}"
        flips = [i for i, d in parted.items() if d.margin is not None]
        assert len(flips) <= len(invariant) // 4, f"{name}: near ties flipped in {flips} of {invariant}"
