"""Shared pieces of the vLLM end-to-end tests: the seed scenario's prompts and engine runs."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixvault.scenarios import scenario
from prefixvault.scenarios.engine import (
    Completion,
    EngineSpec,
    common_prefix,
    completions,
    identical,
    max_logprob_diff,
    run_engine,
)
from prefixvault.scenarios.models import build_model, consumer_prompt, engine_kwargs, producer_prompt

CODE = "HYBRID-528-GDN"
SUPPORT = str(Path(__file__).parent)
#: max_num_batched_tokens per profile: two blocks where the model allows it, so that some
#: block boundaries get no state (as in the report); Mamba2 on CPU needs one block per step.
BATCHED = {"gdn-hybrid": 512, "shortconv-hybrid": 512, "mamba2": 256, "mamba2-hybrid": 256}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # scheduler and worker in one process: fast start


@dataclass
class Case:
    name: str
    tokens: list[int]
    expected_hit: int


@dataclass
class Seed:
    profile: str
    model: str
    engine: dict[str, Any]
    producer: list[int]
    cases: list[Case]
    block_size: int
    batched: int


def _tokenize(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model)).encode(text))


def make_seed(profile: str, root: Path) -> Seed:
    model = build_model(profile, root / profile, seed=0)
    engine = engine_kwargs(profile, model)
    engine.pop("model")
    bs = int(engine["block_size"])
    batched = BATCHED[profile]
    engine["max_num_batched_tokens"] = batched
    producer = _tokenize(model, producer_prompt(CODE, 430, varied=True))
    captured = scenario.captured(len(producer), batched, bs)
    cases = []
    shapes = {
        # shares ~1290 tokens: the last shared block boundary (1280) has a state only if
        # every block is a step end; with two-block steps the hit falls back to 1024
        "crosses-no-state": _tokenize(model, consumer_prompt(CODE, 315, varied=True)),
        # shares ~1590 tokens: the last shared block boundary (1536) is the checkpoint
        "crosses-state": _tokenize(model, consumer_prompt(CODE, 390, varied=True)),
        "fully-covered": list(producer),
        "ends-on-boundary": producer[:1536],
    }
    for name, toks in shapes.items():
        hit = scenario.expected_hit(captured, len(toks), common_prefix(producer, toks), bs)
        # The scenario is chosen so that the restored run can be bit-identical to cold.
        assert scenario.restores_exactly(hit, len(toks), batched, bs), (profile, name, hit)
        cases.append(Case(name, toks, hit))
    return Seed(profile, str(model), engine, producer, cases, bs, batched)


def spec(seed: Seed, role: str, prompts: list[list[int]], salts: list[str], store: str = "",
          **kw: Any) -> EngineSpec:
    return EngineSpec(model=seed.model, engine=dict(seed.engine), prompts=prompts, role=role,
                      store=store, salts=salts, **kw)


def run_result(seed: Seed, engine_spec: EngineSpec, workdir: Path, env: dict[str, str] | None = None
               ) -> dict[str, Any]:
    """What ``scenarios.engine`` reports of the run (in-process unless ``env`` says otherwise)."""
    merged = {**IN_PROCESS, "PYTHONPATH": SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""),
              **(env or {})}
    return run_engine(engine_spec, workdir / seed.profile, env=merged, timeout=600)


def run_with_metrics(seed: Seed, engine_spec: EngineSpec, workdir: Path, env: dict[str, str] | None = None
                     ) -> tuple[list[Completion], dict[str, float]]:
    """The engine's completions and the connector's counters (see scenarios.engine)."""
    out = run_result(seed, engine_spec, workdir, env)
    metrics: dict[str, float] = out.get("metrics", {})
    return completions(out), metrics


def run(seed: Seed, engine_spec: EngineSpec, workdir: Path, env: dict[str, str] | None = None
        ) -> list[Completion]:
    return run_with_metrics(seed, engine_spec, workdir, env)[0]


def check(seed: Seed, cold: list[Completion], got: list[Completion]) -> None:
    problems: list[str] = []
    for case, c, g in zip(seed.cases, cold, got, strict=True):
        if g.cached_tokens != case.expected_hit:
            problems.append(f"{case.name}: restored {g.cached_tokens}, expected {case.expected_hit}")
        if not identical(c, g):
            problems.append(f"{case.name}: differs from cold (ids {c.token_ids} vs {g.token_ids}, "
                            f"max |dlogprob| {max_logprob_diff(c, g):.3g})")
    assert not problems, f"{seed.profile}: " + "; ".join(problems)


class SeedRuns:
    """The seed scenario's models, built once, and their cold runs, computed once, for the
    whole test session: many modules compare against the same cold completions, and each cold
    engine costs 10-15 s here.

    A cold run takes its requests one at a time (``EngineSpec.sequential``), each with a cache
    salt of its own, so nothing
    one request computed is reused by another: a request's completion does not depend on which
    others ran beside it. One cold run of every case therefore serves each test that asks for
    any of them. The key is the model, the engine arguments and the prompt.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._seeds: dict[str, Seed] = {}
        self._cold: dict[tuple[str, tuple[int, ...]], Completion] = {}

    def seed(self, profile: str) -> Seed:
        """A copy of ``profile``'s seed (tests may trim or change theirs)."""
        if profile not in self._seeds:
            self._seeds[profile] = make_seed(profile, self.root / "models")
        return copy.deepcopy(self._seeds[profile])

    def cold(self, seed: Seed, prompts: list[list[int]]) -> list[Completion]:
        """``prompts``' cold completions on ``seed``'s model and engine arguments."""
        engine = json.dumps([seed.model, seed.engine], sort_keys=True)
        known = self._seeds.get(seed.profile, seed)
        if any((engine, tuple(p)) not in self._cold for p in prompts):
            todo: list[list[int]] = []
            for p in [*prompts, *(c.tokens for c in known.cases)]:  # every case at once: others ask later
                if (engine, tuple(p)) not in self._cold and p not in todo:
                    todo.append(p)
            salts = [f"cold-{i}" for i in range(len(todo))]
            ran = run(seed, spec(seed, "cold", todo, salts), self.root / "cold")
            for p, got in zip(todo, ran, strict=True):
                assert got.cached_tokens == 0, "a cold request reused another's blocks"
                self._cold[(engine, tuple(p))] = got
        return [copy.deepcopy(self._cold[(engine, tuple(p))]) for p in prompts]
