"""How many tokens each turn of a conversation computes again that the previous turn had computed.

    python bench/turns.py [--versions 0.32.0,0.33.0,0.34.0] [-j 2] [--schedulers sync,async]
        [--block-sizes 528,1056,1568] [--units block,16] [--checkpoints 0,1]
        [--templates kept,dropped] [--columns vllm,prefixvault,capture,every] [--turns 6]
        [--first 3000] [--answer 200] [--message 400] [--budget 8192] [--lockstep] [--cpu-kernels]

Why: chats and agents send, each turn, the previous prompt, often the previous answer, and a
new message. Whatever the previous turn computed and this turn computes again is prefill
wasted; an external cache is worth what it saves there (issue 45).

Measured on vLLM's real scheduler and KV cache manager (``tests/contract/scheduler_harness.py``:
plain Python, no GPU, no model; the bench plays the workers and the model), with a
Qwen3-Next/Qwen3.5-shaped cache: one full-attention group and ``STATE_GROUPS`` GDN state groups
(48 layers, every 4th full attention: vLLM groups them 12 a group), align mode, prefix caching
on, ``--budget`` tokens per step (``max_num_batched_tokens``), a pool of 4000 blocks (nothing is
evicted). A conversation: ``--turns`` turns, one request at a time; turn 1 a prompt of
``--first`` random token ids; each turn generates ``--answer`` tokens (``max_tokens``; the fake
model samples one fixed token) and the next turn's prompt is, by its template,

- ``kept``: this turn's prompt + its generated tokens + a new message of ``--message`` tokens;
- ``dropped``: this turn's prompt + the new message (a chat template that drops the previous
  answer, as Qwen3's drops reasoning).

Rows: vLLM's block size (528 / 1056 / 1568: its hybrid blocks on GPUs), its hash unit
(``--prefix-match-unit``: the block, or 16 tokens), the prefill checkpoint blocks the state
layers reserve (0, or 1 as Mamba2 and FlashInfer GDN do), the template. Columns:

- ``vllm``: vLLM's own prefix cache: one engine serves the whole conversation; its connector's
  saves are all dropped (a store that keeps nothing), so every hit is vLLM's own (the same hits,
  turn by turn, as vLLM's scheduler built without a connector: checked on 0.32, sync).
- ``prefixvault``: turns alternate between two engines over one store: what the other engine
  computed comes from the store (the workers store and publish what the connector plans,
  through its own vault, as ``WorkerSide`` does); an engine's own cache still holds what it
  computed two turns before.
- ``capture``: the same with ``capture_outputs: true`` (``output_boundaries: last``: a
  request's last output boundary is held and stored when it finishes; the workers here hold,
  store and report it sent as ``WorkerSide`` does).
- ``every``: the same with ``output_boundaries: every`` (each output boundary stored as its
  step ends, or under async scheduling held until its token is known, then stored while the
  request runs).

Per cell: the tokens per turn that the previous turn had computed and this turn computes
again, averaged over turns 2..N: (the previous turn's prompt, plus, with ``kept``, its
generated tokens but the last, which it sampled and never ran) minus (the tokens this turn
did not compute: vLLM's local hit plus the external hit the connector answered, read as the
start of the turn's first chunk). ``goal`` is the most the connector should recompute: 0 with
``dropped`` (the previous prompt's exact end is published); with ``kept``, the prefixvault
column the generated tokens but the last (the previous prompt's end is the deepest boundary
it has), the capture and every columns the generated tokens past the last output boundary (a
block boundary inside the answer). A cell over its goal, or a prefixvault cell over vLLM's own,
is flagged with ``!``. The JSON has every turn (its restored depth, split into vLLM's local hit
and the external hit) and per cell the engines' steps, the steps scheduled with another in
flight, the in-chunk checkpoints published and the output boundaries published.

Schedulers: ``sync``, vLLM's ``Scheduler`` (``--no-async-scheduling``): each step's output
lands before the next step is scheduled. ``async``, its ``AsyncScheduler`` with
``async_scheduling`` on (CUDA's default), driven as the engine core's batch queue drives it
(``step_with_batch_queue``, two batches deep: a step is scheduled before the previous one's
output lands, its sampled token a placeholder); ``--lockstep`` lands each step's output
before the next is scheduled instead (every placeholder resolved at once, checked). With the
batch queue the token a decode step consumes is not known when the step is planned: the
connector holds the output boundary all the same and names it when the request finishes
(``output_boundaries: last``) or once the token is known (``every``), so the async capture and
every cells equal the sync ones.

Modelled: vLLM's scheduling, KV cache manager (its prefix cache, align mode's state blocks,
checkpoint offers, hash units) and request lifecycle (delayed frees of held saves included),
the connector's scheduler side whole, and its workers' effects on the store and the scheduler
(saves published, holds stored at finish, synchronous loads handed over). Not modelled: time
(a step costs nothing; saves are published in the step that plans them, and restores are
answered and loaded in the step that asks, ``restore_in_step`` as the connector sets it on a CPU
engine over an in-process store, where a CUDA engine over a local store would take a step or
more: the depth is the same), bytes
(objects are zeros of the right size), a model (the sampled token is fixed; no stop token),
several requests at once, preemption (the pool never runs out), and a request's arrival
while the previous step is in flight (a turn arrives once the previous one finished and the
engine drained). Checkpoint blocks 1: by default the state layers export the checkpoint from
inside a chunk, as CUDA's kernels do (the connector's platform seam marks this platform as
exporting, and the harness checks the in-chunk boundaries against vLLM's rule);
``--cpu-kernels``: as vLLM CPU, which exports none. Every step is checked as the contract suite
checks it (``Engine``; held saves and output boundaries by this bench).

0.32.0 is the installed vLLM; other versions run from their extracted sources
(``tools/vllm_versions.py``: first on PYTHONPATH, in a process of their own). The last line is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "contract"
#: Qwen3-Next's 36 GDN layers, 12 a group (as its 12 full-attention layers).
STATE_GROUPS = 3
#: The engine core's batch queue under async scheduling (``max_concurrent_batches``).
ASYNC_BATCHES = 2
COLUMNS = ("vllm", "prefixvault", "capture", "every")
SCHEDULERS = ("sync", "async")
TEMPLATES = ("kept", "dropped")


@dataclasses.dataclass(frozen=True)
class Conversation:
    turns: int = 6
    first: int = 3000
    answer: int = 200
    message: int = 400
    budget: int = 8192
    seed: int = 45


@dataclasses.dataclass(frozen=True)
class Row:
    block_size: int
    unit: int  # vLLM's hash unit; 0: the block
    checkpoints: int
    template: str

    @property
    def key(self) -> str:
        unit = self.unit or "block"
        return f"bs{self.block_size}-unit{unit}-ckpt{self.checkpoints}-{self.template}"


@dataclasses.dataclass
class Turn:
    prompt: int  # this turn's prompt tokens
    previous: int  # of them, tokens the previous turn computed
    restored: int  # tokens not computed: vLLM's local hit + the external hit
    local: int  # vLLM's own hit
    outputs: int  # tokens generated

    @property
    def recomputed(self) -> int:
        return max(0, self.previous - self.restored)


# -- the engines (the harness is imported once the vLLM to run is on the path) -------------------


def harness() -> ModuleType:
    if str(HARNESS) not in sys.path:
        sys.path.insert(0, str(HARNESS))
    return importlib.import_module("scheduler_harness")


def turn_engine_class(h: ModuleType) -> type:
    """The harness's ``Engine`` with the workers' part for dropped saves (the ``vllm`` column)
    and for held output boundaries (``capture_outputs``), which the contract suite's engines do
    not play."""
    from vllm.v1.outputs import KVConnectorOutput

    from prefixvault.vllm.metadata import SaveSpec, SavesSettled

    class TurnEngine(h.Engine):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, keeps_saves: bool = True, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.keeps_saves = keeps_saves
            self.held: dict[str, SaveSpec] = {}  # the workers' held save of each request
            self.sent: set[str] = set()  # requests whose held save was read: reported sent
            self.placeholders_left = 0  # placeholders unresolved after a step landed (lockstep)
            self.overlapped = 0  # steps scheduled with another in flight (the batch queue)
            self.outputs_published = 0  # output boundaries stored and published

        def _check_step(self, step: Any) -> None:
            """The contract suite's checks on the prompt's boundaries; output boundaries
            (``capture_outputs``) checked here: each held at its chunk's end, on a block
            boundary, past the prompt, its states real blocks."""
            meta, p = step.meta, self.problems
            prompt_saves = []
            for spec in meta.saves:
                chunk = step.chunks.get(spec.req_id)
                outputs = chunk is not None and any(pl.tokens > chunk.prompt_len for pl in spec.plans)
                if not outputs and not (spec.hold and chunk is not None and chunk.start >= chunk.prompt_len):
                    prompt_saves.append(dataclasses.replace(spec, hold=False))
                    continue
                where = f"step {step.number} {spec.req_id}: output save {[pl.tokens for pl in spec.plans]}"
                p.check(chunk is not None and not chunk.drafts, f"{where}: not scheduled, or drafts")
                for pl in spec.plans:
                    at_end = chunk is not None and pl.tokens == chunk.end > chunk.prompt_len
                    p.check(at_end and pl.tokens % self.bs == 0, f"{where}: not a block boundary at its end")
                    p.check(sorted(g for g, _ in pl.states) == self.state_groups
                            and all(b != 0 for _, b in pl.states), f"{where}: states {pl.states}")
            super()._check_step(dataclasses.replace(step, meta=dataclasses.replace(
                meta, saves=prompt_saves, releases=[])))

        def _work(self, meta: Any) -> tuple[set[str], Any]:
            """Releases first (a request computed again drops its old hold, then holds anew),
            then the saves and loads as the harness's workers do them, then the new holds."""
            if not self.keeps_saves:  # a store that keeps nothing: every save settled unpublished
                self.problems.check(not meta.loads, "a load from a store that keeps nothing")
                settled = SavesSettled()
                for spec in meta.saves:
                    sid = spec.sid(meta.step)
                    settled.ranks[sid] += 1
                    settled.failed[sid] += 1
                return set(), settled if meta.saves else None
            released = SavesSettled()
            for rel in meta.releases:
                held = self.held.pop(rel.req_id, None)
                if not rel.store:
                    continue
                sid = rel.sid(meta.step)
                released.ranks[sid] += 1
                if not rel.running:  # (a running request's blocks stay its own)
                    self.sent.add(rel.req_id)
                if held is None:
                    released.failed[sid] += 1
                    continue
                # (a hold planned before its tokens were known is named by its release)
                named = dataclasses.replace(held, hold=False, deferred=False,
                                            hashes=rel.hashes or held.hashes)
                if not self._publish(named):
                    released.failed[sid] += 1
                elif max(pl.tokens for pl in held.plans) > self.requests[rel.req_id].num_prompt_tokens:
                    self.outputs_published += 1
            recving, settled = super()._work(meta)
            for spec in meta.saves:
                if spec.hold:
                    self.held[spec.req_id] = spec
                elif (max(pl.tokens for pl in spec.plans) > self.requests[spec.req_id].num_prompt_tokens
                      and settled is not None and not settled.failed[spec.sid(meta.step)]):
                    self.outputs_published += 1  # (``every``, stored as its step ends)
            if released.ranks:
                settled = released if settled is None else settled.aggregate(released)
            return recving, settled

        def _publish(self, spec: SaveSpec) -> bool:
            vault = self.vault

            def read(ref: Any, block_id: int) -> bytes:
                return bytes(vault.layout.groups[ref.group].nbytes(ref.rank))

            (acks,) = vault.save_many(0, [(spec.hashes, spec.plans)], read)
            (results,) = vault.publish_many([(spec.hashes, acks, spec.parent)], seeds=[spec.seed or None])
            tokens = list(self.requests[spec.req_id].all_token_ids)
            for b, why in results.items():
                self.problems.check(why is None, f"{spec.req_id}: held boundary {b} not published: {why}")
                if why is None:
                    self.published.add(self.space(self.requests[spec.req_id]), tokens[:b])
            return all(why is None for why in results.values())

        def _connector_output(self, recving: set[str], settled: Any) -> Any:
            out = super()._connector_output(recving, settled)
            if self.sent:
                out = out if out is not None else KVConnectorOutput()
                out.finished_sending = set(self.sent)
                self.sent.clear()
            return out

        def land(self, launched: Any) -> None:
            super().land(launched)
            self.placeholders_left = sum(r.num_output_placeholders for r in self.scheduler.requests.values())

        def drive(self, depth: int) -> None:
            """Step until the engine has nothing left, ``depth`` steps in flight at most, as
            vLLM's engine core does (``step_with_batch_queue``; 1: ``step``)."""
            sched, queue = self.scheduler, deque[Any]()
            for _ in range(h.MAX_STEPS):
                if not sched.has_requests() and not queue:
                    break
                if sched.has_requests():
                    self.overlapped += bool(queue)
                    launched = self.launch()
                    queue.append(launched)
                    executed = launched.out.total_num_scheduled_tokens > 0
                    if len(queue) < depth and (executed or sched.has_requests()):
                        continue
                landed = queue.popleft()
                self.land(landed)
                if depth == 1 and sched.scheduler_config.async_scheduling:
                    left = self.placeholders_left
                    self.problems.check(left == 0, f"step {landed.step.number}: {left} placeholders left")
                if not landed.step.chunks:
                    time.sleep(0.001)  # waiting on lookups only: give the lookup thread the core
            else:
                raise AssertionError(f"stuck after {h.MAX_STEPS} steps: {sched.get_request_counts()}")
            held = self.connector.scheduler.read_ahead_held
            self.problems.check(held == 0, f"{held} bytes read ahead still held with every request finished")
            assert not self.problems.found, "\n".join(self.problems.found[:20])

    return TurnEngine


