"""Chat and agent sessions through the OpenAI chat endpoint: what each turn restores and its TTFT,
turns served by two servers over one store against one server's own prefix cache.

    python bench/conversations.py [--sessions 8] [--turns 6] [--concurrency 8] [--template both]
        [--profile gdn-hybrid] [--capture steps] [--seed 0] [--store local|redis]
        [--redis-delay-ms 0] [--restore-when faster] [--connector-path OTHER/src] [--workdir DIR]

Why: a conversation sends, turn after turn, the previous prompt, often the previous answer,
and a new message. Where turns land on servers without session affinity (a load balancer),
only a shared store can give a turn what the previous one computed; it is worth running if the
turn then starts about as soon as on a server that kept the session in its own prefix cache.

Sessions (``--sessions``, each ``--turns`` turns): a system prompt of 100-300 tokens; each
turn adds one message of 300-2000 tokens (turn 1 the user's task, later turns a tool's output)
and generates an answer of 50-400 tokens (``max_tokens`` with ``ignore_eos``: each turn's
length is fixed by the seed, whatever the model samples). Two templates, each with sessions
of its own (same lengths, other words, so that no template hits the other's prompts):

- ``keep``: the next turn's messages keep the previous answer (an assistant message);
- ``drop``: they keep the assistant message with its reasoning left out, as Qwen3's template
  renders earlier turns; here the whole answer counts as reasoning, so the message is empty
  (its header stays: the previous prompt, generation prompt included, is still a prefix of
  the next one; a template that left out the whole message would part before that end).

Servers on loopback (the tiny random models of ``prefixvault.scenarios.models``, whose
positions are extended with ``--hf-overrides`` to fit a whole session): the *own* server,
plain vLLM with its own prefix cache, serves every turn of every session (the reference);
the *store pair*, two ``prefixvault serve`` servers (kv_both) over one store (a local directory,
or with ``--store redis`` a Valkey server behind a loopback proxy that adds ``--redis-delay-ms``
to every round trip; ``--restore-when`` sets their ``restore_when``), serves the
same turns alternately (turn 1 on the first, turn 2 on the second, ...), so the previous
turn's work comes from the store (a server's own cache holds only what it computed two turns
before). Each turn, the own server serves it for all sessions (``--concurrency``
in flight), then the pair serves the same messages: the answers the next turn keeps are the
own server's, so both sides see the same prompts. Requests stream (TTFT: the first generated
token's chunk, from the request's send), greedy; every server reserves the same CPUs.

Per template and turn (means over sessions): prompt tokens; tokens restored (the response's
``usage.prompt_tokens_details.cached_tokens``: vLLM's own hit plus the store's); tokens
recomputed that the previous turn had computed: the common token prefix of this turn's
prompt with what that side's previous turn ran through the model (its prompt and its answer
but the last token, which was sampled and never run), less the tokens restored, at least 0
(bench/turns.py measures the same on vLLM's scheduler alone); TTFT on each side and their
ratio (goal: store pair / own <= ``GOAL`` on every turn); and how many sessions' answers
(token ids) equal the own server's.

Answers are compared, not asserted: bit-identity is expected only where both runs' steps end
at the same boundaries. The store restores to the previous prompt's exact end while vLLM's
own cache stops at a block boundary, so the two compute the rest in other chunks, whose sums
round otherwise on vLLM CPU; an answer may then part, legitimately (tests/test_vllm_turns.py
checks restores against a cold run whose steps end where the restore did).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.scenarios.engine import common_prefix

TEMPLATES = ("keep", "drop")
#: Lengths in tokens (inclusive ranges).
SYSTEM = (100, 300)
MESSAGE = (300, 2000)
ANSWER = (50, 400)
#: Store pair TTFT over own-cache TTFT, at most, on every turn.
GOAL = 1.2
NAME = "conv"
#: The pair's cost estimates reported (``vllm:prefixvault_estimate_*``), at the end.
ESTIMATES = ("compute_us_per_token", "step_us", "lookup_us", "restore_us", "restore_in_step_us")
#: Words the sessions are written in (each one or a few tokens of the test tokenizer).
WORDS = ("the", "file", "line", "value", "error", "result", "table", "query", "user", "time", "number",
         "list", "name", "open", "read", "write", "check", "run", "test", "build", "path", "step",
         "first", "next", "last", "new", "old", "small", "large", "fast", "slow", "and", "or", "not",
         "with", "from", "to", "of", "in", "on", "at", "for", "by", "is", "was", "will", "can", "should",
         "we", "it", "this", "that", "code", "data", "model", "answer", "question", "task", "tool", "call")


@dataclass(frozen=True)
class Turn:
    message: int  # tokens of the message this turn adds
    answer: int  # tokens it generates (max_tokens, ignore_eos)


@dataclass(frozen=True)
class Session:
    system: int  # tokens of its system prompt
    turns: tuple[Turn, ...]


def plan(sessions: int, turns: int, seed: int) -> list[Session]:
    """Every session's lengths, from ``seed`` alone."""
    out = []
    for i in range(sessions):
        rng = random.Random(f"{seed}/{i}")
        out.append(Session(rng.randint(*SYSTEM),
                           tuple(Turn(rng.randint(*MESSAGE), rng.randint(*ANSWER)) for _ in range(turns))))
    return out


