"""The connector's scheduler side against vLLM's real scheduler, for this process's vLLM.

Every step of every scenario is checked (``scheduler_harness.Engine``): (a) each boundary the
connector plans is its request's chunk end, or the checkpoint vLLM's own rule says the chunk
exported and only where the platform's kernels export them (not vLLM CPU's), with the blocks
vLLM's tables and offers name; (b) each lookup answer is the longest boundary published in the
store for that prompt, leaving a token to compute; (c) nothing raises into the scheduler and
the connector's guard counts no error; (d) a request vLLM will not read an external cache for
is answered (0, False) without a store lookup. Scenarios: concurrent requests sharing
prefixes under three chunk budgets, preemption, skipped reads and prompt logprobs,
speculative decoding, and the checkpoints each version offers from inside a chunk.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from scheduler_harness import (
    GEOMETRIES,
    VERSION,
    Engine,
    Engines,
    Geometry,
    make_request,
    prompts,
    skips_external_by_vllm,
)

BY_ID = {g.id: g for g in GEOMETRIES}
NO_SALT = (None, None)  # the key space of a request with no salt, on an engine never reset
CHECKPOINTING = [g for g in GEOMETRIES if g.checkpoint_blocks]


def _geo(ids: list[Geometry]) -> Any:
    return pytest.mark.parametrize("geo", ids, ids=[g.id for g in ids])


def _budget(geo: Geometry, kind: str) -> int:
    """A chunk budget (``max_num_batched_tokens``): a multiple of the block size, not a
    multiple, or smaller than one block (big hybrid blocks under vLLM's default budget)."""
    bs = geo.block_size
    return {"multiple": 2 * bs, "unaligned": bs + bs // 2 + 7, "sub-block": max(8, bs * 2 // 3 + 1)}[kind]


def _family(geo: Geometry, seed: int) -> tuple[list[int], list[list[int]]]:
    """A shared prefix of 2.4 blocks and prompts over it: shorter than a block past it, a
    block past it, over two blocks past it, and one ending exactly on a block boundary."""
    bs = geo.block_size
    shared = prompts(seed, bs * 12 // 5)[0]
    tails = prompts(seed + 1, bs // 2 + 1, bs, 2 * bs + 1)
    aligned = shared[: 2 * bs] + prompts(seed + 2, bs)[0]
    return shared, [shared + t for t in tails] + [aligned]


@_geo(list(GEOMETRIES))
@pytest.mark.parametrize("budget", ["multiple", "unaligned", "sub-block"])
@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "beside"])
def test_concurrent_requests_sharing_prefixes(engines: Engines, geo: Geometry, budget: str,
                                              in_step: bool) -> None:
    """Requests arriving together and later on one engine; then a fresh engine on the same
    store (its own prefix cache empty) restores what the first published. Lookups and loads
    in the step (a local store's default) and beside it on their lanes (a network store's)."""
    bs = geo.block_size
    shared, family = _family(geo, seed=bs)
    mode = {"restore_in_step": in_step}
    a = engines(geo, budget=_budget(geo, budget), extra=mode)
    arrivals = {0: [make_request(f"a{i}", p, geo) for i, p in enumerate(family)],
                3: [make_request("a-late", shared + prompts(7, bs + 3)[0], geo),
                    make_request("a-late-same", family[1], geo)]}
    a.run(arrivals)
    b = engines(geo, a.store, budget=_budget(geo, budget), extra=mode)
    b.run({0: [make_request("b-same", family[2], geo),
               make_request("b-longer", family[2] + prompts(9, bs // 3 + 2)[0], geo),
               make_request("b-new-tail", shared + prompts(11, 2 * bs)[0], geo),
               make_request("b-salted", family[2], geo, cache_salt="another tenant")]})
    assert a.steps and b.steps
    assert b.hits > 0, "the second engine restored nothing: the scenario proves no lookup"
    assert any(x.answer[0] == 0 for x in b.asks if x.req_id == "b-salted"), "a salted prompt hit"


@_geo(list(GEOMETRIES))
@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "beside"])
def test_salted_requests_are_tenants_of_a_keyed_namespace(engines: Engines, geo: Geometry, in_step: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: in a namespace with a secret, each cache salt is a tenant. One engine saves
    and publishes prompts of two salts and of none; a fresh engine on the store restores each
    under its own salt only (the lookups, read ahead and hand-over in the step verified with
    the tenant's key: ``LoadSpec.salt``), nothing under another salt or none. And a party
    holding the namespace's secret but no salt (an unsalted request, an audit) reads none of
    the salted requests' stored bytes: each verifies under its own tenant's key only."""
    from prefixvault.codec import IntegrityError, decode
    from prefixvault.keys import ExtraKeys

    monkeypatch.setenv("PV_CONTRACT_SECRET", "contract-secret-0123456789abcdef")
    keyed = {"restore_in_step": in_step, "namespace_secret_env": "PV_CONTRACT_SECRET"}
    bs = geo.block_size
    mine, theirs, plain = prompts(bs + 5, 3 * bs + 3, 3 * bs + 3, 3 * bs + 3)
    a = engines(geo, budget=2 * bs, extra=keyed)
    a.run({0: [make_request("alice", mine, geo, cache_salt="alice"),
               make_request("bob", theirs, geo, cache_salt="bob"),
               make_request("plain", plain, geo)]})
    b = engines(geo, a.store, budget=2 * bs, extra=keyed)
    b.run({0: [make_request("alice-again", mine, geo, cache_salt="alice"),
               make_request("alice-as-bob", mine, geo, cache_salt="bob"),
               make_request("alice-unsalted", mine, geo),
               make_request("bob-again", theirs, geo, cache_salt="bob"),
               make_request("plain-again", plain, geo)]})
    found = {x.req_id: max(y.answer[0] or 0 for y in b.asks if y.req_id == x.req_id) for x in b.asks}
    assert found["alice-again"] > 0 and found["bob-again"] > 0 and found["plain-again"] > 0, found
    assert found["alice-as-bob"] == 0 and found["alice-unsalted"] == 0, found
    assert b.loads["alice-again"] >= 1 and b.loads["bob-again"] >= 1
    vault = b.vault
    assert vault.key is not None
    names = [k for k, _ in vault.store.scan(vault.keys.prefix) if k.split("/")[2] in ("b", "s", "r", "t")]
    blobs = dict(zip(names, vault.store.get_many(names), strict=True))

    def readable(key: Any) -> set[str]:
        out = set()
        for name, blob in blobs.items():
            try:
                decode(blob or b"", key=key)
                out.add(name)
            except IntegrityError:
                pass
        return out

    # alice's objects and records, named by her chain (what a reader who knows her salt names)
    chain = {h.hex() for h in vault.hashes(mine, ExtraKeys(cache_salt="alice"))}
    hers = {n for n in names if n.rsplit("/", 1)[1] in chain}
    assert hers, "alice's request stored nothing"
    assert not readable(vault.key) & hers, "the namespace's key reads alice's bytes"
    tenants = {who: readable(vault.key_for(who)) for who in ("alice", "bob")}
    assert tenants["alice"] >= hers and tenants["bob"] and readable(vault.key)
    assert len(readable(vault.key)) + len(tenants["alice"]) + len(tenants["bob"]) == len(names)


@_geo(list(GEOMETRIES))
def test_a_prefix_restored_once_is_a_local_hit_for_the_requests_after_it(engines: Engines,
                                                                         geo: Geometry) -> None:
    """Issue 33: vLLM's own prefix cache (retention interval 0, its default) kept no state at a
    restored boundary, so every later request of the prefix restored it from the store again.
    A consumer restores the shared prefix for its first request; the next request of that prefix
    on the same engine is a hit in vLLM's own cache at that boundary, and loads nothing."""
    bs = geo.block_size
    shared = prompts(bs + 1, 2 * bs)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", shared + prompts(bs + 2, bs // 2 + 1)[0], geo)]})  # publishes 2 bs
    b = engines(geo, a.store, budget=2 * bs)
    # tails past a block: the shared boundary is neither request's replay boundary
    b.run({0: [make_request("first", shared + prompts(bs + 3, bs + 5)[0], geo)]})
    assert b.loads["first"] == 1 and b.hits, "the scenario restored nothing"
    b.run({0: [make_request("next", shared + prompts(bs + 4, bs + 7)[0], geo)]})
    asks = [x for x in b.asks if x.req_id == "next"]
    assert asks and asks[0].computed == 2 * bs, f"vLLM's own cache had {asks[0].computed if asks else None}"
    assert b.loads["next"] == 0


@_geo(list(GEOMETRIES))
def test_a_restore_past_a_prefix_the_engine_holds_reads_only_what_lies_past_it(engines: Engines,
                                                                              geo: Geometry) -> None:
    """Issue 33: two prompts share a prefix and each has its own deeper boundary in the store.
    The first restores its own boundary; the engine then holds the prefix's KV, but no state at
    the prefix's end (vLLM keeps a state only at a request's own boundaries). The second was
    read whole from the store again, shared KV included: once per request, not once per engine.
    Now vLLM offers the full-attention hit (``supports_divergent_local_hybrid_hits``) and the
    second reads only its state and the KV past the prefix, into blocks vLLM allocated."""
    bs = geo.block_size
    shared = prompts(bs + 8, 2 * bs)[0]
    # tails past two blocks: each prompt's own boundary (4 blocks) ends a chunk, also where the
    # state layers reserve a checkpoint block (never published from inside a chunk on CPU)
    one, two = (shared + t for t in prompts(bs + 9, 2 * bs + 5, 2 * bs + 7))
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a1", one, geo)], 4: [make_request("a2", two, geo)]})  # 4 bs each, 2 bs
    b = engines(geo, a.store, budget=2 * bs)
    b.run({0: [make_request("first", one, geo)]})
    assert b.loads["first"] == 1 and b.local_loaded["first"] == 0, "the first restored nothing"
    costs, judged = b.connector.scheduler.costs, []  # what restore_when judges the lookup by
    look_up = costs.look_up

    def recorded(tokens: int, in_step: bool, nbytes: int = 0) -> Any:
        judged.append(tokens)
        return look_up(tokens, in_step, nbytes)
    costs.look_up = recorded  # type: ignore[method-assign]
    b.run({0: [make_request("second", two, geo)]})
    # past the hit every group holds (nothing), not past vLLM's divergent offer (2 blocks of KV)
    assert judged[0] == len(two) - 1, f"judged {judged} tokens"
    asks = [x for x in b.asks if x.req_id == "second" and x.answer[0] is not None]
    assert asks and asks[0].computed == 2 * bs, f"vLLM offered {asks[0].computed if asks else None}"
    assert asks[0].answer == (2 * bs, False), asks[0]  # synchronous: a worker in this process
    assert b.loads["second"] == 1 and b.local_loaded["second"] == 2 * bs
    # A third shares the prefix and has no deeper boundary of its own in the store. Its
    # divergent hit (the prefix) would answer 0 and vLLM would compute it from the hit every
    # group agrees on (nothing): it is asked again with divergent hits not offered, and
    # restores the prefix's boundary, one step later.
    b.run({0: [make_request("third", shared + prompts(bs + 10, 2 * bs + 9)[0], geo)]})
    asks = [(x.computed, x.answer) for x in b.asks if x.req_id == "third"]
    assert asks[0] == (2 * bs, (None, False)) and asks[-1] == (0, (2 * bs, False)), asks
    assert b.loads["third"] == 1 and b.local_loaded["third"] == 0
    # vLLM keeps the state the third restored: a fourth is a hit in its own cache there, every
    # group agreeing, and is answered at once (nothing to ask again for).
    b.run({0: [make_request("fourth", shared + prompts(bs + 11, 2 * bs + 3)[0], geo)]})
    # (asks while its lookup is still out, ``(None, False)``, depend on the machine's load)
    asks = [(x.computed, x.answer) for x in b.asks if x.req_id == "fourth" and x.answer[0] is not None]
    assert asks == [(2 * bs, (0, False))], asks


@_geo(list(GEOMETRIES))
def test_a_divergent_hit_on_kv_the_engine_computed_is_not_completed(engines: Engines,
                                                                  geo: Geometry) -> None:
    """The state a store holds was computed over its producer's KV; KV an engine computed itself
    for the same tokens may differ in the last bits, and a resume on the mix matches no run.
    The engine computes a prompt (the store is empty), then a producer publishes a deeper
    boundary of a second prompt sharing its prefix. vLLM offers the second the prefix's
    full-attention hit, KV the engine computed: the connector does not complete it but asks
    again for the hit every group holds (none) and restores the whole boundary."""
    bs = geo.block_size
    shared = prompts(bs + 12, 2 * bs)[0]
    one, two = (shared + t for t in prompts(bs + 13, 2 * bs + 5, 2 * bs + 7))
    b = engines(geo, budget=2 * bs)
    b.run({0: [make_request("computed", one, geo)]})
    assert b.loads["computed"] == 0
    a = engines(geo, b.store, budget=2 * bs)
    a.run({0: [make_request("published", two, geo)]})
    b.run({0: [make_request("second", two, geo)]})
    asks = [(x.computed, x.answer) for x in b.asks if x.req_id == "second" and x.answer[0] != 0]
    assert asks[0] == (2 * bs, (None, False)), asks
    assert asks[-1][0] == 0 and (asks[-1][1][0] or 0) >= 4 * bs, asks
    assert b.loads["second"] == 1 and b.local_loaded["second"] == 0


@_geo(list(GEOMETRIES))
@pytest.mark.parametrize("in_process_worker", [True, False], ids=["one-rank", "worker-elsewhere"])
def test_a_fast_store_restores_in_one_step(engines: Engines, geo: Geometry, in_process_worker: bool) -> None:
    """Issue 33: a restore took at least two engine steps (the lookup answered in one, the load
    landed in a later one), each a full batch step under load. Over a store that answers inside
    the step (``restore_in_step``: the step waits for it, a CPU engine's default over a local
    store) the first ask is answered, never left undetermined, and the load is planned in that
    step. Where the engine's worker runs in the scheduler's process (one rank), the lookup read
    the objects too and the load is synchronous: written before that step's forward, which runs
    the first chunk. Elsewhere the first chunk runs in the next step (the workers report the
    load landed in the step it was planned in, as ``WorkerSide`` does when it waits for it)."""
    bs = geo.block_size
    shared = prompts(bs + 5, 2 * bs)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", shared + prompts(bs + 6, bs // 2 + 1)[0], geo)]})  # publishes 2 bs
    b = engines(geo, a.store, budget=2 * bs, extra={"restore_in_step": True},
                in_process_worker=in_process_worker)
    b.run({0: [make_request("r", shared + prompts(bs + 7, bs + 5)[0], geo)]})
    asks = [x.answer for x in b.asks if x.req_id == "r"]
    assert asks[0] == (2 * bs, not in_process_worker), asks
    planned = [s.number for s in b.steps if any(load.req_id == "r" for load in s.meta.loads)]
    first = min(s.number for s in b.steps if "r" in s.chunks)
    assert planned == [1] and first == (1 if in_process_worker else 2), (planned, first)
    assert b.steps[first - 1].chunks["r"].start == 2 * bs
    assert b.loads_in_step == int(in_process_worker)


@_geo([GEOMETRIES[0]])
def test_bytes_that_cannot_be_handed_over_make_the_load_asynchronous(
    engines: Engines, geo: Geometry, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bytes are handed to the worker before the answer: a mailbox that cannot take them
    (shared memory full, for a worker in a child process) makes the answer asynchronous, never
    a synchronous load without its bytes."""
    from prefixvault.vllm.mailbox import MemoryMailbox

    def full(*args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    bs = geo.block_size
    shared = prompts(bs + 5, 2 * bs)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", shared + prompts(bs + 6, bs // 2 + 1)[0], geo)]})
    monkeypatch.setattr(MemoryMailbox, "put", full)
    b = engines(geo, a.store, budget=2 * bs, extra={"restore_in_step": True})
    b.run({0: [make_request("r", shared + prompts(bs + 7, bs + 5)[0], geo)]})
    assert next(x.answer for x in b.asks if x.req_id == "r") == (2 * bs, True)
    assert min(s.number for s in b.steps if "r" in s.chunks) == 2 and b.loads_in_step == 0
    assert b.connector.scheduler.counters.in_step_lost == {"handover_failed": 1}
    assert b.connector._totals().get("in_step_lost:handover_failed") == 1  # (the metric)


# (with a hash unit, "first" restores the tail at vLLM's checkpoint, and vLLM gives a request
# scheduled in the same step no hit on a state it keeps inside a block: the scenario is moot)
@_geo([g for g in GEOMETRIES if not g.hash_unit])
def test_a_request_starting_from_a_synchronous_loads_state_in_its_step_gets_it(engines: Engines,
                                                                              geo: Geometry) -> None:
    """vLLM caches a synchronous load's blocks as it allocates them, and align mode's pre-copy
    (from the state block at a request's start into its running block) runs before the load is
    written. Two requests for the same prompt arrive together: the first restores it; the
    second is a hit in vLLM's own cache on the blocks the first loads. If vLLM schedules it in
    the same step, its pre-copy reads the state block the load fills, and the load writes its
    state into the second's running block too (the harness checks every load's copies against
    vLLM's tables); a later step finds the state written."""
    bs = geo.block_size
    prompt = prompts(bs + 14, 2 * bs + bs // 2 + 1)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", prompt, geo)]})  # publishes 2 bs (a chunk ends there)
    b = engines(geo, a.store, budget=4 * bs)
    b.run({0: [make_request("first", prompt, geo), make_request("second", prompt, geo)]})
    assert b.loads["first"] == 1 and b.loads_in_step == 1 and b.loads["second"] == 0, b.loads
    step, start = min((x.number, x.chunks["second"].start) for x in b.steps if "second" in x.chunks)
    assert start == 2 * bs, "the second was not a hit on the first's blocks"
    assert b.state_copies == (len(b.state_groups) if step == 1 else 0)


#: KV cache sizes (blocks, every group drawing from one pool) tried in turn until vLLM
#: preempts: six requests that need about 8 blocks each, so two to three fit at once.
TIGHT_POOLS = (16, 18, 14, 12, 20)


@_geo(list(GEOMETRIES))
def test_preemption(engines: Engines, geo: Geometry) -> None:
    """A KV cache too small for the requests running together: vLLM preempts some while they
    decode and later recomputes them (prompt and outputs in one prefill); nothing of a
    state holding outputs is published, and their lookups asked again still answer right."""
    bs = geo.block_size
    family = prompts(3 * bs, bs * 16 // 5, bs * 13 // 5, bs * 37 // 10, bs * 21 // 10, bs * 5 // 2)
    tried = []
    for blocks in TIGHT_POOLS:  # every run is checked step by step, preempting or not
        e = engines(geo, budget=_budget(geo, "unaligned"), num_blocks=blocks)
        e.run({0: [make_request(f"p{i}", p, geo, max_tokens=bs // 2 + 2) for i, p in enumerate(family)]})
        tried.append((blocks, e.preemptions))
        if e.preemptions:
            break
    else:
        pytest.fail(f"vLLM preempted no request with any pool tried (blocks, preemptions): {tried}")
    again = engines(geo, e.store, budget=_budget(geo, "multiple"))
    again.run({0: [make_request("p-again", family[3], geo)]})
    assert again.hits > 0


SKIP_CASES: list[tuple[str, dict[str, Any]]] = [
    ("skip-reading-prefix-cache", {"skip_reading_prefix_cache": True}),
    ("prompt-logprobs", {"prompt_logprobs": 1}),
    # Reading the prefix cache asked for explicitly: 0.32/0.33 read the external cache for it;
    # 0.34 bounds any prompt-logprob request's hits (``prefix_cache_hit_limit``) and so never
    # reads an external cache for it.
    ("prompt-logprobs-reading-allowed", {"prompt_logprobs": 1, "skip_reading_prefix_cache": False}),
]


@_geo([BY_ID["qwen3-next-gdn-bs544-ckpt0"], BY_ID["lfm2-shortconv-bs16-ckpt0"],
       BY_ID["zamba2-mamba2-bs48-ckpt1"]])
@pytest.mark.parametrize("case", [c for c, _ in SKIP_CASES])
def test_requests_that_skip_the_external_cache(engines: Engines, geo: Geometry, case: str) -> None:
    """vLLM does not read an external cache for these requests (0.32/0.33: the request's
    ``skip_reading_prefix_cache``; 0.34: ``skip_reading_external_kv``, set for prompt-logprob
    requests too): the connector answers (0, False) and looks nothing up. A request with the
    same prompt that reads is the control: it hits."""
    bs = geo.block_size
    params = dict(SKIP_CASES)[case]
    prompt = _family(geo, seed=5 * bs)[1][2]
    a = engines(geo, budget=_budget(geo, "multiple"))
    a.run({0: [make_request("writer", prompt, geo)]})
    b = engines(geo, a.store, budget=_budget(geo, "multiple"))
    skipping = make_request("skipping", prompt, geo, **params)
    b.run({0: [skipping]})
    asked = [x for x in b.asks if x.req_id == "skipping"]
    assert asked, "vLLM never asked the connector about the skipping request"
    if not skips_external_by_vllm(skipping):  # this version lets it read the external cache
        assert case == "prompt-logprobs-reading-allowed" and VERSION < (0, 34), (case, VERSION)
        assert b.hits > 0, "a request allowed to read the external cache did not hit"
    control = engines(geo, a.store, budget=_budget(geo, "multiple"))
    control.run({0: [make_request("control", prompt, geo)]})
    assert control.hits > 0, "the control request did not hit: nothing shows the skipping one could have"


@_geo([BY_ID["qwen3-next-gdn-bs544-ckpt0"], BY_ID["granite-4.0-h-mamba2-bs528-ckpt1"],
       BY_ID["lfm2-shortconv-bs16-ckpt0"]])
def test_speculative_decoding(engines: Engines, geo: Geometry) -> None:
    """Draft tokens scheduled with decode steps (n-gram drafter, 2 per step, half accepted):
    no boundary over a draft, nor over an output, is planned; restores still hit."""
    bs = geo.block_size
    family = _family(geo, seed=7 * bs)[1]
    a = engines(geo, budget=_budget(geo, "unaligned"), spec_tokens=2)
    a.run({0: [make_request(f"s{i}", p, geo, max_tokens=12) for i, p in enumerate(family)]})
    assert a.drafted > 0, "no draft token was scheduled"
    b = engines(geo, a.store, budget=_budget(geo, "unaligned"), spec_tokens=2)
    b.run({0: [make_request("s-again", family[2] + prompts(13, 5)[0], geo, max_tokens=6)]})
    assert b.hits > 0


def _checkpoint_run(engines: Engines, geo: Geometry, exporting: bool
                    ) -> tuple[Engine, set[int], dict[str, int]]:
    """A prompt of 3.3 blocks under a budget of 2.5 blocks: chunks [0, 2 blocks) and [2 blocks,
    prompt end), the last running through vLLM's prompt checkpoint at 3 blocks where the state
    layers reserve a checkpoint block. Returns the engine, the block boundaries of the prompt it
    published, and what fresh engines (empty prefix caches) then restore for the same prompt
    and for one sharing its first 3 blocks: each, the longest boundary published for it (at
    any length: a tail boundary too)."""
    bs = geo.block_size
    prompt = prompts(17 * bs, bs * 33 // 10)[0]
    branch = prompt[: 3 * bs] + prompts(19, bs // 2 + 1)[0]
    budget = bs * 5 // 2
    a = engines(geo, budget=budget, exporting=exporting)
    a.run({0: [make_request("ckpt", prompt, geo)]})
    published = {b for b in range(bs, len(prompt), bs) if a.published.has(NO_SALT, prompt[:b])}
    restored = {}
    for name, tokens in (("ckpt-same", prompt), ("ckpt-branch", branch)):
        b = engines(geo, a.store, budget=budget, exporting=exporting)
        b.run({0: [make_request(name, tokens, geo)]})
        restored[name] = max((x.computed + x.answer[0] for x in b.asks if x.answer[0]), default=0)
        then = a.published.longest(NO_SALT, tokens, len(tokens) - 1, bs, b.first_ask[name])
        assert restored[name] == then, (name, restored, then)
    assert a.published.has(NO_SALT, prompt), "the prompt's exact end was not published"
    return a, published, restored


@_geo(list(GEOMETRIES))
def test_checkpoint_offers_inside_a_chunk_are_refused_on_cpu(engines: Engines, geo: Geometry) -> None:
    """vLLM CPU's kernels export no state from inside a chunk, whatever vLLM offers there:
    only chunk ends are published (checked each step). Where the layers reserve checkpoint
    blocks, vLLM's rule fires and the checkpoint block is offered inside the last chunk;
    the prompt then publishes only its first chunk's end."""
    bs = geo.block_size
    a, published, restored = _checkpoint_run(engines, geo, exporting=False)
    assert a.inside_published == 0
    if geo.checkpoint_blocks:
        assert a.checkpoints_valid > 0, "vLLM's rule found no in-chunk checkpoint: the scenario is wrong"
        assert a.offers_inside > 0, "vLLM offered no state from inside a chunk"
        assert published == {2 * bs}, published
    else:
        assert a.checkpoints_valid == 0
        assert published == {2 * bs, 3 * bs}, published  # vLLM ends a chunk at the checkpoint
    if not geo.hash_unit:  # (a hash unit adds the chunk end at vLLM's checkpoint on it: a tail)
        assert restored == {"ckpt-same": max(published), "ckpt-branch": max(published)}, restored


@_geo(CHECKPOINTING)
def test_checkpoint_offers_are_published_where_the_platform_exports_them(
        engines: Engines, geo: Geometry, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a platform whose kernels export the checkpoint state (CUDA), vLLM's valid
    in-chunk checkpoint is published, and fresh engines restore it. Here the CPU platform
    is marked exporting through the connector's compatibility seam."""
    compat = pytest.importorskip("prefixvault.vllm.compat")
    if not hasattr(compat, "EXPORTING_PLATFORMS") or not hasattr(compat, "internal_checkpoints"):
        pytest.skip("prefixvault.vllm.compat has no EXPORTING_PLATFORMS / internal_checkpoints hook yet")
    from vllm.platforms import current_platform

    monkeypatch.setattr(compat, "EXPORTING_PLATFORMS",
                        frozenset(compat.EXPORTING_PLATFORMS) | {current_platform.device_type})
    bs = geo.block_size
    a, published, restored = _checkpoint_run(engines, geo, exporting=True)
    assert a.checkpoints_valid > 0 and a.offers_inside > 0
    assert a.inside_published > 0, "vLLM's valid in-chunk checkpoint was not published"
    if not geo.hash_unit:  # (on its hash unit, vLLM's checkpoint is a tail boundary past 3 blocks)
        assert published == {2 * bs, 3 * bs}, published
        assert restored == {"ckpt-same": 3 * bs, "ckpt-branch": 3 * bs}, restored
    else:
        assert published == {2 * bs}, published
        assert restored["ckpt-same"] > 3 * bs and restored["ckpt-same"] % bs, restored


@_geo([g for g in GEOMETRIES if g.block_size >= 256])
def test_a_prompt_ending_inside_the_first_block_is_restored_to_its_end(engines: Engines,
                                                                     geo: Geometry) -> None:
    """A short first turn (shorter than one block) publishes its exact end, a tail boundary in
    the first block (named from the chain's seed); the next turn restores it."""
    first, more = prompts(1, 100, 30)
    a = engines(geo, budget=2 * geo.block_size)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=2 * geo.block_size)
    b.run({0: [make_request("b", first + more, geo)]})
    assert [x.answer for x in b.asks if x.answer[0] is not None] == [(100, False)], b.asks


@_geo([GEOMETRIES[0]])
def test_hits_are_labelled_with_the_stores_medium(engines: Engines, geo: Geometry) -> None:
    """vLLM 0.32-0.34 count cached prompt tokens by source (``vllm:prompt_tokens_cached_by_source``),
    asking the connector after allocation; hits from a store in this process's memory are host
    hits, not vLLM's "external, unspecified"."""
    first = prompts(7, 2 * geo.block_size + 5)[0]
    a = engines(geo, budget=2 * geo.block_size)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=2 * geo.block_size)
    request = make_request("b", first + prompts(8, 9)[0], geo)
    b.run({0: [request]})
    assert b.loads["b"] == 1
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert b.connector.get_external_cache_hit_sources(request, 512) == {CacheHitSource.HOST: 512}


@_geo([GEOMETRIES[0]])
def test_a_worker_gone_off_stops_hits_and_saves(engines: Engines, geo: Geometry) -> None:
    """A worker that cannot use its caches writes no load: were hits still offered, each would
    be a load that fails, is recomputed and is looked up again, slower than no connector. Once
    its report reaches the scheduler, every request is a miss (``worker_off``) and nothing is
    planned for saving."""
    bs = geo.block_size
    first = prompts(11, 2 * bs + 5)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=2 * bs)
    b.worker_goes_off = True
    b.run({0: [make_request("warm", prompts(12, 9)[0], geo)]})  # (a step that carries the report)
    assert b.connector.scheduler.off is not None
    b.run({0: [make_request("b", first + prompts(13, 9)[0], geo)]})
    assert b.loads["b"] == 0 and all(x.answer == (0, False) for x in b.asks if x.req_id == "b")
    assert b.vault.counters.misses.get("worker_off", 0) == 1
    assert not any(s.meta.saves for s in b.steps[-3:])


@_geo([GEOMETRIES[0]])
def test_a_request_that_cannot_pay_for_a_round_trip_is_computed_without_a_lookup(engines: Engines,
                                                                                 geo: Geometry) -> None:
    """``restore_when: faster`` (the default): once the engine's prefill is measured, a request
    whose uncomputed tokens take less to compute than the store's round trips (a lookup measured
    at a second) is not looked up: a miss, ``not_worth_it``, and no load. With ``always`` the same
    store restores the next request."""
    bs = geo.block_size
    first, second = prompts(31, 2 * bs + 5, 2 * bs + 7)
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", first, geo), make_request("a2", second, geo)]})
    b = engines(geo, a.store, budget=2 * bs, extra={"restore_when": "faster"})
    b.run({0: [make_request("warm", prompts(32, 3 * bs)[0], geo)]})  # prefill steps: measured
    scheduler = b.connector.scheduler
    costs = scheduler.costs
    assert costs.estimates().compute_s_per_token is not None
    costs.explore_s = math.inf  # (no judgment put aside to measure again)
    for _ in range(50):
        costs.looked_up(1.0)
    lookups = scheduler.counters.lookups
    b.run({0: [make_request("b", first + prompts(33, 9)[0], geo)]})
    assert b.loads["b"] == 0 and all(x.answer == (0, False) for x in b.asks if x.req_id == "b")
    assert b.vault.counters.misses.get("not_worth_it", 0) == 1
    assert scheduler.counters.lookups == lookups, "looked up anyway"
    assert scheduler.counters.judged.get("lookup_not_worth_it") == 1
    costs.judge = False  # restore_when: always
    b.run({0: [make_request("c", second + prompts(34, 9)[0], geo)]})
    assert b.loads["c"] == 1
    est = costs.estimates()  # what that restore took, from its lookup to its first step
    assert (est.restore_s_beside, est.restore_s_in_step) != (None, None)


@_geo([GEOMETRIES[0]])
def test_a_restore_held_back_by_a_full_step_is_not_measured_as_slow(engines: Engines, geo: Geometry) -> None:
    """What a restore took is measured up to when its request could be scheduled (its load
    beside the steps reported done), not to the step that first schedules it: a request that
    waits while another's prefill takes every step's token budget would wait as long computed.
    Here each step takes 50 ms and the restored request is held for several of them; the
    estimate stays well under what it waited (measured to its first step it was 250 ms and
    more, and a busy engine declined restores that paid)."""
    bs = geo.block_size
    first = prompts(51, 2 * bs + 5)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=bs, extra={"restore_in_step": False})
    schedule = b.scheduler.schedule

    def slow_step() -> Any:
        time.sleep(0.05)
        return schedule()

    b.scheduler.schedule = slow_step  # type: ignore[method-assign]
    # The hog runs before c is asked (its own lookup, a miss, may take any number of steps on
    # a busy host): then c's load ends beside the hog's prefill, 8 full steps.
    b.add(make_request("hog", prompts(53, 8 * bs)[0], geo))
    while "hog" not in b.step().chunks:
        assert len(b.steps) < 2000, "the hog never scheduled"
        time.sleep(0.001)
    held = b.steps[-1].number
    b.run({0: [make_request("c", first + prompts(52, 9)[0], geo)]})
    assert b.loads["c"] == 1
    ran = next(st.number for st in b.steps if "c" in st.chunks)
    assert ran - held >= 5, f"not held back: the hog from step {held}, c scheduled in step {ran}"
    est = b.connector.scheduler.costs.estimates()
    assert est.restore_s_beside is not None and est.restore_s_beside < 0.15, est


@_geo([GEOMETRIES[0]])
def test_a_hit_whose_load_would_end_after_computing_it_is_computed(engines: Engines, geo: Geometry) -> None:
    """``restore_when: faster`` after the lookup: a restore measured at three blocks' prefill
    (its bytes free) is looked up for a prompt that could restore five blocks, and its hit of
    two is computed instead of loaded: a miss, ``not_worth_it``, judged ``load_not_worth_it``,
    and no load. A store measured to load a byte per 1000 s is not looked up at all: no hit
    could pay for its bytes (``lookup_not_worth_it``)."""
    from prefixvault.costs import Estimates

    bs = geo.block_size
    first = prompts(41, 2 * bs + 5)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=2 * bs, extra={"restore_when": "faster", "restore_in_step": False})
    scheduler = b.connector.scheduler
    costs = scheduler.costs
    costs.explore_s = math.inf
    per_token = 1e-3
    fixed = 3 * bs * per_token
    costs.estimates = lambda: Estimates(per_token, 0.01, 1e-6, 0.0, fixed, fixed)  # type: ignore[method-assign]
    lookups = scheduler.counters.lookups
    b.run({0: [make_request("b", first + prompts(43, 3 * bs)[0], geo)]})
    assert scheduler.counters.lookups == lookups + 1, "not looked up"
    answers = [x.answer for x in b.asks if x.req_id == "b"]  # (None: the lookup not in yet)
    assert b.loads["b"] == 0 and answers[-1] == (0, False) and all(n in (None, 0) for n, _ in answers)
    assert scheduler.counters.judged.get("load_not_worth_it") == 1
    assert b.vault.counters.misses.get("not_worth_it", 0) == 1
    costs.estimates = lambda: Estimates(per_token, 0.01, 1e-6, 1000.0, 0.0, 0.0)  # type: ignore[method-assign]
    b.run({0: [make_request("c", first + prompts(44, 3 * bs)[0], geo)]})
    assert scheduler.counters.lookups == lookups + 1, "looked up though no hit could pay for its bytes"
    assert b.loads["c"] == 0 and scheduler.counters.judged.get("lookup_not_worth_it") == 1


@_geo([GEOMETRIES[0], BY_ID["lfm2-shortconv-bs16-ckpt0"]])
@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "beside"])
def test_a_restore_whose_tail_would_not_pay_ends_at_the_junction(engines: Engines, geo: Geometry,
                                                                 in_step: bool) -> None:
    """Issue 49: an engine holds a prefix's KV (loaded for an earlier request) but no state in
    it; each request of that prefix restored its own boundary from the store, while an engine
    with no store keeps the state at the prefix's end (vLLM's junction) and computes only the
    rest. Where loading past the junction costs more than computing it twice and a step
    (restore_when: faster, a restore's fixed cost measured at three blocks' prefill: what the
    next request saves outweighs what this one pays), the second request restores to the
    junction and computes the rest; vLLM keeps the state there, and the third is a hit in the
    engine's own cache at the junction, computed from it with no lookup and no load."""
    from prefixvault.costs import Estimates

    bs = geo.block_size
    shared = prompts(bs + 20, 4 * bs)[0]
    one, two, three = (shared + t for t in prompts(bs + 21, bs + 5, bs + 7, bs + 9))
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a1", one, geo)], 4: [make_request("a2", two, geo)],
           8: [make_request("a3", three, geo)]})  # steps end at 2, 4 and 5 blocks: each published
    b = engines(geo, a.store, budget=2 * bs, extra={"restore_when": "faster", "restore_in_step": in_step})
    b.run({0: [make_request("first", one, geo)]})
    assert b.loads["first"] == 1 and b.local_loaded["first"] == 0, "the first restored nothing"
    costs = b.connector.scheduler.costs
    costs.explore_s = math.inf  # (no judgment put aside to measure again)
    per_token = 1e-3
    fixed = 3 * bs * per_token  # a restore: three blocks' prefill, whatever its bytes
    costs.estimates = lambda: Estimates(per_token, 0.01, 1e-6, 0.0, fixed, fixed)  # type: ignore[method-assign]
    b.run({0: [make_request("second", two, geo)]})
    asks = [(x.computed, x.answer) for x in b.asks if x.req_id == "second" and x.answer[0] is not None]
    # offered the prefix's KV (a divergent hit at the junction): asked again without it, and
    # restored to the junction from the hit every group holds (none)
    assert asks[-1][0] + (asks[-1][1][0] or 0) == 4 * bs, asks
    assert b.loads["second"] == 1
    assert b.connector.scheduler.counters.judged.get("load_to_junction") == 1
    lookups = b.connector.scheduler.counters.lookups
    b.run({0: [make_request("third", three, geo)]})
    asks = [(x.computed, x.answer) for x in b.asks if x.req_id == "third"]
    assert asks == [(4 * bs, (0, False))], asks  # every group holds the junction: nothing to load
    assert b.loads["third"] == 0 and b.connector.scheduler.counters.lookups == lookups
    assert b.connector.scheduler.counters.judged.get("lookup_not_worth_it") == 1


@_geo([GEOMETRIES[0], BY_ID["qwen3-next-gdn-bs544-ckpt0"]])
def test_a_reset_of_the_engines_cache_restores_nothing_stored_before(engines: Engines, geo: Geometry) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (``/reset_prefix_cache``, as after an
    in-place weight update) asks the connector to reset too: the store holds what the old
    weights computed, so from then on this engine restores none of it. It moves to an epoch of
    its own: a request it was running saves nothing more and is answered a miss when asked
    again; a new request finds nothing from before, and what the engine computes
    after the reset is stored and restored again (here after its own cache alone is reset)."""
    bs = geo.block_size
    first = prompts(21, 2 * bs + 5)[0]
    a = engines(geo, budget=2 * bs)
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=2 * bs)
    b.add(make_request("old", first + prompts(24, 3 * bs)[0], geo))
    for _ in range(3):
        b.step()
    assert b.connector.scheduler.tracked("old") is not None
    assert b.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    after, asked = len(b.steps), len(b.asks)
    b.run()
    assert not any(s.req_id == "old" for st in b.steps[after:] for s in st.meta.saves)
    assert [x.answer for x in b.asks[asked:] if x.req_id == "old"] == [(0, False)]  # (preempted)
    second = first + prompts(22, 9)[0]
    b.run({0: [make_request("b", second, geo)]})
    assert b.loads["b"] == 0, "restored what was stored before the reset"
    assert any(s.req_id == "b" for st in b.steps for s in st.meta.saves), "saves nothing after a reset"
    assert b.scheduler.reset_prefix_cache() is True  # the engine's own cache only: its epoch stays
    b.run({0: [make_request("c", second + prompts(23, 9)[0], geo)]})
    assert b.loads["c"] == 1, "what the engine stored after the reset is not restored"
    c = engines(geo, a.store, budget=2 * bs)  # another engine, of the old epoch: none of it
    c.run({0: [make_request("d", second + prompts(25, 9)[0], geo)]})
    assert max(x.computed + (x.answer[0] or 0) for x in c.asks if x.req_id == "d") <= len(first)


@_geo(list(GEOMETRIES))
def test_a_failed_load_restores_the_deepest_boundary_short_of_what_failed(engines: Engines,
                                                                           geo: Geometry) -> None:
    """Issue 46: a load that failed for a reason that leaves its objects in the store (a
    timeout, a store error, a byte that failed verification and could not be removed) was
    looked up again at the same depth and failed again. The workers now say how deep the
    request may still restore (short of the first object that failed), and vLLM's next ask is
    answered the longest boundary published no deeper than that: here the boundary of two
    blocks, after a load of four failed at its third block."""
    bs = geo.block_size
    first = prompts(51, 4 * bs + 5)[0]
    a = engines(geo, budget=bs)  # a boundary at every block
    a.run({0: [make_request("a", first, geo)]})
    b = engines(geo, a.store, budget=bs, extra={"restore_in_step": False})
    b.fail_loads["b"] = 2 * bs
    b.run({0: [make_request("b", first + prompts(52, 9)[0], geo)]})
    hits = [x.computed + x.answer[0] for x in b.asks if x.req_id == "b" and x.answer[0]]
    assert len(hits) == 2 and hits[0] >= 4 * bs and hits[1] == 2 * bs, hits
    assert b.loads["b"] == 2
