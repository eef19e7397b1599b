"""Which candidate boundaries to store: the admission half of cache policy, in one place.

The engine gives a request several boundaries where an exact state exists (see
``boundary.py`` for which ones are exact); storing one costs a state (megabytes for real
hybrid models, ``geometry.py``) plus the KV blocks since the previous stored boundary. A
policy picks among them by what kind of boundary each is. The connector's scheduler and
the policy simulator (``bench/policy_sim.py``) call the same ``Admission.admits``.

Kinds of candidate (one boundary may be several at once):

- ``STEP_END``: a prefill step ended on a block boundary inside the prompt;
- ``PROMPT_END``: the prompt's last block boundary (vLLM's prefill checkpoint);
- ``JUNCTION``: where this prompt leaves a prefix an earlier request had (vLLM stops a
  chunk there; Marconi's branch point): reuse already seen;
- ``OUTPUT``: a decode step ended on a block boundary;
- ``SEQUENCE_END``: the last block boundary of prompt + output, once the request finished;
- ``CHECKPOINT``: the engine offers the state (vLLM's prompt checkpoint and junction, and any
  boundary it retains): a report of the engine rather than of the step.

Policies: ``steps`` (every step end and engine checkpoint, and every output boundary where
outputs are captured), ``interval:N`` (checkpoints, and step or output ends at most once per
N tokens), ``checkpoints`` (the engine's checkpoints only), ``marconi`` (junctions and
sequence ends, as Marconi, MLSys 2025, admits), and ``reuse``: junctions always (sharing
already seen); sequence ends only while recent requests share any prefix at all and the
sequence ends admitted before are being restored, as ``ReuseTracker`` observes, with an
occasional probe so a change of workload is noticed. Neither of the last two stores a
prefill step end: ``bench/policy_sim.py`` measured that step ends cost more hits under a
bounded store than they give (docs/configuration.md, "Capture policy").
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import IntFlag, StrEnum


class Kind(IntFlag):
    STEP_END = 1
    PROMPT_END = 2
    JUNCTION = 4
    OUTPUT = 8
    SEQUENCE_END = 16
    CHECKPOINT = 32


class Policy(StrEnum):
    STEPS = "steps"
    INTERVAL = "interval"
    CHECKPOINTS = "checkpoints"
    MARCONI = "marconi"
    REUSE = "reuse"


#: Requests ``reuse`` remembers to tell whether any prefix is being shared at all.
SHARING_WINDOW = 24
#: Admissions settled as not reused that a later restore still corrects.
LATE_MEMORY = 4096


@dataclass
class ReuseTracker:
    """How often admitted boundaries of each learned kind are restored later.

    An admission *settles* when a lookup restores it (a reuse) or when ``horizon`` later
    admissions of its kind went by without one; one restored later still (the next turn of
    a conversation after a long pause) turns into a reuse. The rate is the share of settled
    admissions that were reused, counted with exponential decay so the estimate follows the
    workload, and starts optimistic (``rate`` is 1 with nothing settled): a policy that has
    seen no evidence admits.

    Invariant: every key in ``_open`` is an admission not yet settled; every key in
    ``_late`` one settled as not reused; a key is in at most one of them.
    """

    horizon: int = 32
    decay: float = 0.97
    _open: OrderedDict[bytes, tuple[Kind, int]] = field(default_factory=OrderedDict)
    _late: OrderedDict[bytes, Kind] = field(default_factory=OrderedDict)
    _seq: dict[Kind, int] = field(default_factory=dict)
    _reused: dict[Kind, float] = field(default_factory=dict)
    _settled: dict[Kind, float] = field(default_factory=dict)

    def admitted(self, key: bytes, kinds: Kind) -> None:
        kind = _learned_kind(kinds)
        if kind is None or key in self._open:
            return
        n = self._seq[kind] = self._seq.get(kind, 0) + 1
        self._open[key] = (kind, n)
        # Settle, unreused, what ``horizon`` admissions of this kind went by.
        stale = [k for k, (kd, i) in self._open.items() if kd is kind and n - i >= self.horizon]
        for k in stale:
            del self._open[k]
            self._settle(kind, False)
            self._late[k] = kind
            if len(self._late) > LATE_MEMORY:
                self._late.popitem(last=False)

    def restored(self, key: bytes) -> None:
        """A lookup restored the boundary named ``key`` (its hash)."""
        entry = self._open.pop(key, None)
        if entry is not None:
            self._settle(entry[0], True)
            return
        late = self._late.pop(key, None)
        if late is not None:  # settled as not reused: it was, only later (a share stays <= 1)
            self._reused[late] = min(self._settled.get(late, 0.0), self._reused.get(late, 0.0) + 1.0)

    def _settle(self, kind: Kind, reused: bool) -> None:
        self._reused[kind] = self._reused.get(kind, 0.0) * self.decay + reused
        self._settled[kind] = self._settled.get(kind, 0.0) * self.decay + 1.0

    def rate(self, kind: Kind) -> float:
        settled = self._settled.get(kind, 0.0)
        return 1.0 if settled < 1.0 else self._reused.get(kind, 0.0) / settled


def _learned_kind(kinds: Kind) -> Kind | None:
    """The kind ``reuse`` learns a candidate's worth by (a junction is admitted, not learned)."""
    if Kind.SEQUENCE_END in kinds and Kind.JUNCTION not in kinds:
        return Kind.SEQUENCE_END
    return None


