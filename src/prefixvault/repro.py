"""``prefixvault repro``: the seed bug report's protocol, run end to end on one machine.

A cold engine without connector, a producer engine that fills the store, and a separate
consumer engine whose prompt shares a long prefix, each in its own process. The consumer
must give the cold run's tokens and logprobs exactly, and restore the longest boundary
that can truly resume.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.testing import scenario
from prefixvault.testing.engine import (
    Completion,
    EngineSpec,
    common_prefix,
    completions,
    identical,
    max_logprob_diff,
    run_engine,
)

#: Engine arguments for a real checkpoint given with --model (the report's settings).
REAL_MODEL_ENGINE: dict[str, Any] = {
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_model_len": 4096,
}


@dataclass
class ReproConfig:
    profile: str = "gdn-hybrid"
    model: str = ""  # a real checkpoint (local path or hub id); empty: build the profile
    store: str = ""  # empty: a fresh local store in the work directory
    producer_repeats: int = 1000
    consumer_repeats: int = 1000
    code: str = "HYBRID-528-GDN"
    max_tokens: int = 16
    logprobs: int = 5
    max_num_batched_tokens: int = 0  # 0: the profile's default
    tensor_parallel_size: int = 1
    capture: str = "steps"
    workdir: str = ""
    varied: bool = False
    turns: int = 1  # > 1: a conversation; turn n's prompt = turn n-1's prompt + its output + a message
    capture_outputs: bool = False


@dataclass
class ReproResult:
    ok: bool
    model: str
    store: str
    prompt_tokens: dict[str, int]
    common_prefix_tokens: int
    block_size: int
    max_num_batched_tokens: int
    producer_step_ends: list[int]
    longest_resumable_boundary: int
    external_hit_tokens: int
    producer: dict[str, float]
    consumer: dict[str, float]
    cold_text: str
    consumer_text: str
    tokens_equal: bool
    logprobs_equal: bool
    max_abs_logprob_diff: float
    problems: list[str] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)


@dataclass
class TurnResult:
    """One turn of a conversation (``--turns``): what the consumer restored against the
    longest it could have, and whether it matched cold."""

    prompt_tokens: int
    hit: int
    longest: int  # the longest boundary the producer's previous turns published for this prompt
    identical: bool
    max_abs_logprob_diff: float


def _engine_args(cfg: ReproConfig) -> tuple[str, dict[str, Any]]:
    from prefixvault.testing.models import build_model, engine_kwargs

    if cfg.model:
        model, engine = cfg.model, dict(REAL_MODEL_ENGINE)
    else:
        root = Path(cfg.workdir) / "models"
        model = str(build_model(cfg.profile, root / cfg.profile, seed=0))
        engine = engine_kwargs(cfg.profile, model)
        engine.pop("model")
    if cfg.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.tensor_parallel_size > 1:
        engine["tensor_parallel_size"] = cfg.tensor_parallel_size
    return model, engine


def request_pair(cfg: ReproConfig, model: str) -> tuple[list[int], list[int]]:
    """The report's producer and consumer prompts, tokenized as the report does."""
    from transformers import AutoTokenizer

    from prefixvault.testing.models import consumer_prompt, producer_prompt

    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    producer = tok.encode(
        producer_prompt(cfg.code, cfg.producer_repeats, cfg.varied), add_special_tokens=True
    )
    consumer = tok.encode(
        consumer_prompt(cfg.code, cfg.consumer_repeats, cfg.varied), add_special_tokens=True
    )
    return list(producer), list(consumer)


