"""A request as the scheduler side tracks it, and the phases of its restore.

One ``TrackedRequest`` per request vLLM asks about: the token ids it is keyed by, what it has
handed to the workers to save, and its ``Restore``. A restore is in one phase at a time, and
each phase carries its own data (a lookup in flight, a hit, the bytes read ahead for it, the
mailbox token they were handed over under, the boundary a load restores); everything else is
derived. Only the transition methods of ``Restore`` change the phase, and each checks where it
comes from (``WrongPhase`` otherwise: a bug of ours, which the guard turns into a miss).
``vllm/restores.py`` decides when each transition happens::

              look_up                 answer                hand_over
      NEW ─────────────▶ LOOKING_UP ─────────▶ ANSWERED ──────────────▶ HANDED_OVER
       ▲                   │     ▲               │  ▲ └───allocated (no load)   │
       │        wait_for_save    │ look_up       │  └──────────take_back────────┤
       │                   ▼     │               │ load                          │ load
       │              WAITING_FOR_SAVE           ▼                               ▼
       └────────────────────────────────────── LOADING ◀────────────────────────┘
                      restart (asked again: the load failed, or a preemption)

      NEW ──decline──▶ ANSWERED (hit 0): not looked up, no hit could pay for its round trips
      any phase ──give_up──▶ COMPUTED: computed without the store from now on

Invariant: bytes read ahead for a synchronous load (``ReadAhead``) are held only in the
ANSWERED and HANDED_OVER phases; every transition out of them lets go of the bytes (they go
back to the read-ahead budget), so none outlives its request's restore.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixvault.identity import content_digest
from prefixvault.keys import ExtraKeys, MultimodalItem
from prefixvault.vllm.compat import streams_input
from prefixvault.vllm.metadata import SaveSpec

if TYPE_CHECKING:
    from prefixvault.vllm.in_step import ReadAhead
    from prefixvault.vllm.lookups import Answer


class WrongPhase(RuntimeError):
    """A transition asked of a restore in a phase it does not start from (a bug of ours)."""


@dataclass(frozen=True, kw_only=True)
class New:
    """Not looked up yet, or to look up afresh (asked again after a load)."""


@dataclass(frozen=True, kw_only=True)
class LookingUp:
    """Its lookup is queued on, or running on, the lookup lane."""

    lookup: Future[Answer]
    since: float  # time.monotonic() the lookup was queued
    local: int  # tokens vLLM's own prefix cache had when it was looked up
    # Of them, the hit every cache group holds (what the engine computes from without a load),
    # and where a load of its hit would start (``vllm/restored.py``).
    agreed: int = 0
    start: int = 0


@dataclass(frozen=True, kw_only=True)
class WaitingForSave:
    """Its prompt names a boundary whose save is in flight: looked up again once it settled
    (or ``lookup_timeout`` after ``since``)."""

    since: float
    local: int


@dataclass(frozen=True, kw_only=True)
class Answered:
    """Its hit is known (0: none). ``read_ahead``: the verified bytes of its load, read by its
    lookup for a synchronous load. ``asked_agreed``: the divergent hit vLLM offered when it was
    asked again for its agreed one (once, until vLLM allocates)."""

    hit: int
    read_ahead: ReadAhead | None = None
    asked_agreed: int = 0


@dataclass(frozen=True, kw_only=True)
class HandedOver:
    """Answered for a synchronous load: its bytes are in the worker's mailbox under ``token``,
    for a load that starts at ``start`` tokens (vLLM's offer when it was answered)."""

    hit: int
    read_ahead: ReadAhead
    token: int
    start: int


@dataclass(frozen=True, kw_only=True)
class Loading:
    """vLLM allocated its load of ``tokens``: it restores them (unless asked again)."""

    tokens: int


@dataclass(frozen=True, kw_only=True)
class Computed:
    """Computed without the store from now on (its loads kept failing, or an error of ours)."""


Phase = New | LookingUp | WaitingForSave | Answered | HandedOver | Loading | Computed


class Restore:
    """The restore of one request: its phase, and the counts that outlive a phase."""

    def __init__(self) -> None:
        self.phase: Phase = New()
        self.loads = 0  # loads issued for the request; after MAX_LOADS_PER_REQUEST it is computed
        self.waited_for_save = False  # it waited for a save of its prefix once (it never waits again)
        # computing it was judged sooner than restoring (``restore_when: faster``): answered a miss
        self.not_worth_it = False
        # its last answer was cut to its junction, the store holding more (``vllm/lookups.py``)
        self.to_junction = False
        # time.monotonic() its first lookup (since a restart) was queued, its last lookup
        # replied (on the lookup lane), and its last answer was taken in a step: what a restore
        # took is measured from them (``Restores.allocated``)
        self.asked_at: float | None = None
        self.replied_at: float | None = None
        self.answered_at: float | None = None
        # The most tokens it may restore, after a load that failed: short of every object that
        # failed (a worker's ``Loads.take_caps``), so it is looked up again for the deepest
        # boundary that did not, never the same one (None: no load failed).
        self.cap: int | None = None

    def __repr__(self) -> str:
        return f"Restore({self.phase}, loads={self.loads})"

    # -- derived ----------------------------------------------------------------------------------

    @property
    def hit(self) -> int:
        """Its external hit, where one is answered (0 otherwise)."""
        return self.phase.hit if isinstance(self.phase, Answered | HandedOver) else 0

    @property
    def loaded(self) -> int:
        """Tokens its load restores (0 unless vLLM allocated one and has not asked again)."""
        return self.phase.tokens if isinstance(self.phase, Loading) else 0

    @property
    def sync(self) -> bool:
        """Whether its hit was answered for a synchronous load (its bytes handed over)."""
        return isinstance(self.phase, HandedOver)

    @property
    def read_ahead(self) -> ReadAhead | None:
        return self.phase.read_ahead if isinstance(self.phase, Answered | HandedOver) else None

    @property
    def lookup(self) -> Future[Answer] | None:
        return self.phase.lookup if isinstance(self.phase, LookingUp) else None

    # -- transitions ------------------------------------------------------------------------------

    def _expect(self, *phases: type) -> None:
        if not isinstance(self.phase, phases):
            names = " or ".join(p.__name__ for p in phases)
            raise WrongPhase(f"restore in {type(self.phase).__name__}, expected {names}")

    def _become(self, phase: Phase) -> None:
        """Enter ``phase``; bytes read ahead that it does not carry on are let go of, and so are
        those a lookup it leaves reads ahead for it later (it lands after a timeout or an abort)."""
        held, left = self.read_ahead, self.phase
        self.phase = phase
        if held is not None and held is not self.read_ahead:
            held.release()
        if isinstance(left, LookingUp):
            left.lookup.add_done_callback(functools.partial(_release_unadopted, adopted=self.read_ahead))

    def look_up(self, lookup: Future[Answer], local: int, now: float, agreed: int | None = None,
                start: int | None = None) -> None:
        """Its lookup was queued; ``agreed`` and ``start``: ``LookingUp``'s (``local`` if not
        given: no divergent hit)."""
        self._expect(New, WaitingForSave)
        if self.asked_at is None:
            self.asked_at = now
        lookup.add_done_callback(self._replied)
        self._become(LookingUp(lookup=lookup, since=now, local=local,
                               agreed=local if agreed is None else agreed,
                               start=local if start is None else start))

    def _replied(self, _lookup: Future[Answer]) -> None:
        """(On the lookup lane's thread, or the caller's for a lookup refused or cancelled.)"""
        self.replied_at = time.monotonic()

    def wait_for_save(self) -> None:
        """Its lookup answered that a save of its prefix is in flight."""
        self._expect(LookingUp)
        assert isinstance(self.phase, LookingUp)
        self.waited_for_save = True
        self._become(WaitingForSave(since=self.phase.since, local=self.phase.local))

    def decline(self) -> None:
        """Not looked up: no hit could pay for the round trips (answered a miss)."""
        self._expect(New)
        self.not_worth_it = True
        self._become(Answered(hit=0))

    def answer(self, hit: int, read_ahead: ReadAhead | None = None, junction: bool = False) -> None:
        """Its lookup answered (a miss, a failed or timed-out lookup: ``hit`` 0); ``junction``:
        its hit was cut to its junction (``vllm/lookups.py``)."""
        self._expect(LookingUp)
        self.to_junction = junction
        self.answered_at = time.monotonic()
        self._become(Answered(hit=hit, read_ahead=read_ahead))

    def hand_over(self, token: int, start: int) -> None:
        """Its load's bytes went to the worker's mailbox under ``token``, for a load from ``start``."""
        self._expect(Answered)
        assert isinstance(self.phase, Answered)
        if self.phase.read_ahead is None:
            raise WrongPhase("a hand-over needs the bytes its lookup read ahead")
        self._become(HandedOver(hit=self.phase.hit, read_ahead=self.phase.read_ahead, token=token,
                                start=start))

    def take_back(self) -> bool:
        """Asked again before vLLM allocated: what was handed over is no longer for this load.
        Whether anything was (the caller takes it out of the mailbox)."""
        if not isinstance(self.phase, HandedOver):
            return False
        self._become(Answered(hit=self.phase.hit, read_ahead=self.phase.read_ahead))
        return True

    def keep_read_ahead(self, keep: bool) -> None:
        """Let go of the bytes read ahead unless ``keep`` (no synchronous load will use them)."""
        if not keep and isinstance(self.phase, Answered) and self.phase.read_ahead is not None:
            self._become(Answered(hit=self.phase.hit, asked_agreed=self.phase.asked_agreed))

    def ask_agreed(self, offered: int) -> None:
        """Asked again for vLLM's agreed hit, having been offered the divergent ``offered``."""
        self._expect(Answered)
        assert isinstance(self.phase, Answered)
        self._become(Answered(hit=self.phase.hit, read_ahead=self.phase.read_ahead, asked_agreed=offered))

    def allocated(self) -> None:
        """vLLM allocated the request with nothing to load: the hit stays answered (asked again,
        it is answered the same), its bytes are let go of."""
        if isinstance(self.phase, Answered | HandedOver):
            self._become(Answered(hit=self.phase.hit))

    def load(self) -> None:
        """vLLM allocated the load of its hit."""
        self._expect(Answered, HandedOver)
        assert isinstance(self.phase, Answered | HandedOver)
        self.loads += 1
        self._become(Loading(tokens=self.phase.hit))

    def restart(self) -> None:
        """Asked again after a load: it failed (a bad object was removed), or the request was
        preempted. It is looked up afresh."""
        self._expect(Loading)
        self.asked_at = self.replied_at = self.answered_at = None
        self._become(New())

    def capped(self, tokens: int) -> None:
        """A load of it failed: it restores at most ``tokens`` from now on (in any phase)."""
        self.cap = tokens if self.cap is None else min(self.cap, tokens)

    def give_up(self) -> None:
        """Compute it without the store from now on."""
        self._become(Computed())

    def finish(self) -> None:
        """The request finished: a lookup not started never starts; held bytes are let go of."""
        lookup = self.lookup
        if lookup is not None:
            lookup.cancel()
        self._become(Computed())


def _release_unadopted(lookup: Future[Answer], adopted: ReadAhead | None) -> None:
    """Let go of the bytes a lookup read ahead unless the phase after it carries them (it runs
    on the lookup lane's thread when the lookup lands after its request moved on)."""
    if lookup.cancelled() or lookup.exception() is not None:
        return
    ahead = lookup.result()[2]
    if ahead is not None and ahead is not adopted:
        ahead.release()


def lora_key(lora: Any) -> str:
    """An adapter named by its files' content, so an adapter replaced in place gets new keys;
    by name and path where its files cannot be read."""
    path = str(getattr(lora, "lora_path", "") or "")
    try:
        return f"content:{content_digest(path)}"
    except OSError:
        return f"{lora.lora_name}:{path}"


def extra_keys(request: Any) -> ExtraKeys:
    """LoRA, cache salt and multimodal inputs of a request: all change its cache."""
    lora = getattr(request, "lora_request", None)
    lora_key_ = lora_key(lora) if lora is not None else None
    mm = []
    for f in getattr(request, "mm_features", None) or []:
        pos = f.mm_position
        mm.append(MultimodalItem(str(f.identifier), int(pos.offset), int(pos.length)))
    return ExtraKeys(lora=lora_key_, cache_salt=getattr(request, "cache_salt", None), multimodal=tuple(mm))


@dataclass(kw_only=True)
class TrackedRequest:
    """What the scheduler side keeps of one request, from vLLM's first ask until it finishes."""

    req_id: str
    prompt: list[int]  # what its lookups are for
    extra: ExtraKeys
    # vLLM's own request: generated token ids are read from it as vLLM appends them
    source: Any = None
    # Token ids the engine has computed or will compute, prompt first, then generated tokens:
    # decode boundaries are keyed by these, so the next turn of a conversation finds them.
    tokens: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chain hashes over ``tokens``, as far as computed
    restore: Restore = field(default_factory=Restore)
    saved: int = 0  # highest block-aligned boundary already handed to the workers to save
    saved_tail: int = 0  # highest tail boundary (inside a block) handed to them, once each
    last_capture: int = 0  # its last boundary the admission policy admitted
    # Its last output boundary, held by the workers until it finishes (output_boundaries: last)
    hold: SaveSpec | None = None
    counted: bool = False  # told the admission policy whether it shares a prefix (once)
    # Tracked before the engine's cache was reset (new weights): it restores and saves nothing
    # from then on, since its keys are the old epoch's and its blocks mix both weights.
    stale: bool = False

    @classmethod
    def of(cls, request: Any, epoch: str | None = None) -> TrackedRequest | None:
        """Track vLLM's ``request``, keyed in ``epoch`` (``ExtraKeys.epoch``); None for one with
        no token ids to key on (prompt embeddings) or whose token ids vLLM rewrites as it runs
        (a streaming-input session: ``compat.streams_input``)."""
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is None or streams_input(request):
            return None
        extra = extra_keys(request)
        if epoch is not None:
            extra = dataclasses.replace(extra, epoch=epoch)
        return cls(req_id=request.request_id, prompt=list(prompt), extra=extra, source=request,
                   tokens=list(prompt))

    def known(self, upto: int) -> int:
        """How many of its tokens are known, read up to ``upto`` (the prompt, then the generated
        tokens vLLM has appended; with async scheduling the last one may not be known yet when
        the step that computes it is planned: then it is not counted)."""
        if len(self.tokens) < upto and self.source is not None:
            all_ids = getattr(self.source, "all_token_ids", None)
            if all_ids is not None and len(all_ids) > len(self.tokens):
                self.tokens.extend(int(t) for t in all_ids[len(self.tokens) : upto])
        return len(self.tokens)

    def chain(self, upto_tokens: int, block_size: int,
              hasher: Callable[[list[int], ExtraKeys, list[bytes]], list[bytes]]) -> list[bytes]:
        """The hashes naming its prefix of ``upto_tokens`` (``Vault.prefix_hashes``: its full
        blocks' chain hashes, computed on first need and kept, then its tail hash if it ends
        inside a block)."""
        n = upto_tokens // block_size
        if len(self.hashes) < n or upto_tokens % block_size:
            named = hasher(self.tokens[:upto_tokens], self.extra, self.hashes[:n])
            if len(self.hashes) < n:
                self.hashes = named[:n]
            return named
        return self.hashes[:n]