@dataclass
class Admission:
    """One policy's admission decisions for one scheduler (``reuse`` keeps state)."""

    policy: Policy
    interval: int = 0
    # ``reuse`` learns from the restores it sees; a scheduler that never looks up (a producer
    # that only saves) sees none, and admits as ``marconi`` does.
    observes: bool = True
    min_rate: float = 0.1  # ``reuse``: admit a learned kind while at least this share is reused
    probe_every: int = 64  # ``reuse``: below it, still admit one candidate in this many
    tracker: ReuseTracker = field(default_factory=ReuseTracker)
    _declined: dict[Kind, int] = field(default_factory=dict)
    _sharing: deque[bool] = field(default_factory=lambda: deque(maxlen=SHARING_WINDOW))

    def __post_init__(self) -> None:
        if self.policy is Policy.INTERVAL and self.interval <= 0:
            raise ValueError("the interval policy needs a positive interval")

    @classmethod
    def parse(cls, text: str) -> Admission:
        """``steps``, ``interval:N``, ``checkpoints``, ``marconi`` or ``reuse``."""
        m = re.fullmatch(r"interval:(\d+)", text)
        if m:
            return cls(Policy.INTERVAL, int(m.group(1)))
        try:
            return cls(Policy(text))
        except ValueError:
            raise ValueError(f"admission policy must be one of steps, interval:N, checkpoints, marconi, "
                             f"reuse; got {text[:100]!r}") from None

    def admits(self, kinds: Kind, tokens: int, last: int) -> bool:
        """Whether to store the candidate boundary at ``tokens`` of kinds ``kinds``; ``last``
        is the request's last boundary admitted (0 if none)."""
        p = self.policy
        if p is Policy.STEPS:
            return bool(kinds & (Kind.STEP_END | Kind.CHECKPOINT | Kind.OUTPUT))
        if p is Policy.CHECKPOINTS:
            return bool(kinds & Kind.CHECKPOINT)
        if p is Policy.INTERVAL:
            if kinds & Kind.CHECKPOINT:
                return True
            crossed = tokens // self.interval > last // self.interval
            return bool(kinds & (Kind.STEP_END | Kind.OUTPUT)) and crossed
        if p is Policy.MARCONI or not self.observes:
            return bool(kinds & (Kind.JUNCTION | Kind.SEQUENCE_END))
        if kinds & Kind.JUNCTION:
            return True
        kind = _learned_kind(kinds)
        if kind is None:
            return False
        if self.tracker.rate(kind) >= self.min_rate and self.sharing() > 0.0:
            return True
        declined = self._declined[kind] = self._declined.get(kind, 0) + 1
        return declined % self.probe_every == 0

    def arrived(self, shares: bool) -> None:
        """A request arrived; ``shares``: some prefix of it was computed before (a hit, or a
        junction with an earlier request)."""
        self._sharing.append(shares)

    def sharing(self) -> float:
        """The share of recent requests that reuse a prefix (1 until the window is full)."""
        w = self._sharing
        return 1.0 if len(w) < (w.maxlen or 0) else sum(w) / len(w)

    def admitted(self, key: bytes, kinds: Kind) -> None:
        """The boundary named ``key`` was stored (``reuse`` watches whether it comes back)."""
        if self.policy is Policy.REUSE:
            self.tracker.admitted(key, kinds)

    def restored(self, key: bytes) -> None:
        """A lookup restored the boundary named ``key``."""
        if self.policy is Policy.REUSE:
            self.tracker.restored(key)
