"""What each step hands the workers to save, to hold, or to release: the scheduler's save plans.

Saves are stored by the workers after the step that planned them. For each request a step
computes, ``planner.plan_step`` picks the candidate boundaries from what the step shows (its
chunk, the states vLLM offered, the state the step leaves at its end) and the admission policy,
and the boundary rule (``plan_saves``) decides which of them can publish: a save of the KV
blocks since the request's last save and the states at the boundaries. Each save is in flight
(``SavesInFlight``) until every rank reports it settled; one that settles unpublished sends
its request's next save back to that save's parent.

With ``output_boundaries: last`` a request's output boundary is held, not saved: the workers
copy its states into a slot and keep them, each new output boundary replacing the last; when
the request finishes, its hold is released to be stored (its blocks are kept until the workers
read them) or dropped (``HoldDrop``). Under async scheduling the token a decode step consumes
is not known when the step is planned: the step's output boundary is held all the same (a
deferred hold, its key not named yet); with ``last`` it is named when the request finishes,
with ``every`` as soon as its tokens are known (a step or two later: released while the request
runs, ``Release.running``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from functools import partial
from typing import Any

from prefixvault.admission import Kind
from prefixvault.boundary import (
    SavePlan,
    StateCapture,
    StepChunk,
    max_resume_tokens,
    plan_saves,
    step_end_captures,
)
from prefixvault.vllm.compat import InternalCheckpoints, step_starts
from prefixvault.vllm.config import OutputBoundaries
from prefixvault.vllm.metadata import Release, SaveSpec, SavesSettled
from prefixvault.vllm.planner import StepView, plan_step
from prefixvault.vllm.request import TrackedRequest
from prefixvault.vllm.scheduler_context import SchedulerContext

#: How a request may end for its held output boundary to be stored (vLLM's ``RequestStatus``
#: names): a stop token, its length limit, a repetition stop, or an abort — which is also how
#: vLLM ends a request at a stop *string* (the frontend finds it and aborts the request); the
#: boundary held is complete and exact whatever came after it. Failed: dropped.
STORED_AT_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION",
                              "FINISHED_ABORTED"})


class HoldDrop(StrEnum):
    """Why a held output boundary was dropped unstored."""

    PREEMPTED = "preempted"  # the request was preempted: it is computed again
    REQUEST_FAILED = "request_failed"  # it ended in a way that keeps no output (not ``STORED_AT_FINISH``)
    BLOCKS_MOVED = "blocks_moved"  # a KV block the boundary needs was let go (a sliding window, say)
    INTERNAL_ERROR = "internal_error"  # an error of ours (logged with its traceback)
    # (``every``, async) the save it extends was not published: it names a record that never came
    PARENT_UNPUBLISHED = "parent_unpublished"
    # (async) the request ended (aborted, say) before the token its hold ends on was known: the
    # hold was made over a token still being sampled, which vLLM then dropped
    UNSAMPLED = "unsampled"


class SavePlans:
    """The scheduler side's owner of saves (see the module)."""

    def __init__(self, ctx: SchedulerContext, checkpoints: InternalCheckpoints | None = None) -> None:
        """``checkpoints``: vLLM's rule for states its layers export from inside a prompt's
        last chunk, where this platform's kernels do (None: every offer strictly inside a chunk
        is refused)."""
        self.ctx = ctx
        self.settings, self.layout, self.guard = ctx.settings, ctx.layout, ctx.guard
        self.counters, self.admission, self.in_flight = ctx.counters, ctx.admission, ctx.in_flight
        self.checkpoints = checkpoints
        self.block_size = ctx.layout.block_size
        self.state_groups = [i for i, g in enumerate(ctx.layout.groups) if g.is_state]
        self.attn_groups = [i for i, g in enumerate(ctx.layout.groups) if not g.is_state]
        self.hold_last = (ctx.settings.capture_outputs
                          and ctx.settings.output_boundaries is OutputBoundaries.LAST)
        # Held saves to store or drop, for the next step's workers (a store: with its boundaries,
        # and for a running request's, the parent its next save goes back to if this one is
        # not published; -1: none).
        self._releases: list[tuple[Release, list[bytes], int]] = []

    # -- a step -----------------------------------------------------------------------------------

    def plan(self, out: Any, step: int, requests: Mapping[str, TrackedRequest]) -> list[SaveSpec]:
        """The saves of step ``step`` (vLLM's scheduler output ``out``); one request's error
        skips its own saves only."""
        state = getattr(out, "kv_connector_block_state", None)
        if state is None:
            return []
        offers: dict[str, list[tuple[int, int, int]]] = state.boundary_state_offloads or {}
        starts = step_starts(out)
        drafts = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        saves: list[SaveSpec] = []
        for req_id, n_new in out.num_scheduled_tokens.items():
            tr = requests.get(req_id)
            if tr is None or tr.stale or req_id not in starts:
                continue
            saves += self.guard.call("build_connector_meta",
                                     partial(self._plan_request, tr, step, starts[req_id], n_new, state,
                                             offers, bool(drafts.get(req_id))),
                                     list)
        return saves

    def take_releases(self, step: int, now: float) -> list[Release]:
        """The held saves to store or drop in step ``step``; lookups of a stored one's prefix
        wait for it, as for any save in flight."""
        releases = []
        for release, boundaries, parent in self._releases:
            releases.append(release)
            if release.store:
                self.in_flight.add(release.sid(step), boundaries, now, release.req_id if parent >= 0 else "",
                                   parent)
        self._releases = []
        return releases

    def settle(self, report: SavesSettled, requests: Mapping[str, TrackedRequest]) -> None:
        """Workers' reports of saves stored or dropped: lookups they held may go on. A save not
        published makes its request plan the next one from that save's parent again (its later
        boundaries would otherwise name a parent record that never came)."""
        for req_id, parent in self.in_flight.settle(report):
            tr = requests.get(req_id)
            if tr is not None:
                tr.saved = min(tr.saved, parent)

    def _plan_request(self, tr: TrackedRequest, step: int, start: int, n_new: int, state: Any,
                      offers: dict[str, list[tuple[int, int, int]]], speculative: bool = False
                      ) -> list[SaveSpec]:
        """What one request's step lets it publish, as the boundary rule decides: a save, a
        hold, or both (a save of its other boundaries, and its prompt's end held)."""
        bs = self.block_size
        if tr.hold is not None and tr.hold.deferred and not self.hold_last:
            self._release_known(tr, state)
        chunk = self._chunk(tr, start, start + n_new)
        prompt_len = len(tr.prompt)
        # Generated tokens: boundaries over them are kept with capture_outputs, from decode
        # steps that end on a block boundary and compute no draft tokens (a rejected draft
        # would leave a state past what the request keeps).
        outputs = self.settings.capture_outputs and not speculative
        if start >= prompt_len and (not outputs or chunk.end % bs):
            return []
        known = tr.known(chunk.end) if outputs and chunk.end > prompt_len else prompt_len
        deferred = False
        if start >= known:  # the tokens this step computes are not known yet (async scheduling)
            if not (prompt_len <= start and known < chunk.end):
                return []
            # An output boundary needs its key only when it is stored: the state is held now
            # (as the step ends), the key named once the tokens are known (``_release_known``,
            # or with ``last`` when the request finishes).
            known, deferred = chunk.end, True
        tables = state.get_block_ids(tr.req_id)
        if tables is None:
            return []
        end = min(chunk.end, known)
        offered = [StateCapture(g, t, b, step) for g, b, t in offers.get(tr.req_id, []) if t <= end]
        at_end = step_end_captures(self.layout, chunk, known, {g: tables[g] for g in self.state_groups}, step)
        view = StepView(bs, prompt_len, start, chunk, known, tr.saved, tr.last_capture, self.hold_last,
                        bool(self.state_groups), tuple(offered), tuple(at_end), tr.saved_tail)
        planned = plan_step(view, self.admission.admits, self.kinds(tr, prompt_len))
        tr.last_capture = planned.last_capture
        captures, end = list(planned.captures), planned.end
        specs = []
        if deferred and not planned.candidates:
            return []
        if planned.candidates:
            specs += self._plan(tr, step, end, tables, captures, chunk, set(planned.candidates),
                                planned.hold or deferred, deferred)
        if planned.held_end:
            specs += self._plan(tr, step, end, tables, captures, chunk, {planned.held_end}, True)
        return specs

    def _chunk(self, tr: TrackedRequest, start: int, end: int) -> StepChunk:
        """The request's chunk this step, with the checkpoint its layers exported inside it
        where vLLM's rule says they did (prefill end as vLLM's scheduler counts it: a resumed
        request replays its output tokens too)."""
        if self.checkpoints is None:
            return StepChunk(start, end)
        prompt = int(getattr(tr.source, "num_prompt_tokens", len(tr.prompt)))
        prefill_end = max(prompt, int(getattr(tr.source, "num_tokens", prompt)) - 1)
        return StepChunk(start, end, self.checkpoints.position(start, end, prefill_end))

    def _plan(self, tr: TrackedRequest, step: int, end: int, tables: Any, captures: list[StateCapture],
              chunk: StepChunk, candidates: set[int], hold: bool, deferred: bool = False) -> list[SaveSpec]:
        """Plan the saves of ``candidates`` since the request's last save: a save now, or its
        hold (``hold``: published, if at all, when the request finishes, ``release_hold``).
        Block-aligned boundaries go in one save; each tail boundary in one of its own (its
        hashes end with its tail hash), extending the last block-aligned one (a tail is never a
        parent: ``tr.saved`` counts block-aligned boundaries only)."""
        bs = self.block_size
        decision = plan_saves(self.layout, end, {g: tables[g] for g in self.attn_groups}, captures,
                              step, candidates, chunk, since=tr.saved)
        for _, why in decision.refused:
            self.counters.tally("refused", why)
        if not decision.publishable:
            return []
        if hold and deferred:  # (with ``every``, a request's earlier deferred hold was released)
            tr.hold = SaveSpec(tr.req_id, [], list(decision.publishable), tr.saved, hold=True, deferred=True,
                               salt=tr.extra.cache_salt)
            return [tr.hold]
        if hold:
            tr.hold = self._spec(tr, list(decision.publishable), tr.saved, hold=True)
            tr.saved_tail = max(tr.saved_tail, tr.hold.tail)
            return [tr.hold]
        aligned = [p for p in decision.publishable if p.tokens % bs == 0]
        saved, specs = tr.saved, []
        if aligned:
            specs.append(self._spec(tr, aligned, saved))
            tr.saved = max(tr.saved, max(p.tokens for p in aligned))
        for plan in decision.publishable:
            if plan.tokens % bs:
                parent = max([saved, *(p.tokens for p in aligned if p.tokens < plan.tokens)])
                blocks = tuple(b for b in plan.blocks if b[1] >= parent // bs)  # (the parent's are stored)
                own = SavePlan(plan.tokens, blocks, plan.states)
                specs.append(self._spec(tr, [own], parent))
                tr.saved_tail = max(tr.saved_tail, plan.tokens)
        kinds = self.kinds(tr, len(tr.prompt))
        for spec in specs:
            self.counters.add(plans=len(spec.plans))
            boundaries = [self.ctx.chain(tr, p.tokens)[-1] for p in spec.plans]
            if self.state_groups:
                for p, h in zip(spec.plans, boundaries, strict=True):
                    self.admission.admitted(h, kinds(p.tokens))
            self.in_flight.add(spec.sid(step), boundaries, time.monotonic(), tr.req_id, spec.parent)
        return specs

    def _spec(self, tr: TrackedRequest, plans: list[SavePlan], parent: int, hold: bool = False) -> SaveSpec:
        """A save of ``plans`` (of one kind: block-aligned boundaries, or one tail boundary)."""
        top = max(p.tokens for p in plans)
        tail = top if top % self.block_size else 0
        seed = self.ctx.vault.seed(tr.extra) if tail else b""
        return SaveSpec(tr.req_id, self.ctx.chain(tr, top), plans, parent, hold=hold, tail=tail, seed=seed,
                        salt=tr.extra.cache_salt)

    def kinds(self, tr: TrackedRequest, prompt_len: int) -> Callable[[int], Kind]:
        """What a boundary of this request is: vLLM's prompt checkpoint (the last block
        boundary that leaves a token to compute: where the same prompt sent again resumes), its
        sequence end as far as the connector knows (where a longer prompt that extends it
        resumes: the prompt's exact end for a model with state, else its last block boundary;
        the last one before the request finishes is not known in time), or the junction vLLM
        found with an earlier request's tokens."""
        bs = self.block_size
        checkpoint = max_resume_tokens(prompt_len, bs)
        last = prompt_len if self.state_groups else prompt_len // bs * bs
        junction = int(getattr(tr.source, "shared_prefix_boundary", 0) or 0)

        def kinds(tokens: int) -> Kind:
            k = Kind(0)
            if tokens == checkpoint:
                k |= Kind.PROMPT_END
            if tokens == last:
                k |= Kind.SEQUENCE_END
            if tokens == junction:
                k |= Kind.JUNCTION
            return k
        return kinds

    # -- held output boundaries -------------------------------------------------------------------

    def drop_hold(self, tr: TrackedRequest, why: HoldDrop) -> None:
        """The workers free a request's held save, unstored; counted by ``why``."""
        assert tr.hold is not None
        self._releases.append((Release(tr.hold.req_id, False), [], -1))
        self.counters.tally("holds_dropped", why)
        tr.hold = None

    def finished(self, tr: TrackedRequest, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """A request finished: its hold is stored or dropped (an error here still frees the
        workers' hold, and keeps no block). Whether vLLM must keep its blocks until the
        workers read them."""
        if tr.hold is None:
            return False

        def dropped() -> bool:
            if tr.hold is not None:
                self.drop_hold(tr, HoldDrop.INTERNAL_ERROR)
            return False
        return bool(self.guard.call("request_finished", lambda: self._release_hold(tr, request, block_ids),
                                    dropped))

    def _release_hold(self, tr: TrackedRequest, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """Store a finished request's held output boundary, unless it failed, if every KV block
        its plans read is still the request's, at the same place (blocks a sliding window let
        go of, or a preemption replaced, are not)."""
        spec = tr.hold
        assert spec is not None
        if getattr(getattr(request, "status", None), "name", "") not in STORED_AT_FINISH:
            self.drop_hold(tr, HoldDrop.REQUEST_FAILED)
            return False
        if not _blocks_kept(spec, block_ids):
            self.drop_hold(tr, HoldDrop.BLOCKS_MOVED)
            return False
        named: list[bytes] = []
        if spec.deferred:  # keyed now: every token it holds is known once the request finished
            top = max(p.tokens for p in spec.plans)
            if tr.known(top) < top:
                self.drop_hold(tr, HoldDrop.UNSAMPLED)
                return False
            spec = dataclasses.replace(spec, hashes=self.ctx.chain(tr, top), deferred=False)
            named = spec.hashes
        self._store_hold(tr, spec.hashes, Release(spec.req_id, True, named),
                         Kind.SEQUENCE_END if self.state_groups else None)
        return True

    def _release_known(self, tr: TrackedRequest, state: Any) -> None:
        """``output_boundaries: every``: store a running request's deferred hold once every
        token it holds is known (the request is in this step, so its blocks are its own until
        the workers read them, after this step's forward). A KV block the hold reads that the
        request let go of (a sliding window) drops it, as does a parent save that settled
        unpublished since the hold was planned (the hold would name its missing record, and
        the request's later saves chain from it)."""
        spec = tr.hold
        assert spec is not None
        if tr.saved < spec.parent:  # its parent's save settled unpublished since it was planned
            self.drop_hold(tr, HoldDrop.PARENT_UNPUBLISHED)
            return
        top = max(p.tokens for p in spec.plans)
        if tr.known(top) < top:
            return
        tables = state.get_block_ids(tr.req_id)
        if tables is None or not _blocks_kept(spec, tables):
            self.drop_hold(tr, HoldDrop.BLOCKS_MOVED)
            return
        hashes = self.ctx.chain(tr, top)
        self._store_hold(tr, hashes, Release(spec.req_id, True, hashes, running=True),
                         Kind.OUTPUT if self.state_groups else None, spec.parent)
        tr.saved = max(tr.saved, top)

    def _store_hold(self, tr: TrackedRequest, hashes: list[bytes], release: Release, kind: Kind | None,
                    parent: int = -1) -> None:
        """Hand the workers ``release``, storing the request's hold under ``hashes``: its
        boundaries (a tail's too) in flight, told to the admission policy as ``kind`` (None: not)."""
        spec = tr.hold
        assert spec is not None
        boundaries = [hashes[-(-p.tokens // self.block_size) - 1] for p in spec.plans]
        if kind is not None:
            for h in boundaries:
                self.admission.admitted(h, kind)
        self.counters.add(plans=len(spec.plans))
        self._releases.append((release, boundaries, parent))
        tr.hold = None


def _blocks_kept(spec: SaveSpec, block_ids: Sequence[Sequence[int]]) -> bool:
    """Whether every KV block a held save reads is still its request's, at the same place."""
    return all(g < len(block_ids) and i < len(block_ids[g]) and block_ids[g][i] == b
               for p in spec.plans for g, i, b in p.blocks)