def words(rng: random.Random, tokens: int, cost: Callable[[str], int]) -> str:
    """Words until their ``cost`` (tokens, each with its leading space) reaches ``tokens``."""
    out: list[str] = []
    total = 0
    while total < tokens:
        w = rng.choice(WORDS)
        out.append(w)
        total += cost(w)
    return " ".join(out)


@dataclass(frozen=True)
class Texts:
    system: str
    messages: tuple[str, ...]


def texts(session: Session, template: str, index: int, seed: int, cost: Callable[[str], int]) -> Texts:
    """A session's text for ``template``: its own words, the plan's lengths."""
    rng = random.Random(f"{seed}/{template}/{index}")
    return Texts(words(rng, session.system, cost), tuple(words(rng, t.message, cost) for t in session.turns))


def conversation(t: Texts, answers: Sequence[str], template: str) -> list[dict[str, str]]:
    """The messages of turn ``len(answers) + 1``: the system prompt, each earlier turn's message
    and its answer (``keep``; ``drop``: an empty one, all of it reasoning), then this turn's
    message. Turn 1's message is the user's, later ones a tool's output."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, not {template!r}")
    n = len(answers)
    out = [{"role": "system", "content": t.system}]
    for i in range(n + 1):
        out.append({"role": "user", "content": t.messages[i]} if i == 0 else
                   {"role": "tool", "tool_call_id": f"call_{i}", "content": t.messages[i]})
        if i < n:
            out.append({"role": "assistant", "content": answers[i] if template == "keep" else ""})
    return out


def recomputed(prompt: Sequence[int], previous_prompt: Sequence[int], previous_answer: Sequence[int],
               cached: int) -> int:
    """Tokens of ``prompt`` that the previous turn ran through the model (its prompt and its answer
    but the last token, sampled and never run) and this turn computes again."""
    ran = [*previous_prompt, *previous_answer[:-1]]
    return max(0, common_prefix(prompt, ran) - cached)


@dataclass
class Reply:
    prompt: list[int] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    ttft: float = 0.0  # seconds


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> Reply:
    """One greedy streamed chat request: its prompt and answer token ids, text, cached tokens, TTFT."""
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out = Reply()
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            out.prompt = chunk.get("prompt_token_ids") or out.prompt
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and not out.answer:
                    out.ttft = time.perf_counter() - start
                out.answer += ids
                out.text += (choice.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage")
            if usage:
                out.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if len(out.answer) != max_tokens or not out.prompt:
        raise RuntimeError(f"{url}: {len(out.answer)} of {max_tokens} tokens, prompt {len(out.prompt)}")
    return out


@dataclass
class Side:
    """One side's replies, session by session, turn by turn."""

    replies: list[list[Reply]]

    def row(self, turn: int) -> dict[str, float]:
        now = [s[turn] for s in self.replies]
        again = [recomputed(s[turn].prompt, s[turn - 1].prompt, s[turn - 1].answer, s[turn].cached) if turn
                 else 0 for s in self.replies]
        n = len(now)
        return {"restored": round(sum(r.cached for r in now) / n, 1), "recomputed": round(sum(again) / n, 1),
                "ttft_ms": round(1000 * sum(r.ttft for r in now) / n, 1)}


