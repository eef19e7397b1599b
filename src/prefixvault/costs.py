"""What a restore costs against computing its tokens, measured while the engine runs.

A restore is worth taking only if it ends sooner than computing the tokens it restores: over a
store far away (a Redis across racks, a store under load) or for a model whose prefill is cheap,
a lookup round trip, a load round trip, the transfer and a step of waiting can cost more than
the prefill they save, and a cache that makes requests slower than no cache is the first thing
an operator turns off. ``RestoreCosts`` keeps these estimates, each from what the engine and
the store did lately, none configured:

- ``compute``: seconds per token of a prefill step whose whole token budget prefills
  (``full_step_s_per_token``: the seconds of steps that mostly prefill over their tokens,
  each an exponential average, a ratio of averages; where the budget and a step with no
  prefill are known, a line through the two, its fixed part spread over the budget (at most
  ``EXTRAPOLATE_AT_MOST`` times the chunks measured), as tokens computed instead of restored
  fill whole steps: short steps, most of their time the step's fixed cost, would otherwise
  make every token look as dear as theirs), times the
  requests that share a step's prefill lately (``sharing``: a request's tokens go through the
  steps at its share of them, so under load computing a token takes that much longer for the
  request that waits for it). A step's seconds count without the time it spent on
  synchronous loads, written or not (``loaded_in_step``): on an engine that restores every
  request, every step that prefills also loads, and its copies are a restore's cost, not the
  prefill's;
- ``step``: seconds a busy step takes (an asynchronous load costs about one: its request is
  scheduled in the step after the load is reported);
- ``lookup``: seconds a lookup takes (one or two store round trips);
- ``transfer``: seconds per byte a load takes beyond one round trip (the lookup's figure),
  and apart the seconds per byte a synchronous load takes in its step (``in_step``: its
  objects most often read in the lookup, so this is the verifying and the copies);
- ``restore``: seconds from a restored request's lookup to when it could be scheduled, less its
  bytes' transfer, as this engine's restores took them (the lanes' queues, every round trip,
  the wait from the answer to the next step that takes it, and the steps a load beside them
  took included), apart for loads beside the steps (until the workers report the load done)
  and in the step that asked (until a step took the answer, at most a busy step after the
  lookup replied: the load then runs in that step, its objects most often read in the lookup's
  round trip). A longer wait for a step's token budget before vLLM's allocation is left out:
  a request computed would wait as long.

With these, restoring ``t`` tokens whose objects are ``n`` bytes costs ``restore + n *
transfer`` (``in_step`` for a synchronous load, once measured; before any restore is
measured: two round trips, and a step for a load beside the steps) and half a step
(``LAST_STEP_SHARE``: a restored request still runs a whole step for the tokens past its hit,
where a computed request's last step is on average half its own), less the lookup once it has
answered; computing them costs ``t * compute``.
Both grow linearly with a hit: where restoring a token costs less than computing it the whole
hit pays best, and where it costs more no part of it pays once the fixed costs are added; so a
hit is taken whole or not at all (a miss counted ``not_worth_it``). Before any round trip, a
request whose every uncomputed token could not pay for the round trips and the bytes of its
longest possible hit is not looked up. A hit past the request's junction ends there where
what the next request resuming at the junction saves by computing the rest outweighs what this
one pays for it (``stop_at_junction``).

Until the engine's prefill is measured nothing is judged (a restore is taken), and a judgment
against restoring is put aside at most once every ``EXPLORE_S`` seconds, so that the estimates
of a store that has become faster, which only lookups and loads measure, are renewed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from prefixvault.layout import CacheLayout

#: How much each new sample counts against what was measured before (an exponential average).
WEIGHT = 0.2
#: A step counts toward the compute estimate only with at least this many tokens, most of them
#: prefill (decode steps cost per token what a prefill does not); one with no prefill at all
#: gives its fixed part.
MIN_PREFILL_TOKENS = 32
#: The prefill estimate's line is read at most this many times its steps' prefill tokens (the
#: budget where smaller): a step's time grows with its tokens as a line on a CPU, but on a GPU it
#: is flat at first, and a line through short chunks read far past them would spread a fixed
#: cost over tokens that are not free.
EXTRAPOLATE_AT_MOST = 4
#: A step longer than this is not a step the engine ran but one it waited for (an idle engine).
MAX_STEP_S = 10.0
#: At most one restore or lookup every this many seconds is taken against the estimates, to
#: measure them again.
EXPLORE_S = 10.0
#: A step waits for new lookups only if twice their expected time fits in this share of a step.
WAIT_SHARE = 0.1
#: The share of a busy step a restore is charged beyond its measured time: the step that runs
#: the tokens past its hit is a whole step of waiting for the restored request, where the linear
#: ``compute`` estimate charges a computed request's last step by its tokens, on average half.
LAST_STEP_SHARE = 0.5


class Judgment(StrEnum):
    PAYS = "pays"  # expected to end sooner than computing
    UNKNOWN = "unknown"  # not measured yet: taken
    EXPLORE = "explore"  # not expected to pay, taken to measure the costs again
    NOT_WORTH_IT = "not_worth_it"  # computing ends sooner: not taken


@dataclass
class Average:
    """An exponential average; None until the first sample."""

    value: float | None = None
    at: float = 0.0  # time.monotonic() of the last sample

    def add(self, sample: float, now: float) -> None:
        self.value = sample if self.value is None else self.value + WEIGHT * (sample - self.value)
        self.at = now


def full_step_s_per_token(prefill_s: float, step_tokens: float, prefill_tokens: float,
                          fixed_s: float | None, budget: int | None) -> float:
    """Seconds per token of a step that prefills ``budget`` tokens, from steps that took
    ``prefill_s`` for ``step_tokens`` (``prefill_tokens`` of them prefill) and steps with no
    prefill that took ``fixed_s``: a line through the two, read at the budget (at most
    ``EXTRAPOLATE_AT_MOST`` times the prefill tokens). Tokens a request computes instead of
    restoring fill the steps up to their budget, so the fixed part of a step is spread over
    the budget, not over a short step's tokens. Without the budget or a step with no prefill:
    the steps' time over their tokens. Never above that ratio nor below ``prefill_s /
    budget`` (a line that cannot fall as the tokens grow, nor start below zero)."""
    ratio = prefill_s / step_tokens
    if not budget or fixed_s is None or not 0 < prefill_tokens < budget:
        return ratio
    at = min(budget, EXTRAPOLATE_AT_MOST * prefill_tokens)
    fixed = min(max(fixed_s, 0.0), prefill_s)
    return min(ratio, (prefill_s - fixed) / prefill_tokens + fixed / at)


@dataclass(frozen=True)
class Estimates:
    """The costs as last measured (seconds; None: not measured yet)."""

    compute_s_per_token: float | None  # for the request that waits for it (its share of steps)
    step_s: float | None
    lookup_s: float | None
    transfer_s_per_byte: float | None
    # Seconds from a restored request's lookup to when it could be scheduled, less its bytes'
    # transfer, as this engine's restores took them: loaded beside the steps, or in the step
    # that asked (see the module).
    restore_s_beside: float | None = None
    restore_s_in_step: float | None = None
    # Seconds per byte a synchronous load took in its step (verifying and copying its objects,
    # reading any not handed over).
    in_step_s_per_byte: float | None = None

    def restore_s(self, nbytes: int, in_step: bool) -> float:
        """Expected seconds from a request's lookup to when it can be scheduled with ``nbytes``
        restored: the fixed part as this engine's restores took it (before any: a lookup, a
        load's round trip, and a step for a load beside the steps), the transfer, and
        ``LAST_STEP_SHARE`` of a step (see the module)."""
        measured = self.restore_s_in_step if in_step else self.restore_s_beside
        lookup = self.lookup_s or 0.0
        step = self.step_s or 0.0
        fixed = measured if measured is not None else 2 * lookup + (0.0 if in_step else step)
        rate = self.in_step_s_per_byte if in_step and self.in_step_s_per_byte is not None \
            else self.transfer_s_per_byte
        return fixed + LAST_STEP_SHARE * step + nbytes * (rate or 0.0)

    def restore_and_compute_s(self, tokens: int, nbytes: int, in_step: bool) -> tuple[float, float] | None:
        """Seconds to look up and load ``tokens`` (``nbytes`` of objects: ``restore_s``), and
        to compute them instead; None until both the prefill and a lookup are measured."""
        if self.compute_s_per_token is None or self.lookup_s is None:
            return None
        return self.restore_s(nbytes, in_step), tokens * self.compute_s_per_token

    def lookup_pays(self, tokens: int, nbytes: int, in_step: bool) -> bool | None:
        """Whether looking up and loading ``tokens`` (``nbytes`` of objects) ends sooner than
        computing them (``restore_and_compute_s``); None until measured."""
        costs = self.restore_and_compute_s(tokens, nbytes, in_step)
        return None if costs is None else costs[1] > costs[0]

    def load_s(self, nbytes: int, in_step: bool) -> float:
        """Expected seconds left once the lookup answered (``restore_s`` less the lookup)."""
        return max(0.0, self.restore_s(nbytes, in_step) - (self.lookup_s or 0.0))

    def figures(self) -> dict[str, int]:
        """For metrics: whole microseconds (per token, per step, per lookup) and bytes per second."""
        out = {}
        if self.compute_s_per_token is not None:
            out["compute_us_per_token"] = round(self.compute_s_per_token * 1e6)
        if self.step_s is not None:
            out["step_us"] = round(self.step_s * 1e6)
        if self.lookup_s is not None:
            out["lookup_us"] = round(self.lookup_s * 1e6)
        if self.transfer_s_per_byte:
            out["load_bytes_per_s"] = round(1 / self.transfer_s_per_byte)
        if self.in_step_s_per_byte:
            out["load_in_step_bytes_per_s"] = round(1 / self.in_step_s_per_byte)
        if self.restore_s_beside is not None:
            out["restore_us"] = round(self.restore_s_beside * 1e6)
        if self.restore_s_in_step is not None:
            out["restore_in_step_us"] = round(self.restore_s_in_step * 1e6)
        return out


def restore_bytes(layout: CacheLayout, hit: int, local: int, rank: int = 0) -> int:
    """Bytes one rank loads to restore ``hit`` tokens past ``local`` in the engine's own cache:
    every KV block from ``local``'s block to the hit's last (a partial one included) and one
    state per state group (a sliding window counted whole: an upper bound)."""
    bs = layout.block_size
    blocks = max(0, -(-hit // bs) - local // bs)
    return sum(g.nbytes(rank) * (1 if g.is_state else blocks) for g in layout.groups)


#: The metric names an engine exports the estimates under (``vllm/stats.py``), by field.
GAUGE_NAMES = {"compute_s_per_token": ("vllm:prefixvault_estimate_compute_us_per_token", 1e-6),
               "step_s": ("vllm:prefixvault_estimate_step_us", 1e-6),
               "lookup_s": ("vllm:prefixvault_estimate_lookup_us", 1e-6),
               "restore_s_beside": ("vllm:prefixvault_estimate_restore_us", 1e-6),
               "restore_s_in_step": ("vllm:prefixvault_estimate_restore_in_step_us", 1e-6)}
TRANSFER_GAUGE = "vllm:prefixvault_estimate_load_bytes_per_s"
IN_STEP_GAUGE = "vllm:prefixvault_estimate_load_in_step_bytes_per_s"


def estimates_from_metrics(text: str) -> Estimates:
    """The estimates an engine exported (its ``/metrics`` page, Prometheus text), for a tool
    that judges a restore as that engine would (``explain --engine``)."""
    import re

    def gauge(name: str) -> float | None:
        pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
        found = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
        return max(found) if found else None

    values = {}
    for field, (name, unit) in GAUGE_NAMES.items():
        v = gauge(name)
        values[field] = v * unit if v is not None else None
    rate, in_step = gauge(TRANSFER_GAUGE), gauge(IN_STEP_GAUGE)
    return Estimates(values["compute_s_per_token"], values["step_s"], values["lookup_s"],
                     1 / rate if rate else None, values["restore_s_beside"], values["restore_s_in_step"],
                     1 / in_step if in_step else None)


def judge(est: Estimates, tokens: int, nbytes: int, in_step: bool = False) -> tuple[Judgment, float, float]:
    """Whether ``restore_when: faster`` would load a hit of ``tokens`` tokens (``nbytes`` of
    objects) once looked up, with the seconds loading and computing them would take: the
    judgment ``RestoreCosts.restore`` makes, without exploring."""
    if est.compute_s_per_token is None:
        return Judgment.UNKNOWN, est.load_s(nbytes, in_step), 0.0
    compute, load = tokens * est.compute_s_per_token, est.load_s(nbytes, in_step)
    return (Judgment.PAYS if compute > load else Judgment.NOT_WORTH_IT), load, compute


@dataclass(frozen=True)
class _Step:
    """A step as planned: when, its tokens, and of them those in chunks of more than one."""

    at: float
    tokens: int
    prefill_tokens: int


class RestoreCosts:
    """The estimates (see the module), fed by the scheduler's thread (steps), the lookup lane
    (lookups) and the workers' reports (loads); read by the scheduler's thread and the lookup
    lane (a cut at a junction)."""

    def __init__(self, judge: bool = True, clock: Callable[[], float] = time.monotonic,
                 step_budget: int | None = None) -> None:
        """``judge``: False (``restore_when: always``) takes every restore, measuring anyway.
        ``step_budget``: the most tokens the engine schedules in a step (vLLM's
        ``max_num_batched_tokens``), where known (``full_step_s_per_token``)."""
        self.judge = judge
        self.step_budget = step_budget
        self._now = clock
        self._lock = threading.Lock()
        # Steps' seconds as below count without their synchronous loads' (``loaded_in_step``).
        # Steps that mostly prefill: seconds, tokens and prefill tokens; steps with no prefill:
        # seconds (``full_step_s_per_token`` of the four is ``compute``).
        self._prefill_s = Average()
        self._prefill_step_tokens = Average()
        self._prefill_tokens = Average()
        self._no_prefill_s = Average()
        self._step = Average()  # every busy step, whole
        self._lookup = Average()
        self._transfer = Average()
        self._in_step = Average()  # seconds per byte of synchronous loads, in their step
        # seconds synchronous loads took in the step being measured, reported since the last
        # step was planned (vLLM hands a step's reports over before it plans the next step;
        # with async scheduling, after it: then they are taken off the next step's time, and
        # a step they outlast is no sample)
        self._in_step_s = 0.0
        self._sharing = Average()  # requests with a prefill chunk in a step that prefills
        self._restored = {False: Average(), True: Average()}  # by in step: ``Estimates.restore_s_*``
        self._last_step: _Step | None = None  # the step planned last
        # A judgment against restoring is put aside once per ``explore_s`` (the first time one
        # period after start), to measure the costs again.
        self.explore_s = EXPLORE_S
        start = self._now()
        self._explored = {"lookup": start, "restore": start}

    # -- measured --------------------------------------------------------------------------------

    def step_planned(self, tokens: int, prefill_tokens: int, prefilling: int = 1) -> None:
        """A step with ``tokens`` scheduled (``prefill_tokens`` of them in chunks of more than
        one, of ``prefilling`` requests) is being planned: the previous one took from its
        planning to this one's."""
        now = self._now()
        with self._lock:
            if prefill_tokens:
                self._sharing.add(max(1, prefilling), now)
            last, loading_s = self._last_step, self._in_step_s
            self._last_step = _Step(now, tokens, prefill_tokens) if tokens else None
            self._in_step_s = 0.0
            if last is None:
                return
            seconds = now - last.at
            if seconds > MAX_STEP_S:
                return
            self._step.add(seconds, now)
            computing = seconds - loading_s
            if computing <= 0:
                return
            if not last.prefill_tokens:
                self._no_prefill_s.add(computing, now)
            elif last.tokens >= MIN_PREFILL_TOKENS and 2 * last.prefill_tokens >= last.tokens:
                self._prefill_s.add(computing, now)
                self._prefill_step_tokens.add(last.tokens, now)
                self._prefill_tokens.add(last.prefill_tokens, now)

    def looked_up(self, seconds: float) -> None:
        """A lookup batch took ``seconds`` in the store."""
        with self._lock:
            self._lookup.add(seconds, self._now())

    def loaded(self, nbytes: int, seconds: float) -> None:
        """Loads read and wrote ``nbytes`` in ``seconds`` (summed over ranks: per rank)."""
        if nbytes <= 0:
            return
        with self._lock:
            beyond = max(0.0, seconds - (self._lookup.value or 0.0))
            self._transfer.add(beyond / nbytes, self._now())

    def loaded_in_step(self, nbytes: int, seconds: float) -> None:
        """The step just run spent ``seconds`` on synchronous loads, writing ``nbytes`` (the
        slowest rank's; loads not written count their time, no bytes): time its compute is
        measured without, and their rate."""
        with self._lock:
            if nbytes > 0:
                self._in_step.add(seconds / nbytes, self._now())
            self._in_step_s += max(0.0, seconds)

    def restored(self, seconds: float, nbytes: int, in_step: bool) -> None:
        """A request restoring ``nbytes`` (a rank's) could be scheduled ``seconds`` after its
        lookup was queued (waits for a step's token budget left out): beside the steps, once
        its load was reported done (its transfer included, taken off here); in the step, once
        a step took its answer (its transfer still to come, in that step)."""
        with self._lock:
            transfer = 0.0 if in_step else (self._transfer.value or 0.0) * nbytes
            self._restored[in_step].add(max(0.0, seconds - transfer), self._now())

    def estimates(self) -> Estimates:
        with self._lock:
            per_token = None
            if self._prefill_s.value is not None and self._prefill_step_tokens.value:
                per_token = full_step_s_per_token(self._prefill_s.value, self._prefill_step_tokens.value,
                                                  self._prefill_tokens.value or 0.0, self._no_prefill_s.value,
                                                  self.step_budget)
                per_token *= max(1.0, self._sharing.value or 1.0)
            return Estimates(per_token, self._step.value, self._lookup.value, self._transfer.value,
                             self._restored[False].value, self._restored[True].value, self._in_step.value)

    # -- judged ----------------------------------------------------------------------------------

    def restore(self, tokens: int, nbytes: int, in_step: bool) -> Judgment:
        """Whether to restore ``tokens`` from ``nbytes`` of objects, looked up already."""
        judged = judge(self.estimates(), tokens, nbytes, in_step)[0]
        if judged is Judgment.UNKNOWN or not self.judge:
            return Judgment.UNKNOWN if judged is Judgment.UNKNOWN else Judgment.PAYS
        return judged if judged is Judgment.PAYS else self._explore("restore")

    def stop_at_junction(self, tokens: int, nbytes: int, in_step: bool) -> bool:
        """Whether a restore should end at the request's junction rather than ``tokens`` past
        it (``nbytes`` of objects past it). vLLM keeps the state at a request's junction, so
        the requests of that prefix after this one could then resume there in the engine's own
        cache and compute those tokens, with no round trip, instead of each restoring its own
        boundary from the store. The cut costs this request: it computes them, and where it
        is asked again for vLLM's agreed hit (a divergent offer), waits a step more; so it ends
        at the junction only where what the next request of the prefix saves (a lookup and a
        load, against computing them) outweighs what this one pays (computing them and a step,
        charged on an agreed offer too: a margin against estimates that move). Near the
        threshold of ``look_up`` no cut is made: there a later request, judged on estimates
        that move, may look up and load anyway, and the cut would be paid for nothing. Never
        put aside to explore; False until measured, and with ``judge`` off."""
        est = self.estimates()
        costs = est.restore_and_compute_s(tokens, nbytes, in_step)
        if not self.judge or costs is None:
            return False
        restore, compute = costs
        return restore - compute > compute + (est.step_s or 0.0)

    def look_up(self, tokens: int, in_step: bool, nbytes: int = 0) -> Judgment:
        """Whether to look up a request that could restore at most ``tokens`` tokens
        (``nbytes`` of objects to load them): only if they could pay for the round trips (a
        lookup, and a load beside the steps) and those bytes. (Both grow with a hit: where the
        longest possible one does not pay, no shorter one does.)"""
        pays = self.estimates().lookup_pays(tokens, nbytes, in_step)
        if pays is None:
            return Judgment.UNKNOWN
        if not self.judge or pays:
            return Judgment.PAYS
        return self._explore("lookup")

    def _explore(self, what: str) -> Judgment:
        now = self._now()
        with self._lock:
            if now - self._explored[what] >= self.explore_s:
                self._explored[what] = now
                return Judgment.EXPLORE
        return Judgment.NOT_WORTH_IT

    def wait_for_lookups(self, budget: float) -> float:
        """How long a step may wait for the lookups it starts: up to ``budget`` where twice a
        lookup's expected time fits in ``WAIT_SHARE`` of a step (a wait that every running
        request pays is paid back by a restore a step sooner); else none: the request is asked
        again in the next step. Unmeasured: ``budget``."""
        est = self.estimates()
        if est.lookup_s is None or est.step_s is None:
            return budget
        fits = min(budget, WAIT_SHARE * est.step_s)
        return fits if 2 * est.lookup_s <= fits else 0.0