def run_repro(cfg: ReproConfig, progress: Any = None) -> ReproResult:
    """Run cold, producer and consumer engines; compare. ``progress(msg)`` reports steps."""
    say = progress or (lambda msg: None)
    if not cfg.workdir:
        cfg.workdir = tempfile.mkdtemp(prefix="prefixvault-repro-")
    work = Path(cfg.workdir)
    say("building the model and the request pair" if not cfg.model else "loading the tokenizer")
    model, engine = _engine_args(cfg)
    producer, consumer = request_pair(cfg, model)
    store = cfg.store or f"local://{work}/store?capacity=4GiB"
    namespace = f"repro-{time.strftime('%Y%m%d%H%M%S')}-{time.monotonic_ns() % 10**6}"
    extra: dict[str, Any] = {"namespace": namespace, "capture": cfg.capture,
                             "capture_outputs": cfg.capture_outputs}
    env = (
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if cfg.tensor_parallel_size == 1
        else {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(cfg.tensor_parallel_size))}
    )

    def engine_run(role: str, prompt: list[int], more: Sequence[list[int]] = ()
                   ) -> tuple[Completion, dict[str, Any]]:
        spec = EngineSpec(
            model=model,
            engine=dict(engine),
            prompts=[prompt, *more],
            role=role,
            store=store,
            extra_config=extra,
            max_tokens=cfg.max_tokens,
            logprobs=cfg.logprobs,
            conversation=bool(more),
            # A turn's answer is --max-tokens long, whatever the model says: whether a boundary
            # falls inside it must not hang on where a (random test) model happens to stop.
            ignore_eos=bool(more),
        )
        what = f"{1 + len(more)} turns" if more else f"{len(prompt)} prompt tokens"
        say(f"{role} engine: starting (tens of seconds) and running {what}")
        t = time.perf_counter()
        result = run_engine(spec, work / "engines", env=env)
        say(f"{role} engine: done in {time.perf_counter() - t:.0f}s")
        return completions(result)[0], result

    if cfg.turns > 1:
        return _conversation(cfg, model, engine, store, namespace, producer, consumer, engine_run)
    cold, _ = engine_run("cold", consumer)
    _, produced = engine_run("kv_producer", producer)
    restored, consumed = engine_run("kv_consumer", consumer)

    bs = int(produced["block_size"])
    batched = int(produced.get("max_num_batched_tokens") or engine.get("max_num_batched_tokens") or 0)
    common = common_prefix(producer, consumer)
    ends = scenario.schedule(len(producer), batched, bs) if batched else []
    available = (
        scenario.captured(
            len(producer), batched, bs,
            cfg.capture if cfg.capture in ("checkpoints", "marconi", "reuse") else "steps"
        )
        if batched
        else []
    )
    longest = scenario.expected_hit(available, len(consumer), common, bs) if batched else -1
    tokens_equal = cold.token_ids == restored.token_ids
    exact = identical(cold, restored)
    problems = []
    if not tokens_equal:
        problems.append("generated token ids differ from cold")
    elif not exact:
        problems.append("logprobs differ from cold")
    if longest >= 0 and restored.cached_tokens > longest:
        problems.append(
            f"restored {restored.cached_tokens} tokens, beyond the longest resumable boundary {longest}"
        )
    if produced["metrics"].get("put_failed", 0) or consumed["metrics"].get("get_failed", 0):
        problems.append("store operations failed")
    return ReproResult(
        ok=not problems,
        model=model,
        store=store,
        prompt_tokens={"producer": len(producer), "consumer": len(consumer)},
        common_prefix_tokens=common,
        block_size=bs,
        max_num_batched_tokens=batched,
        producer_step_ends=ends,
        longest_resumable_boundary=longest,
        external_hit_tokens=restored.cached_tokens,
        producer=produced["metrics"],
        consumer=consumed["metrics"],
        cold_text=cold.text,
        consumer_text=restored.text,
        tokens_equal=tokens_equal,
        logprobs_equal=exact,
        max_abs_logprob_diff=max_logprob_diff(cold, restored),
        problems=problems,
    )


