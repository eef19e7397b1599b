"""Drive one vLLM engine step by step with requests that arrive while others run.

Why: one request at a time, every prefill chunk of a hybrid model in align mode starts and
ends on a block boundary. Under load the scheduler splits the token budget between
requests, so chunks start and end elsewhere, and the engine offers states at boundaries
strictly inside a chunk. Serving order decides which; this driver makes it repeatable: a
client keeps at most ``concurrency`` requests in flight (like vLLM's benchmark client with
``--max-concurrency``), each request waits a seeded random number of engine steps after a
slot frees, and every step's schedule is recorded.

Runs as ``python -m prefixvault.scenarios.staggered SPEC.json OUT.json`` (one engine per
process, in-process engine core so that the schedule can be read).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.scenarios.engine import (
    Completion,
    EngineSpec,
    completion_of,
    completions,
    connector_metrics,
    kv_transfer_config,
    run_engine,
)
from prefixvault.scenarios.enginehost import finish


@dataclass
class Arrivals:
    """How requests reach the engine: at most ``concurrency`` in flight, each after a
    random wait of 0..``max_wait`` engine steps once a slot is free (seeded)."""

    concurrency: int = 1
    max_wait: int = 0
    seed: int = 0
    #: Re-run ``VllmConfig.__post_init__`` once the engine is built, as every multiprocess
    #: engine core does after its start-up handshake: on CPU that resets the scheduler's
    #: ``block_size`` to 128 unless it was given (see prefixvault.vllm.alignment).
    as_server: bool = False


@dataclass
class Chunk:
    """Request ``req`` computed tokens [start, start + tokens) in engine step ``step``."""

    step: int
    req: int
    start: int
    tokens: int


@dataclass
class Offer:
    """In step ``step`` the engine offered group ``group``'s state at ``tokens`` for ``req``."""

    step: int
    req: int
    group: int
    tokens: int


@dataclass
class StaggeredRun:
    completions: list[Completion]
    chunks: list[Chunk] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    block_size: int = 0  # of the engine's KV cache groups

    def chunk_ends(self, req: int) -> set[int]:
        """Token counts at which request ``req``'s chunks ended."""
        return {c.start + c.tokens for c in self.chunks if c.req == req}

    def mid_block_chunk_ends(self, prompt_lens: Sequence[int]) -> list[Chunk]:
        """Prefill chunks that stopped before the prompt's end, off a block boundary."""
        return [c for c in self.chunks
                if c.start + c.tokens < prompt_lens[c.req] and (c.start + c.tokens) % self.block_size]

    def offers_inside_chunks(self) -> list[Offer]:
        """Offers for a boundary strictly inside the chunk their request computed that step."""
        chunk = {(c.step, c.req): c for c in self.chunks}
        return [o for o in self.offers if (c := chunk.get((o.step, o.req))) is not None
                and c.start < o.tokens < c.start + c.tokens]


def _req(request_id: str) -> int:
    """The prompt index of an engine request id (vLLM appends a random suffix)."""
    return int(request_id.split("-", 1)[0])


def _record_schedule(llm: Any, chunks: list[Chunk], offers: list[Offer]) -> None:
    """Wrap the in-process scheduler so that every step's chunks and offers are kept."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    take_offers = scheduler.kv_cache_manager.take_boundary_state_offloads
    step = [0]

    def recording(*args: Any, **kwargs: Any) -> Any:
        step[0] += 1
        out = schedule(*args, **kwargs)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            chunks.append(Chunk(step[0], _req(req_id), int(starts[req_id]), int(n)))
        return out

    def recording_offers() -> Any:
        taken = take_offers()
        for req_id, entries in taken.items():
            for group, _block, tokens in entries:
                offers.append(Offer(step[0], _req(req_id), int(group), int(tokens)))
        return taken

    scheduler.schedule = recording
    scheduler.kv_cache_manager.take_boundary_state_offloads = recording_offers


def run(spec: EngineSpec, arrivals: Arrivals) -> StaggeredRun:
    from vllm import LLM, SamplingParams

    kwargs = dict(spec.engine, model=spec.model)
    ktc = kv_transfer_config(spec)
    if ktc is not None:
        kwargs["kv_transfer_config"] = ktc
        kwargs.setdefault("disable_log_stats", False)
    llm = LLM(**kwargs)
    if arrivals.as_server:
        llm.llm_engine.vllm_config.__post_init__()
    chunks: list[Chunk] = []
    offers: list[Offer] = []
    _record_schedule(llm, chunks, offers)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, logprobs=spec.logprobs,
                            ignore_eos=True)
    salts = spec.salts or [""] * len(spec.prompts)
    rng = random.Random(arrivals.seed)
    waits = [rng.randint(0, arrivals.max_wait) for _ in spec.prompts]
    results: dict[int, Completion] = {}
    queued, in_flight, step, ready_at = 0, 0, 0, 0
    while len(results) < len(spec.prompts):
        while queued < len(spec.prompts) and in_flight < arrivals.concurrency and step >= ready_at:
            prompt: dict[str, Any] = {"prompt_token_ids": spec.prompts[queued]}
            if salts[queued]:
                prompt["cache_salt"] = salts[queued]
            engine.add_request(str(queued), prompt, params)
            queued += 1
            in_flight += 1
            ready_at = step + (waits[queued] if queued < len(waits) else 0)
        for r in engine.step():
            if not r.finished:
                continue
            results[_req(r.request_id)] = completion_of(r)
            in_flight -= 1
            ready_at = max(ready_at, step + (waits[queued] if queued < len(waits) else 0))
        step += 1
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return StaggeredRun([results[i] for i in range(len(spec.prompts))], chunks, offers,
                        connector_metrics(llm), int(groups[0].kv_cache_spec.block_size))


def load(out: dict[str, Any]) -> StaggeredRun:
    return StaggeredRun(completions(out), [Chunk(**c) for c in out["chunks"]],
                        [Offer(**o) for o in out["offers"]], dict(out.get("metrics", {})),
                        int(out.get("block_size", 0)))


def run_staggered(spec: EngineSpec, arrivals: Arrivals, workdir: Path,
                  env: Mapping[str, str] | None = None, timeout: float = 900) -> StaggeredRun:
    """Run ``spec`` under ``arrivals`` in a fresh process (see scenarios.engine.run_engine)."""
    out = run_engine(spec, workdir, env=env, timeout=timeout, module="prefixvault.scenarios.staggered",
                     extra={"arrivals": asdict(arrivals)})
    return load(out)


def main(argv: Sequence[str]) -> None:
    raw = json.loads(Path(argv[0]).read_text())
    arrivals = Arrivals(**raw.pop("arrivals"))
    result = run(EngineSpec(**raw), arrivals)
    Path(argv[1]).write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    main(sys.argv[1:])
    finish(0)  # a fresh process too: its output is written, its teardown would only cost time