@contextlib.contextmanager
def exporting_platform(on: bool) -> Iterator[None]:
    """This platform's kernels taken as exporting in-chunk checkpoints (CUDA's), through the
    connector's compatibility seam, while an engine is built (the connector reads it then)."""
    if not on:
        yield
        return
    from vllm.platforms import current_platform

    from prefixvault.vllm import compat

    was = compat.EXPORTING_PLATFORMS
    compat.EXPORTING_PLATFORMS = frozenset(was) | {current_platform.device_type}
    try:
        yield
    finally:
        compat.EXPORTING_PLATFORMS = was


def run_cell(h: ModuleType, cls: type, model_dir: Path, row: Row, column: str, scheduler: str,
             conv: Conversation, depth: int, export: bool) -> tuple[list[Turn], dict[str, int]]:
    """One conversation: its turns, as the column's engines served them, and what the engines
    counted: steps, steps scheduled with another in flight, in-chunk checkpoints published."""
    geo = h.Geometry("qwen3.5-gdn", row.block_size, "GDN_ATTN", row.checkpoints, state_groups=STATE_GROUPS,
                     hash_unit=row.unit)
    exporting = export and row.checkpoints > 0
    store = h.store_name()
    published = h.Published()
    extra = {"capture": {"capture_outputs": True},
             "every": {"capture_outputs": True, "output_boundaries": "every"}}.get(column, {})
    engines = []
    try:
        for _ in range(1 if column == "vllm" else 2):
            with exporting_platform(exporting):
                sched = h.build_scheduler(model_dir, geo, store, budget=conv.budget, extra=extra,
                                          async_scheduling=scheduler == "async")
            engines.append(cls(sched, geo, published, store, exporting=exporting,
                               keeps_saves=column != "vllm"))
        first, *messages = h.prompts(conv.seed, conv.first, *[conv.message] * (conv.turns - 1))
        prompt, previous, turns = list(first), 0, []
        for t in range(conv.turns):
            engine = engines[t % len(engines)]
            rid = f"turn-{t + 1}"
            req = h.make_request(rid, prompt, geo, max_tokens=conv.answer)
            engine.add(req)
            engine.drive(depth)
            asks = [a for a in engine.asks if a.req_id == rid and a.answer[0] is not None]
            start = min((s.chunks[rid].start for s in engine.steps if rid in s.chunks), default=0)
            external = asks[-1].answer[0] if asks else 0  # (the answer that let it be scheduled)
            outputs = list(req.output_token_ids)
            turns.append(Turn(len(prompt), previous, start, max(0, start - external), len(outputs)))
            if t + 1 < conv.turns:
                if row.template == "kept":
                    previous = len(prompt) + len(outputs) - 1
                    prompt = prompt + outputs + messages[t]
                else:
                    previous = len(prompt)
                    prompt = prompt + messages[t]
        stats = {"steps": sum(len(e.steps) for e in engines),
                 "overlapped": sum(e.overlapped for e in engines),
                 "in_chunk_checkpoints": sum(e.inside_published for e in engines),
                 "output_boundaries": sum(e.outputs_published for e in engines)}
    finally:
        for engine in engines:
            engine.close()
    return turns, stats