def _conversation(cfg: ReproConfig, model: str, engine: dict[str, Any], store: str, namespace: str,
                  producer: list[int], consumer: list[int], engine_run: Any) -> ReproResult:
    """``--turns N``: the producer prompt is turn 1; each later turn adds the consumer prompt's
    last 64 tokens as its message. Cold, producer and consumer engines each run the whole
    conversation; each turn's restored tokens are compared with the longest boundary the
    producer's turns published for that turn's prompt (walked in the store, as ``explain``)."""
    from prefixvault.explain import explain
    from prefixvault.stores import open_store

    message = consumer[-64:]
    more = [message] * (cfg.turns - 1)
    _, cold_run = engine_run("cold", producer, more)
    _, produced = engine_run("kv_producer", producer, more)
    _, consumed = engine_run("kv_consumer", producer, more)
    cold_turns, restored_turns = completions(cold_run), completions(consumed)
    prompts = [producer]
    for out in restored_turns[:-1]:
        prompts.append([*prompts[-1], *out.token_ids, *message])
    with open_store(store, existing=True, readonly=True) as s:
        longest = [explain(s, p, namespace).restorable for p in prompts]
    turns: list[TurnResult] = []
    problems: list[str] = []
    for n, (c, r, p, best) in enumerate(zip(cold_turns, restored_turns, prompts, longest, strict=True)):
        same = identical(c, r)
        turns.append(TurnResult(len(p), r.cached_tokens, best, same, max_logprob_diff(c, r)))
        if not same:
            problems.append(f"turn {n + 1} differs from cold")
        if n and r.cached_tokens != best:
            problems.append(f"turn {n + 1} restored {r.cached_tokens} of {best} published tokens")
    last_c, last_r = cold_turns[-1], restored_turns[-1]
    return ReproResult(
        ok=not problems, model=model, store=store,
        prompt_tokens={"producer": len(producer), "consumer": len(prompts[-1])},
        common_prefix_tokens=len(prompts[-2]) if len(prompts) > 1 else 0,
        block_size=int(produced.get("block_size") or 0),
        max_num_batched_tokens=int(produced.get("max_num_batched_tokens") or 0), producer_step_ends=[],
        longest_resumable_boundary=longest[-1], external_hit_tokens=last_r.cached_tokens,
        producer=produced["metrics"], consumer=consumed["metrics"], cold_text=last_c.text,
        consumer_text=last_r.text, tokens_equal=last_c.token_ids == last_r.token_ids,
        logprobs_equal=identical(last_c, last_r), max_abs_logprob_diff=max_logprob_diff(last_c, last_r),
        problems=problems, turns=turns,
    )


def render(result: ReproResult, console: Any) -> None:
    """The report's figures, in the report's terms."""
    from rich.table import Table

    p, c = result.producer, result.consumer
    t = Table(title="prefixvault repro: cold vs producer → store → consumer")
    t.add_column("figure")
    t.add_column("value", overflow="fold")
    rows = [
        ("model", result.model),
        ("store", result.store),
        (
            "producer / consumer / common prefix tokens",
            f"{result.prompt_tokens['producer']} / {result.prompt_tokens['consumer']} / "
            f"{result.common_prefix_tokens}",
        ),
        ("block size / max_num_batched_tokens", f"{result.block_size} / {result.max_num_batched_tokens}"),
        ("producer step ends", ", ".join(map(str, result.producer_step_ends)) or "n/a"),
        (
            "longest resumable boundary",
            str(result.longest_resumable_boundary) if result.longest_resumable_boundary >= 0 else "n/a",
        ),
        ("external hit tokens", str(result.external_hit_tokens)),
        (
            "producer: Put keys / bytes / failed keys",
            f"{p.get('put_keys', 0):.0f} / {p.get('put_bytes', 0):.0f} / {p.get('put_failed', 0):.0f}",
        ),
        ("producer: records published", f"{p.get('records_published', 0):.0f}"),
        (
            "consumer: Get keys / bytes / failed keys",
            f"{c.get('get_keys', 0):.0f} / {c.get('get_bytes', 0):.0f} / {c.get('get_failed', 0):.0f}",
        ),
        ("cold text", repr(result.cold_text)),
        ("consumer text", repr(result.consumer_text)),
        ("generated tokens equal", str(result.tokens_equal)),
        ("per-token logprobs equal (top-k, bit for bit)", str(result.logprobs_equal)),
        ("max |Δlogprob|", f"{result.max_abs_logprob_diff:.6g}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if result.turns:
        tt = Table(title="turns: what the consumer restored against the longest the producer published")
        for col in ("turn", "prompt tokens", "restored", "longest published", "== cold", "max |Δlogprob|"):
            tt.add_column(col)
        for n, turn in enumerate(result.turns, 1):
            tt.add_row(str(n), str(turn.prompt_tokens), str(turn.hit), str(turn.longest) if n > 1 else "-",
                       str(turn.identical), f"{turn.max_abs_logprob_diff:.6g}")
        console.print(tt)
    if result.ok:
        console.print("[green]OK[/]: the consumer matches cold exactly")
    else:
        console.print("[red]DIVERGED[/]: " + "; ".join(result.problems))


def to_json(result: ReproResult) -> str:
    return json.dumps(asdict(result))