def serve_all(url: str, pool: ThreadPoolExecutor, requests: list[tuple[list[dict[str, str]], int]]
              ) -> list[Reply]:
    return list(pool.map(lambda r: stream_chat(url, *r), requests))


Rows = list[dict[str, Any]]


def decisions(url: str) -> dict[str, float]:
    """A pair server's lookup judgments and misses so far, by judgment and by reason."""
    from prefixvault.scenarios.servers import metric_by_label

    judged = metric_by_label(url, "vllm:prefixvault_restore_judgments_total", "judgment")
    missed = metric_by_label(url, "vllm:prefixvault_lookup_misses_total", "reason")
    return {**{f"judged_{k}": v for k, v in judged.items()}, **{f"miss_{k}": v for k, v in missed.items()}}


def estimates(url: str) -> dict[str, float]:
    """A pair server's cost estimates (``vllm:prefixvault_estimate_*``) as it reports them now."""
    from prefixvault.scenarios.servers import metric

    return {k: metric(url, f"vllm:prefixvault_estimate_{k}") for k in ESTIMATES}


def run_template(template: str, sessions: list[Session], cost: Callable[[str], int], own: str,
                 pair: Sequence[str], args: argparse.Namespace) -> tuple[Rows, Rows]:
    """Every turn of ``template``'s sessions on both sides; its rows and the answers that part."""
    session_texts = [texts(s, template, i, args.seed, cost) for i, s in enumerate(sessions)]
    mine, theirs = Side([[] for _ in sessions]), Side([[] for _ in sessions])
    rows: Rows = []
    parted: Rows = []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):
            requests = [(conversation(t, [r.text for r in mine.replies[i]], template), s.turns[turn].answer)
                        for i, (s, t) in enumerate(zip(sessions, session_texts, strict=True))]
            before = decisions(pair[turn % 2])
            estimated = estimates(pair[turn % 2])
            for side, url in ((mine, own), (theirs, pair[turn % 2])):
                for i, reply in enumerate(serve_all(url, pool, requests)):
                    side.replies[i].append(reply)
            after = decisions(pair[turn % 2])
            got, want = [s[turn] for s in theirs.replies], [s[turn] for s in mine.replies]
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                if a.prompt != b.prompt:
                    raise RuntimeError(f"{template} turn {turn + 1} session {i}: the sides' prompts differ")
                if a.answer != b.answer:
                    parted.append({"template": template, "turn": turn + 1, "session": i,
                                   "from_token": common_prefix(a.answer, b.answer), "of": len(b.answer),
                                   "restored": {"store": a.cached, "own": b.cached}})
            store, ref = theirs.row(turn), mine.row(turn)
            ratio = round(store["ttft_ms"] / ref["ttft_ms"], 3) if ref["ttft_ms"] else None
            rows.append({"template": template, "turn": turn + 1,
                         "prompt": round(sum(len(r.prompt) for r in want) / len(want), 1),
                         "store": store, "own": ref,
                         "ttft_ratio": ratio,
                         "answers_equal": sum(a.answer == b.answer for a, b in zip(got, want, strict=True)),
                         "sessions": len(sessions),
                         "store_decisions": {k: v - before.get(k, 0) for k, v in after.items()
                                             if v != before.get(k, 0)},
                         "store_estimates_before": estimated})
            print(f"  {template} turn {turn + 1} done", flush=True)
    return rows, parted