def goals(row: Row, column: str, turns: Sequence[Turn]) -> list[int] | None:
    """The most the connector should recompute in each turn 2..N, or None (vLLM's own cache)."""
    if column == "vllm":
        return None
    out = []
    for prev, turn in itertools.pairwise(turns):
        computed = turn.previous  # the previous prompt, and with ``kept`` its outputs but the last
        deepest = prev.prompt
        if column in ("capture", "every"):  # the last output boundary: a block boundary inside the answer
            deepest = max(deepest, computed // row.block_size * row.block_size)
        out.append(computed - deepest)
    return out


def rows(args: argparse.Namespace) -> list[Row]:
    return [Row(bs, unit, ckpt, template) for bs in args.block_sizes for unit in args.units
            for ckpt in args.checkpoints for template in args.templates]


def run_here(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell under the vLLM on this process's path."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm

    h = harness()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    cls = turn_engine_class(h)
    conv = Conversation(args.turns, args.first, args.answer, args.message, args.budget)
    cells: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="turns-model-") as tmp:
        for scheduler in args.schedulers:
            depth = 1 if scheduler == "sync" or args.lockstep else ASYNC_BATCHES
            for row in rows(args):
                for column in args.columns:
                    t0 = time.perf_counter()
                    turns, stats = run_cell(h, cls, Path(tmp), row, column, scheduler, conv, depth,
                                            not args.cpu_kernels)
                    total = sum(t.recomputed for t in turns[1:])
                    goal = goals(row, column, turns)
                    cells[f"{scheduler}/{row.key}/{column}"] = {
                        "recomputed": round(total / (len(turns) - 1), 1),
                        "goal": None if goal is None else round(sum(goal) / len(goal), 1),
                        "total": total,  # over turns 2..N (the cells are compared by it)
                        "goal_total": None if goal is None else sum(goal),
                        "turns": [dataclasses.asdict(t) | {"recomputed": t.recomputed} for t in turns],
                        **stats,
                        "seconds": round(time.perf_counter() - t0, 2),
                    }
    return {"version": vllm.__version__.split("+")[0], "seconds": round(time.perf_counter() - started, 1),
            "cells": cells}


# -- other vLLM versions: this script again, in a process of its own ------------------------------


def _tool() -> ModuleType:
    path = ROOT / "tools" / "vllm_versions.py"
    spec = importlib.util.spec_from_file_location("vllm_versions_tool", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def child_argv(args: argparse.Namespace) -> list[str]:
    """The options of this run, for this script under another vLLM (its JSON only)."""
    def joined(values: Iterable[object]) -> str:
        return ",".join(str(v) for v in values)
    out = ["--schedulers", joined(args.schedulers), "--block-sizes", joined(args.block_sizes),
           "--units", joined(u or "block" for u in args.units), "--checkpoints", joined(args.checkpoints),
           "--templates", joined(args.templates), "--columns", joined(args.columns),
           "--turns", str(args.turns), "--first", str(args.first), "--answer", str(args.answer),
           "--message", str(args.message), "--budget", str(args.budget), "--quiet"]
    return out + ["--lockstep"] * args.lockstep + ["--cpu-kernels"] * args.cpu_kernels


def run_version(version: str, argv: Sequence[str]) -> dict[str, Any]:
    """This script under ``version``'s vLLM (its sources first on PYTHONPATH, as
    ``tools/vllm_versions.py`` runs the contract suite); that run's figures."""
    tool = _tool()
    tool.fetch(version)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR",
               VLLM_CACHE_ROOT=str(tool.CACHE / f"cache-{version}"))
    src = tool.source_dir(version)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, __file__, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"vllm {version}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])["runs"][0]
    if result["version"] != version:
        raise SystemExit(f"asked for vllm {version}, ran {result['version']}")
    return result


# -- the table ------------------------------------------------------------------------------------


def flags(runs: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Cells over their goal, or recomputing more than vLLM's own cache: why, by cell."""
    out = {}
    for run in runs:
        for key, cell in run["cells"].items():
            if cell["goal"] is None:
                continue
            own = run["cells"].get(key.rsplit("/", 1)[0] + "/vllm")
            why = ([f"over its goal {cell['goal']:g}"] if cell["total"] > cell["goal_total"] else []) + (
                [f"over vLLM's own {own['recomputed']:g}"] if own and cell["total"] > own["total"] else [])
            if why:
                why.append(f"{cell['output_boundaries']} output boundaries published")
                out[f"{run['version']}/{key}"] = ", ".join(why)
    return out


def print_table(runs: Sequence[dict[str, Any]], args: argparse.Namespace, flagged: dict[str, str]) -> None:
    cols = args.columns
    head = (f"{'vllm':8}{'sched':7}{'block':>6}{'unit':>6}{'ckpt':>5}  {'template':9}"
            + "".join(f"{c:>13} " for c in cols) + "  goal")
    print(head)
    print("-" * len(head))
    for run in runs:
        for scheduler in args.schedulers:
            for row in rows(args):
                base = f"{scheduler}/{row.key}"
                line = (f"{run['version']:8}{scheduler:7}{row.block_size:>6}{row.unit or 'block':>6}"
                        f"{row.checkpoints:>5}  {row.template:9}")
                goals = []
                for c in cols:
                    cell = run["cells"][f"{base}/{c}"]
                    mark = "!" if f"{run['version']}/{base}/{c}" in flagged else " "
                    line += f"{cell['recomputed']:>13g}{mark}"
                    if cell["goal"] is not None:
                        goals.append(f"{cell['goal']:g}")
                print(f"{line}  {'/'.join(goals)}")


def print_depths(runs: Sequence[dict[str, Any]]) -> None:
    print("\nper turn 2..N: vLLM's local hit + the connector's external hit / tokens the previous turn "
          "computed")
    for run in runs:
        for key, cell in run["cells"].items():
            turns = cell["turns"][1:]
            depths = " ".join(f"{t['local']}+{t['restored'] - t['local']}/{t['previous']}" for t in turns)
            print(f"  {run['version']} {key:50} {depths}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _units(text: str) -> list[int]:
    return [0 if x == "block" else int(x) for x in _words(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=_words, default=None,
                    help="comma-separated vLLM versions, each in a process of its own (0.32.0: the "
                         "installed one); default: this process's vLLM")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="versions run at once (with --versions)")
    ap.add_argument("--schedulers", type=_words, default=list(SCHEDULERS), help="sync,async")
    ap.add_argument("--block-sizes", type=_ints, default=[528, 1056, 1568])
    ap.add_argument("--units", type=_units, default=[0, 16], help="vLLM's hash units: block, or tokens")
    ap.add_argument("--checkpoints", type=_ints, default=[0, 1], help="prefill checkpoint blocks: 0,1")
    ap.add_argument("--templates", type=_words, default=list(TEMPLATES), help="kept,dropped")
    ap.add_argument("--columns", type=_words, default=list(COLUMNS), help="vllm,prefixvault,capture,every")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first", type=int, default=3000, help="turn 1's prompt tokens")
    ap.add_argument("--answer", type=int, default=200, help="tokens each turn generates")
    ap.add_argument("--message", type=int, default=400, help="tokens of each new message")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--lockstep", action="store_true",
                    help="async: land each step's output before the next step is scheduled")
    ap.add_argument("--cpu-kernels", action="store_true",
                    help="checkpoint blocks 1: kernels that export no in-chunk checkpoint (vLLM CPU's)")
    ap.add_argument("--quiet", action="store_true", help="print the JSON line only")
    args = ap.parse_args(argv)
    bad = (set(args.schedulers) - set(SCHEDULERS)) | (set(args.templates) - set(TEMPLATES)) | (
        set(args.columns) - set(COLUMNS))
    if bad:
        ap.error(f"unknown: {sorted(bad)}")
    if args.turns < 2:
        ap.error("--turns must be at least 2")
    started = time.perf_counter()
    if args.versions:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            runs = list(pool.map(lambda v: run_version(v, child_argv(args)), args.versions))
    else:
        runs = [run_here(args)]
    flagged = flags(runs)
    if not args.quiet:
        kernels = "vLLM CPU's (no in-chunk export)" if args.cpu_kernels else "CUDA's (in-chunk export)"
        queue = "lockstep" if args.lockstep else f"a batch queue of {ASYNC_BATCHES}"
        print(f"{args.turns} turns: a first prompt of {args.first} tokens; each turn generates {args.answer} "
              f"and the next adds a {args.message}-token message; max_num_batched_tokens {args.budget}; "
              f"{STATE_GROUPS} GDN state groups; checkpoint blocks 1 with {kernels} kernels; async "
              f"scheduling driven as {queue}")
        print("Tokens per turn (2..N) that the previous turn computed and this turn computes again "
              "(! over its goal or over vLLM's own):\n")
        print_table(runs, args, flagged)
        print_depths(runs)
        print(f"\nflagged: {len(flagged)}" + "".join(f"\n  {k}: {v}" for k, v in flagged.items()))
        for run in runs:
            print(f"vllm {run['version']}: {run['seconds']} s")
        print(f"total {time.perf_counter() - started:.1f} s")
    conv = Conversation(args.turns, args.first, args.answer, args.message, args.budget)
    print(json.dumps({"conversation": dataclasses.asdict(conv), "state_groups": STATE_GROUPS,
                      "exporting_checkpoints": not args.cpu_kernels,
                      "async_batches": 1 if args.lockstep else ASYNC_BATCHES, "flagged": flagged,
                      "runs": list(runs), "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
