"""Request traces for the policy simulator, generated from documented parameters.

Every trace is a list of ``Request`` in arrival order: token ids of the prompt and of the
answer the model gives (the next turn of a conversation sends both back). Token ids are
random, drawn from a seeded generator, so traces are reproducible and share exactly the
prefixes the workload says they share. Lengths are log-normal (median, sigma), as prompt
and answer lengths in public chat traces are (ShareGPT, LMSYS-Chat-1M, BurstGPT: heavy right
tail, medians of a few hundred tokens); think times exponential.

Workloads (parameters are the dataclass defaults below):

- ``chat``: conversations arrive as a Poisson process; each has a geometric number of turns
  (mean 4, at most 10); turn n sends turn n-1's prompt + answer + a new user message, after
  a think time of mean 30 s. No shared system prompt: reuse is the conversation itself.
- ``fewshot``: single-turn requests over 8 long system prompts with few-shot examples
  (median 3000 tokens), picked with Zipf popularity (s=1.1), each followed by a fresh
  question (median 150): reuse is the shared system prompt.
- ``agent``: agentic loops: a tool-spec system prompt shared by all sessions of one of 3
  agents (median 2500 tokens), a task, then steps (mean 8) that each append the model's
  action (its answer) and a long tool output (median 1500 tokens): every step resends the
  whole loop so far.
- ``unique``: the no-sharing control: every prompt distinct, nothing repeats.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

VOCAB = (1000, 150000)


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds since the trace began
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    session: int  # conversation / agent loop / request number


@dataclass
class Lengths:
    """A log-normal length: median and sigma of its logarithm, clipped to [lo, hi]."""

    median: float
    sigma: float = 0.8
    lo: int = 8
    hi: int = 32768

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, rng.lognormvariate(math.log(self.median), self.sigma))))


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*VOCAB) for _ in range(n))


@dataclass
class Chat:
    sessions_per_s: float = 1.0
    mean_turns: float = 4.0
    max_turns: int = 10
    first: Lengths = field(default_factory=lambda: Lengths(400))
    message: Lengths = field(default_factory=lambda: Lengths(150))
    answer: Lengths = field(default_factory=lambda: Lengths(300, 0.7, 16, 2048))
    think_s: float = 30.0


@dataclass
class FewShot:
    requests_per_s: float = 4.0
    prompts: int = 8
    zipf_s: float = 1.1
    system: Lengths = field(default_factory=lambda: Lengths(3000, 0.4))
    question: Lengths = field(default_factory=lambda: Lengths(150))
    answer: Lengths = field(default_factory=lambda: Lengths(200, 0.7, 16, 2048))


@dataclass
class Agent:
    sessions_per_s: float = 0.5
    agents: int = 3
    mean_steps: float = 8.0
    max_steps: int = 20
    system: Lengths = field(default_factory=lambda: Lengths(2500, 0.3))
    task: Lengths = field(default_factory=lambda: Lengths(200))
    action: Lengths = field(default_factory=lambda: Lengths(100, 0.6, 8, 1024))
    tool: Lengths = field(default_factory=lambda: Lengths(1500, 1.0, 16, 16384))
    tool_s: float = 5.0


@dataclass
class Unique:
    requests_per_s: float = 4.0
    prompt: Lengths = field(default_factory=lambda: Lengths(1500, 0.8))
    answer: Lengths = field(default_factory=lambda: Lengths(200, 0.7, 16, 2048))


def _geometric(rng: random.Random, mean: float, cap: int) -> int:
    p = 1.0 / mean
    n = 1
    while n < cap and rng.random() > p:
        n += 1
    return n


def _merge(sessions: list[list[Request]], n: int) -> list[Request]:
    """The first ``n`` requests of all sessions, in arrival order."""
    out = list(heapq.merge(*sessions, key=lambda r: r.arrival))
    return out[:n]


def chat(n: int, seed: int, p: Chat | None = None) -> list[Request]:
    p, rng = p or Chat(), random.Random(seed)
    sessions: list[list[Request]] = []
    t, total = 0.0, 0
    while total < n:
        t += rng.expovariate(p.sessions_per_s)
        context: tuple[int, ...] = ()
        at, turns = t, []
        for turn in range(_geometric(rng, p.mean_turns, p.max_turns)):
            prompt = context + _tokens(rng, (p.first if turn == 0 else p.message).draw(rng))
            output = _tokens(rng, p.answer.draw(rng))
            turns.append(Request(at, prompt, output, len(sessions)))
            context = prompt + output
            at += rng.expovariate(1.0 / p.think_s)
        sessions.append(turns)
        total += len(turns)
    return _merge(sessions, n)


def fewshot(n: int, seed: int, p: FewShot | None = None) -> list[Request]:
    p, rng = p or FewShot(), random.Random(seed)
    systems = [_tokens(rng, p.system.draw(rng)) for _ in range(p.prompts)]
    weights = [1.0 / (i + 1) ** p.zipf_s for i in range(p.prompts)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(p.requests_per_s)
        system = rng.choices(systems, weights)[0]
        prompt = system + _tokens(rng, p.question.draw(rng))
        out.append(Request(t, prompt, _tokens(rng, p.answer.draw(rng)), i))
    return out


def agent(n: int, seed: int, p: Agent | None = None) -> list[Request]:
    p, rng = p or Agent(), random.Random(seed)
    systems = [_tokens(rng, p.system.draw(rng)) for _ in range(p.agents)]
    sessions: list[list[Request]] = []
    t, total = 0.0, 0
    while total < n:
        t += rng.expovariate(p.sessions_per_s)
        context = rng.choice(systems) + _tokens(rng, p.task.draw(rng))
        at, steps = t, []
        for _ in range(_geometric(rng, p.mean_steps, p.max_steps)):
            action = _tokens(rng, p.action.draw(rng))
            steps.append(Request(at, context, action, len(sessions)))
            context = context + action + _tokens(rng, p.tool.draw(rng))
            at += rng.expovariate(1.0 / p.tool_s)
        sessions.append(steps)
        total += len(steps)
    return _merge(sessions, n)


def unique(n: int, seed: int, p: Unique | None = None) -> list[Request]:
    p, rng = p or Unique(), random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(p.requests_per_s)
        out.append(Request(t, _tokens(rng, p.prompt.draw(rng)), _tokens(rng, p.answer.draw(rng)), i))
    return out


WORKLOADS: dict[str, Callable[[int, int], list[Request]]] = {
    "chat": chat, "fewshot": fewshot, "agent": agent, "unique": unique}