def max_model_len(sessions: list[Session], block: int) -> int:
    """Room for the longest session whole, its answers re-tokenized at up to twice their length."""
    need = max(s.system + sum(t.message + 2 * t.answer + 16 for t in s.turns) for s in sessions) + 256
    return max(4096, -(-need // block) * block)


def warm(urls: Sequence[str], cost: Callable[[str], int]) -> None:
    """A request on every server before any is timed (first-request costs), sharing no prefix."""
    rng = random.Random("warm-up")
    for url in urls:
        stream_chat(url, [{"role": "user", "content": "warm up " + words(rng, 300, cost)}], 8)


@contextmanager
def shared_store(args: argparse.Namespace, work: Path) -> Iterator[str]:
    """The pair's store URL: a local directory, or Valkey behind a link adding ``--redis-delay-ms``."""
    if args.store != "redis":
        yield f"local://{work}/store?capacity=8GiB"
        return
    from prefixvault.scenarios.netfault import SlowLink
    from prefixvault.scenarios.valkey import Valkey

    valkey = Valkey()
    link = SlowLink(valkey.port, args.redis_delay_ms / 1000)
    try:
        yield f"redis://127.0.0.1:{link.port}/0?prefix=conv:&timeout=5"
    finally:
        link.close()
        valkey.stop()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from prefixvault.scenarios.models import build_model, engine_kwargs
    from prefixvault.scenarios.servers import metric, metric_by_label, servers
    from prefixvault.serve import engine_flags, serve_command, vllm_command

    sessions = plan(args.sessions, args.turns, args.seed)
    model = build_model(args.profile, work / "model", seed=0)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    costs = {w: len(tok.encode(" " + w).ids) for w in WORDS}
    cost: Callable[[str], int] = costs.__getitem__
    engine = engine_kwargs(args.profile, model)
    engine.pop("model")
    engine.pop("tokenizer", None)
    block = int(engine["block_size"])
    engine["max_model_len"] = max_model_len(sessions, block)
    # The test models have no learned positions: rotary positions simply extend.
    flags = [*engine_flags(engine), "--served-model-name", NAME, "--enable-prompt-tokens-details",
             "--hf-overrides", json.dumps({"max_position_embeddings": engine["max_model_len"]})]
    # vLLM CPU reserves one more core for a server with a KV connector than without one: every
    # server reserves the same, so all run their forward on as many threads.
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}
    if args.connector_path:
        env["PYTHONPATH"] = args.connector_path
    templates = list(TEMPLATES) if args.template == "both" else [args.template]
    rows: list[dict[str, Any]] = []
    parted: list[dict[str, Any]] = []
    started = time.perf_counter()
    with shared_store(args, work) as store:
        commands = [([*vllm_command(str(model)), *flags], work / "own.log"),  # flags: prefix caching, align
                    *((serve_command(str(model), store, "kv_both", capture=args.capture, extra=flags,
                                     restore_when=args.restore_when),
                       work / f"store{i}.log") for i in range(2))]
        with servers(commands, env) as urls:
            print(f"servers up in {time.perf_counter() - started:.0f} s", flush=True)
            own, pair = urls[0], urls[1:]
            warm(urls, cost)
            for template in templates:
                got, apart = run_template(template, sessions, cost, own, pair, args)
                rows += got
                parted += apart
            names = ("hit_tokens", "records_published", "save_dropped", "save_errors", "lookup_errors",
                     "load_failures")
            counters: dict[str, Any] = {
                "pair": {k: sum(metric(u, f"vllm:prefixvault_{k}_total") for u in pair) for k in names},
                "preemptions": {side: sum(metric(u, "vllm:num_preemptions_total") for u in us)
                                for side, us in (("own", [own]), ("pair", pair))}}
            for name, label in (("lookup_misses", "reason"), ("restore_judgments", "judgment")):
                summed: dict[str, float] = {}
                for u in pair:
                    for k, v in metric_by_label(u, f"vllm:prefixvault_{name}_total", label).items():
                        summed[k] = summed.get(k, 0.0) + v
                counters["pair"][name] = summed
            counters["pair"]["estimates"] = [estimates(u) for u in pair]
    ratios = [r["ttft_ratio"] for r in rows if r["ttft_ratio"] is not None]
    return {"profile": args.profile, "sessions": args.sessions, "turns": args.turns,
            "concurrency": args.concurrency, "seed": args.seed, "capture": args.capture, "store": args.store,
            "redis_delay_ms": args.redis_delay_ms if args.store == "redis" else None,
            "restore_when": args.restore_when or "default",
            "block_size": block, "max_num_batched_tokens": engine["max_num_batched_tokens"],
            "max_model_len": engine["max_model_len"], "lengths": {"system": SYSTEM, "message": MESSAGE,
                                                                  "answer": ANSWER},
            "rows": rows, "goal_ttft_ratio": GOAL,
            "goal_met": bool(ratios) and all(r <= GOAL for r in ratios),
            "worst_ttft_ratio": max(ratios, default=None),
            "answers_equal": sum(r["answers_equal"] for r in rows),
            "answers": sum(r["sessions"] for r in rows), "answers_parted": parted, **counters,
            "bench_s": round(time.perf_counter() - started, 1)}


def table(out: dict[str, Any]) -> str:
    head = (f"{'template':8} {'turn':>4} {'prompt':>7} {'restored':>17} {'recomputed':>17} "
            f"{'TTFT ms':>17} {'ratio':>6} {'answers':>8}")
    sub = f"{'':8} {'':>4} {'':>7}" + f" {'store':>8} {'own':>8}" * 3 + f" {'':>6} {'equal':>8}"
    lines = [head, sub]
    for r in out["rows"]:
        s, o = r["store"], r["own"]
        ratio = f"{r['ttft_ratio']:.2f}" if r["ttft_ratio"] is not None else "-"
        flag = "!" if r["ttft_ratio"] is not None and r["ttft_ratio"] > GOAL else " "
        lines.append(f"{r['template']:8} {r['turn']:>4} {r['prompt']:>7.0f} {s['restored']:>8.0f} "
                     f"{o['restored']:>8.0f} {s['recomputed']:>8.0f} {o['recomputed']:>8.0f} "
                     f"{s['ttft_ms']:>8.0f} {o['ttft_ms']:>8.0f} {ratio:>5}{flag} "
                     f"{r['answers_equal']:>4}/{r['sessions']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8, help="sessions in flight per turn")
    p.add_argument("--template", choices=[*TEMPLATES, "both"], default="both")
    p.add_argument("--profile", default="gdn-hybrid")
    p.add_argument("--capture", default="steps", help="the pair's capture policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", choices=["local", "redis"], default="local", help="the store the pair shares")
    p.add_argument("--redis-delay-ms", type=float, default=0.0, help="added to every Valkey round trip")
    p.add_argument("--restore-when", default="", help="the pair's restore_when (default: the connector's)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (vLLM CPU)")
    p.add_argument("--connector-path", default="",
                   help="a checkout's src/ the servers import prefixvault from (another version)")
    p.add_argument("--workdir", default="", help="keep the model, store and servers' logs here")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.turns < 1 or args.concurrency < 1:
        p.error("--sessions, --turns and --concurrency must be at least 1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="prefixvault-conversations-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work: {work}", flush=True)
    out = run(args, work)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(table(out))
    print(f"store pair / own TTFT at most {GOAL} on every turn: {out['goal_met']} "
          f"(worst {out['worst_ttft_ratio']}); answers equal to the own server's: "
          f"{out['answers_equal']}/{out['answers']}; pair: {out['pair']}")
    for d in out["answers_parted"]:
        print(f"  parted: {d['template']} turn {d['turn']} session {d['session']} from token "
              f"{d['from_token']} of {d['of']} (restored: store {d['restored']['store']}, "
              f"own {d['restored']['own']})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
