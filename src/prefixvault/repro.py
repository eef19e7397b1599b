"""``prefixvault repro``: the seed bug report's protocol, run end to end on one machine.

A cold engine without connector, a producer engine that fills the store, and a separate
consumer engine whose prompt shares a long prefix, each in its own process. The consumer
must restore the longest boundary that can truly resume, and give the tokens and logprobs of
a reference that computed the same chunks, bit for bit:

- by default every engine's prefill steps end on every block boundary (``max_num_batched_tokens``
  = the block size; for ``--model`` the block size is read from the engine first), so the cold
  run's steps end at whatever boundary the consumer restores, and cold is the reference;
- with a step size of the user's, where the cold run's steps do not end at the restored
  boundary, a restore can only equal what the same engine computes from its *own* prefix cache
  at that boundary: an engine without the connector serves the producer's prompt and then the
  consumer's (``local``), and that is the reference; cold then differs only as chunking does,
  and repro says so rather than calling it a divergence.

Where vLLM CPU cannot run a layout at the step size asked (Mamba2 layers need one block per
step), repro runs it at one block per step and says why. ``--control`` adds a negative control:
a consumer that restores a deliberately wrong state (``vllm/negative_control.py``) must diverge, or the
model cannot judge a wrong state.

``--turns N`` checks a conversation instead: each turn n >= 2 must restore exactly where the
previous turn's prompt ended and equal a cold run whose steps end there (``_conversation``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.scenarios import scenario
from prefixvault.scenarios.engine import (
    Completion,
    EngineSpec,
    common_prefix,
    completions,
    divergence,
    identical,
    max_logprob_diff,
    run_engine,
)

#: The negative control's connector (``--control``), and the line it logs per state it zeroes.
CONTROL_CONNECTOR = ("PrefixVaultControlConnector", "prefixvault.vllm.negative_control")
ZEROED_LINE = "prefixvault: negative control: zeroed"

#: Engine arguments for a real checkpoint given with --model (the report's settings).
REAL_MODEL_ENGINE: dict[str, Any] = {
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_model_len": 4096,
    # one request at a time; vLLM wants max_num_batched_tokens >= max_num_seqs, and repro may run
    # one block (as few as 16 tokens) per step
    "max_num_seqs": 16,
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
    turns: int = 1  # > 1: a conversation, each turn n >= 2 checked against a reference of its own
    template: str = "keep"  # keep: turn n's prompt = turn n-1's prompt + its answer + a message;
    #                         drop: turn n-1's prompt + a message
    capture_outputs: bool = False
    control: bool = False  # also run a consumer that restores a wrong state: it must diverge


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
    reference: str = "cold"  # what the consumer was compared with, bit for bit
    notes: list[str] = field(default_factory=list)  # choices repro made, and why
    cold_equal: bool = True  # whether the consumer also equals cold (not the claim where the
    # reference is the engine's own prefix cache)
    control: ControlResult | None = None
    template: str = ""  # with --turns: keep or drop (the previous answer in the next prompt or not)


@dataclass
class ControlResult:
    """The negative control: a consumer restoring a wrong state (zeros) at the same boundary."""

    hit: int
    states_zeroed: bool
    diverged: bool
    max_abs_logprob_diff: float  # over the top-k tokens both report, up to where the ids part
    parted_at: int | None = None  # first generated token whose id differs (None: none does)


@dataclass
class TurnResult:
    """One turn of a conversation (``--turns``): what its consumer restored against the longest
    boundary published for its prompt, and how it compares with its reference."""

    prompt_tokens: int
    hit: int
    longest: int  # the boundary a lookup of this prompt finds (tail boundaries too); -1: turn 1
    identical: bool | None  # ids and top-k logprobs equal to the reference's; None: no reference ran
    max_abs_logprob_diff: float
    previous_prompt_tokens: int = 0  # where the previous turn's prompt ended
    max_num_batched_tokens: int = 0  # of every engine of this turn
    reference: str = ""  # what the consumer was compared with, and what is claimed
    exact: bool = False  # whether bit-identity with the reference is claimed (and checked)


#: Architectures whose vLLM CPU Mamba2 kernels need every prefill step to be one block (a
#: step spanning a block boundary fails inside vLLM: ``IndexError`` in ``mamba_mixer2``).
MAMBA2_ARCHITECTURES = ("Mamba2", "Zamba2", "NemotronH", "GraniteMoeHybrid", "FalconH1", "Bamba", "Plamo2")


def _architectures(model: str) -> list[str]:
    try:
        return list(json.loads((Path(model) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


def _engine_args(cfg: ReproConfig) -> tuple[str, dict[str, Any]]:
    from prefixvault.scenarios.models import build_model, engine_kwargs

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


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return str(current_platform.device_type) == "cpu"


def _one_block_per_step(cfg: ReproConfig, model: str) -> bool:
    """Whether every prefill step must be one block: Mamba2 layers on vLLM CPU."""
    mamba2 = any(a.startswith(MAMBA2_ARCHITECTURES) for a in _architectures(model)) \
        or cfg.profile in ("mamba2", "mamba2-hybrid")
    return mamba2 and _on_cpu()


def request_pair(cfg: ReproConfig, model: str) -> tuple[list[int], list[int]]:
    """The report's producer and consumer prompts, tokenized as the report does."""
    from transformers import AutoTokenizer

    from prefixvault.scenarios.models import consumer_prompt, producer_prompt

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
    notes: list[str] = []
    store = cfg.store or f"local://{work}/store?capacity=4GiB"
    namespace = f"repro-{time.strftime('%Y%m%d%H%M%S')}-{time.monotonic_ns() % 10**6}"
    extra: dict[str, Any] = {"namespace": namespace, "capture": cfg.capture,
                             "capture_outputs": cfg.capture_outputs}
    env = (
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if cfg.tensor_parallel_size == 1
        else {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(cfg.tensor_parallel_size))}
    )

    def engine_run(role: str, prompt: list[int], more: Sequence[list[int]] = (), *,
                   sequence: Sequence[list[int]] = (), max_tokens: int = 0, what: str = "",
                   dense: bool = False, control: bool = False, turns: bool = False, budget: int = 0,
                   config: dict[str, Any] | None = None, label: str = "",
                   ) -> tuple[Completion, dict[str, Any]]:
        """One engine in its own process: ``more`` continues a conversation, ``sequence`` adds
        requests served one after the other; ``dense`` keeps a state at every step end (the
        engine's own prefix cache as a reference), ``control`` restores wrong states. ``turns``
        serves the prompts as a conversation's turns (one alone too), ``budget`` sets
        ``max_num_batched_tokens``, ``config`` overrides the connector's settings (the namespace),
        ``label`` names the run in progress."""
        args = dict(engine, **({"prefix_cache_retention_interval": None} if dense else {}))
        if budget:
            args["max_num_batched_tokens"] = budget
            if "max_num_seqs" in args:  # vLLM wants max_num_batched_tokens >= max_num_seqs
                args["max_num_seqs"] = min(int(args["max_num_seqs"]), budget)
        conversation = turns or bool(more)
        spec = EngineSpec(
            model=model,
            engine=args,
            prompts=[prompt, *more, *sequence],
            role=role,
            store=store,
            extra_config=dict(extra, **(config or {})),
            max_tokens=max_tokens or cfg.max_tokens,
            logprobs=cfg.logprobs,
            conversation=conversation,
            # A turn's answer is --max-tokens long, whatever the model says: whether a boundary
            # falls inside it must not hang on where a (random test) model happens to stop.
            ignore_eos=conversation,
        )
        if control:
            spec.connector, spec.connector_module = CONTROL_CONNECTOR
        label = label or ("negative control" if control else "own prefix cache" if dense else role)
        what = what or (f"{1 + len(more)} turns" if more else
                        f"{len(prompt)} prompt tokens" + (f", then {len(sequence[0])}" if sequence else ""))
        say(f"{label} engine: starting (tens of seconds) and running {what}")
        t = time.perf_counter()
        result = run_engine(spec, work / "engines", env=env)
        say(f"{label} engine: done in {time.perf_counter() - t:.0f}s")
        if control:
            result["control_zeroed"] = Path(result["log"]).read_text(errors="replace").count(ZEROED_LINE)
        return completions(result)[0], result

    if cfg.turns > 1:
        return _conversation(cfg, model, engine, store, namespace, producer, consumer, engine_run, say)
    _step_size(cfg, model, engine, consumer, notes, engine_run)
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
    hit = restored.cached_tokens
    problems = []
    cold_equal = identical(cold, restored)
    if not batched or scenario.restores_exactly(hit, len(consumer), batched, bs):
        reference, ref = f"a cold run whose steps end at the restored boundary ({hit} tokens)", cold
    else:
        # Cold's steps do not end at the restored boundary: the only run a restore can equal bit
        # for bit is the same engine serving the prompt from its own prefix cache there.
        say(f"the cold run's steps do not end at {hit}: the engine's own prefix cache is the reference")
        local = _local_reference(engine_run, producer, consumer)
        reference, ref = f"the engine's own prefix cache at {local.cached_tokens} tokens", local
        if local.cached_tokens != hit:
            problems.append(f"the engine's own prefix cache hit {local.cached_tokens} tokens, not the "
                            f"restored {hit}: no reference computed the same chunks")
        if not cold_equal:
            notes.append(f"differs from cold (max |Δlogprob| {max_logprob_diff(cold, restored):.3g}) as "
                         "chunking does: cold computed the restored range in steps that do not end at "
                         f"{hit}; run with --max-num-batched-tokens {bs} for a cold reference")
    tokens_equal = ref.token_ids == restored.token_ids
    exact = identical(ref, restored)
    if not tokens_equal:
        problems.append(f"generated token ids differ from {reference}")
    elif not exact:
        problems.append(f"logprobs differ from {reference}")
    if longest >= 0 and hit > longest:
        problems.append(f"restored {hit} tokens, beyond the longest resumable boundary {longest}")
    elif longest > 0 and hit < longest:
        problems.append(f"restored {hit} tokens, short of the longest resumable boundary {longest}")
    if produced["metrics"].get("put_failed", 0) or consumed["metrics"].get("get_failed", 0):
        problems.append("store operations failed")
    control = _control(cfg, engine_run, consumer, ref, hit, problems) if cfg.control else None
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
        external_hit_tokens=hit,
        producer=produced["metrics"],
        consumer=consumed["metrics"],
        cold_text=cold.text,
        consumer_text=restored.text,
        tokens_equal=tokens_equal,
        logprobs_equal=exact,
        max_abs_logprob_diff=max_logprob_diff(ref, restored),
        problems=problems,
        reference=reference,
        notes=notes,
        cold_equal=cold_equal,
        control=control,
    )


def _step_size(cfg: ReproConfig, model: str, engine: dict[str, Any], consumer: list[int],
               notes: list[str], engine_run: Any) -> None:
    """Settle ``max_num_batched_tokens``: one block per step unless the user gave one (then the
    engine's block size is read first from a short run of the engine), and one block per step
    anyway where vLLM CPU's Mamba2 kernels cannot run steps that span a block boundary."""
    asked = int(engine.get("max_num_batched_tokens") or 0)
    profile_bs = int(engine.get("block_size") or 0)
    if cfg.model and (not cfg.max_num_batched_tokens or not profile_bs):
        _, probe = engine_run("cold", consumer[:8], max_tokens=1, what="reading the engine's block size")
        profile_bs = int(probe["block_size"])
        if not cfg.max_num_batched_tokens:
            engine["max_num_batched_tokens"] = profile_bs
            notes.append(f"every engine ran with max_num_batched_tokens = the block size ({profile_bs}), so "
                         "the cold run's steps end at every boundary the consumer can restore")
            return
    if asked and profile_bs and asked != profile_bs and _one_block_per_step(cfg, model):
        engine["max_num_batched_tokens"] = profile_bs
        notes.append(f"ran at max_num_batched_tokens {profile_bs} (one block per step), not {asked}: vLLM "
                     "CPU's Mamba2 kernels fail on a step that spans a block boundary")


def _local_reference(engine_run: Any, producer: list[int], consumer: list[int]) -> Completion:
    """The consumer's prompt served by an engine without the connector from its own prefix
    cache: it computes the producer's prompt first, keeping a state at every step end."""
    _, result = engine_run("cold", producer, more=(), sequence=[consumer], dense=True)
    return completions(result)[1]


def _control(cfg: ReproConfig, engine_run: Any, consumer: list[int], ref: Completion, hit: int,
             problems: list[str]) -> ControlResult:
    """A consumer that restores zeros for every state must part from the reference."""
    if hit == 0:
        problems.append("the negative control needs a restored boundary; the consumer restored nothing")
        return ControlResult(0, False, False, 0.0)
    wrong, result = engine_run("kv_consumer", consumer, control=True)
    zeroed = bool(result.get("control_zeroed", 0))
    diverged = not identical(ref, wrong)
    part = divergence(ref, wrong)
    if not zeroed:
        problems.append("the negative control restored no state to make wrong (a model without "
                        "recurrent state cannot be judged this way)")
    elif not diverged:
        problems.append("the negative control did not diverge: a wrong restored state leaves this model's "
                        "output unchanged, so the comparison cannot judge it (more --max-tokens, a longer "
                        "prompt, or real weights)")
    return ControlResult(wrong.cached_tokens, zeroed, diverged, part.drift,
                         part.at if part.margin is not None else None)


def _published(store: str, namespace: str, prompt: list[int]) -> int:
    """The boundary a lookup of ``prompt`` finds in ``namespace``: the longest one published and
    complete, tail boundaries included (``explain`` walks block boundaries only). It only reads."""
    from prefixvault.inventory import load_layouts
    from prefixvault.keys import PromptTokens
    from prefixvault.stores import open_store
    from prefixvault.vault import Vault

    best = 0
    with open_store(store, existing=True, readonly=True) as s:
        for (ns, _), layout in sorted(load_layouts(s).items()):
            if ns == namespace and layout is not None:
                vault = Vault(s, layout, namespace)
                best = max(best, vault.lookup(vault.hashes(prompt), len(prompt), prompt=PromptTokens(prompt)))
    return best


def _sum(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in metrics:
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _conversation(cfg: ReproConfig, model: str, engine: dict[str, Any], store: str, namespace: str,
                  producer: list[int], consumer: list[int], engine_run: Any, say: Any) -> ReproResult:
    """``--turns N``: the producer prompt is turn 1; each later turn adds the consumer prompt's
    last 64 tokens as its message, after the previous answer (``keep``) or not (``drop``).

    Each turn n >= 2 runs three engines of its own, all at a budget of ``b = L mod B`` (or
    ``B``), L the previous prompt's length and B the block size: a producer of the previous
    prompt (a fresh namespace), whose answer is the previous answer this turn's prompt keeps; a
    consumer of this turn's prompt; and a reference, this turn's prompt on an empty namespace
    (every engine compared carries the connector). (The answer is the producer's, not a cold
    run's: another budget can part a greedy answer from it after a few tokens, and with
    ``capture_outputs`` the boundaries the producer publishes over its answer must be the
    prompt's.) The budget ends a prefill step at L in the producer and in the reference, so a
    consumer that restores L must equal the reference bit for bit. The consumer must restore
    the boundary a lookup finds in the store, and that is L. Where vLLM CPU can only run one
    block per step (Mamba2) and L is not a block multiple, no cold run's steps end at L: the
    turn is checked for depth only."""
    n_turns, bs = cfg.turns, int(engine.get("block_size") or 0)
    message = consumer[-64:]
    problems: list[str] = []
    notes: list[str] = []
    if not bs:
        _, probe = engine_run("cold", consumer[:8], max_tokens=1, what="reading the engine's block size")
        bs = int(probe["block_size"])
    one_block = _one_block_per_step(cfg, model)
    # Boundaries over a producer's answer: by default (``last``) the last one is stored in a step
    # after the request's last, which an engine in this process takes only with a later request,
    # and a turn's producer serves one; so each is published as its decode step ends.
    outputs = {"output_boundaries": "every"} if cfg.capture_outputs else {}
    prompts = [producer]
    turns: list[TurnResult] = []
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    last: tuple[Completion, Completion | None] | None = None
    same_ids: list[bool] = []  # per turn whose bit-identity is claimed
    for n in range(2, n_turns + 1):
        before = prompts[-1]
        prev = len(before)
        budget = bs if one_block else prev % bs or bs
        space = f"{namespace}-t{n}"
        head, at_budget = f"turn {n} of {n_turns}", f"at max_num_batched_tokens {budget}"
        first, produced = engine_run("kv_producer", before, turns=True, budget=budget,
                                     config={"namespace": space, **outputs}, label=f"{head}: producer",
                                     what=f"turn {n - 1}'s prompt ({prev} tokens) {at_budget}")
        prompt = [*before, *(first.token_ids if cfg.template == "keep" else []), *message]
        prompts.append(prompt)
        ends = scenario.schedule(len(prompt), budget, bs)
        if n == 2:
            turns.append(TurnResult(prev, first.cached_tokens, -1, None, 0.0,
                                    reference="nothing to restore: served cold (turn 2's producer)"))
        restored, consumed = engine_run("kv_consumer", prompt, turns=True, budget=budget,
                                        config={"namespace": space}, label=f"{head}: consumer",
                                        what=f"turn {n}'s prompt ({len(prompt)} tokens) {at_budget}")
        ref: Completion | None = None
        if prev in ends:
            ref, _ = engine_run("kv_consumer", prompt, turns=True, budget=budget,
                                config={"namespace": f"{space}-empty"},
                                label=f"{head}: reference", what=f"turn {n}'s prompt on an empty namespace "
                                f"{at_budget}, its steps ending at {prev}")
        runs.append((produced, consumed))
        for r in (produced, consumed):
            if int(r.get("block_size") or 0) != bs:
                problems.append(f"turn {n}: an engine ran with block size {r.get('block_size')}, not {bs}")
        hit, longest = restored.cached_tokens, _published(store, space, prompt)
        turn = TurnResult(len(prompt), hit, longest, None, 0.0, prev, budget)
        if hit != longest:
            problems.append(f"turn {n} restored {hit} tokens, not the {longest} a lookup finds in the store")
        if cfg.capture == "steps" and longest < prev:
            problems.append(f"turn {n}: the longest boundary published for its prompt is {longest}, "
                            f"short of the previous prompt's end ({prev})")
        if hit > prev and not cfg.capture_outputs:
            problems.append(f"turn {n} restored {hit} tokens, past the previous prompt's end ({prev})")
        at = f"{hit} tokens (max_num_batched_tokens {budget})"
        if ref is None:
            turn.reference = f"none: no cold run's steps end at {prev} tokens here; checked for depth only"
            notes.append(f"turn {n}: vLLM CPU's Mamba2 kernels need one block per step, so a cold run's "
                         f"steps end at block boundaries only, and the previous prompt's end ({prev}) is "
                         "not one: no run computes what the consumer did, and the turn is compared with none")
        elif hit <= prev and hit in ends:
            turn.reference, turn.exact = f"a cold run whose steps end at {at}", True
        elif hit > prev:
            turn.reference = (f"a cold run whose steps end at {prev} tokens (max_num_batched_tokens "
                              f"{budget}); the consumer restored {hit - prev} tokens of the previous answer, "
                              "whose states decode steps computed: equivalent, not bit-identical")
        else:
            turn.reference = f"a cold run whose steps do not end at {at}: equivalent, not bit-identical"
        if ref is not None:
            turn.identical = identical(ref, restored)
            turn.max_abs_logprob_diff = max_logprob_diff(ref, restored)
            if turn.exact:
                same_ids.append(ref.token_ids == restored.token_ids)
            if turn.exact and not turn.identical:
                what = "generated token ids" if not same_ids[-1] else "logprobs"
                problems.append(f"turn {n}: {what} differ from {turn.reference}")
        turns.append(turn)
        last = (restored, ref)
        say(f"turn {n} of {n_turns}: restored {hit} of the previous prompt's {prev} tokens"
            + (f"; {'identical to' if turn.identical else 'differs from'} its reference" if ref else ""))
    if any(r["metrics"].get("put_failed", 0) or c["metrics"].get("get_failed", 0) for r, c in runs):
        problems.append("store operations failed")
    assert last is not None
    restored, ref = last
    claimed = [t for t in turns if t.exact]
    final = turns[-1]
    return ReproResult(
        ok=not problems, model=model, store=store,
        prompt_tokens={"producer": len(producer), "consumer": len(prompts[-1])},
        common_prefix_tokens=len(prompts[-2]), block_size=bs,
        max_num_batched_tokens=final.max_num_batched_tokens, producer_step_ends=[],
        longest_resumable_boundary=final.longest, external_hit_tokens=final.hit,
        producer=_sum([r["metrics"] for r, _ in runs]), consumer=_sum([c["metrics"] for _, c in runs]),
        cold_text=ref.text if ref else "", consumer_text=restored.text,
        tokens_equal=all(same_ids), logprobs_equal=all(bool(t.identical) for t in claimed),
        max_abs_logprob_diff=max((t.max_abs_logprob_diff for t in claimed), default=0.0),
        problems=problems, turns=turns, reference=final.reference, notes=notes, template=cfg.template,
    )


def render(result: ReproResult, console: Any) -> None:
    """The report's figures, in the report's terms."""
    from rich.table import Table

    if result.turns:
        _render_conversation(result, console)
        return
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
        ("compared with", result.reference),
        ("generated tokens equal", str(result.tokens_equal)),
        ("per-token logprobs equal (top-k, bit for bit)", str(result.logprobs_equal)),
        ("max |Δlogprob|", f"{result.max_abs_logprob_diff:.6g}"),
    ]
    if result.reference != "cold" and not result.reference.startswith("a cold run"):
        rows.append(("also equal to cold", str(result.cold_equal)))
    if result.control is not None:
        ctl = result.control
        rows.append(("negative control (zeroed states restored)",
                     f"hit {ctl.hit}, {'diverged' if ctl.diverged else 'did NOT diverge'} "
                     f"(max |Δlogprob| {ctl.max_abs_logprob_diff:.3g}"
                     + (f", token ids part at {ctl.parted_at})" if ctl.parted_at is not None else ")")
                     if ctl.states_zeroed
                     else "no state to make wrong"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for note in result.notes:
        console.print(f"note: {note}")
    if result.ok:
        hit = result.external_hit_tokens
        console.print(f"[green]OK[/]: the consumer restored {hit} tokens (the longest resumable boundary) "
                      f"and equals {result.reference}, bit for bit"
                      + ("; the negative control diverged" if result.control else ""))
    elif not (result.tokens_equal and result.logprobs_equal):
        console.print("[red]DIVERGED[/]: " + "; ".join(result.problems))
    elif result.control is not None and not result.control.diverged:
        console.print("[yellow]INCONCLUSIVE[/]: " + "; ".join(result.problems))
    else:
        console.print("[red]FAILED[/]: " + "; ".join(result.problems))


TEMPLATES = {
    "keep": "turn n's prompt = turn n-1's prompt + its answer + a message",
    "drop": "turn n's prompt = turn n-1's prompt + a message (the answer dropped)",
}


def _render_conversation(result: ReproResult, console: Any) -> None:
    """``--turns``: every turn against the longest boundary published for its prompt and its
    own reference."""
    from rich.table import Table

    p, c = result.producer, result.consumer
    t = Table(title="prefixvault repro --turns: per turn, producer → store → consumer vs its reference")
    t.add_column("figure")
    t.add_column("value", overflow="fold")
    for k, v in (
        ("model", result.model),
        ("store", result.store),
        ("template", f"{result.template}: {TEMPLATES.get(result.template, '')}"),
        ("block size", str(result.block_size)),
        ("producers: Put keys / bytes / failed keys",
         f"{p.get('put_keys', 0):.0f} / {p.get('put_bytes', 0):.0f} / {p.get('put_failed', 0):.0f}"),
        ("producers: records published", f"{p.get('records_published', 0):.0f}"),
        ("consumers: Get keys / bytes / failed keys",
         f"{c.get('get_keys', 0):.0f} / {c.get('get_bytes', 0):.0f} / {c.get('get_failed', 0):.0f}"),
    ):
        t.add_row(k, v)
    console.print(t)
    tt = Table(title="turns: restored against the longest published boundary, and against the reference",
               caption="previous: the previous turn's prompt; budget: max_num_batched_tokens; published: "
                       "what a lookup of the prompt finds in the store; equal: token ids and top-k "
                       "logprobs equal to the reference's, bit for bit; max |Δ|: of the logprobs")
    for col in ("turn", "prompt", "previous", "budget", "restored", "published", "equal", "max |Δ|"):
        tt.add_column(col)
    for n, turn in enumerate(result.turns, 1):
        ran = turn.identical is not None
        tt.add_row(str(n), str(turn.prompt_tokens), str(turn.previous_prompt_tokens) if n > 1 else "-",
                   str(turn.max_num_batched_tokens) if n > 1 else "-", str(turn.hit),
                   str(turn.longest) if n > 1 else "-", str(turn.identical) if ran else "-",
                   f"{turn.max_abs_logprob_diff:.6g}" if ran else "-")
    console.print(tt)
    for n, turn in enumerate(result.turns, 1):
        if n > 1:
            console.print(f"turn {n} compared with: {turn.reference}", highlight=False)
    for note in result.notes:
        console.print(f"note: {note}")
    later = list(enumerate(result.turns, 1))[1:]
    depth = "; ".join(f"turn {n}: {t.hit} (previous prompt: {t.previous_prompt_tokens})" for n, t in later)

    def turns_of(ns: list[str]) -> str:
        return f"turn{'s' if len(ns) > 1 else ''} {', '.join(ns)}"

    exact = [str(n) for n, t in later if t.exact]
    other = [str(n) for n, t in later if not t.exact]
    if result.ok:
        said = [f"{turns_of(exact)} equal{'s its reference' if len(exact) == 1 else ' their references'}, "
                "bit for bit"] if exact else []
        said += [f"no bit-identity claimed for {turns_of(other)} (see above)"] if other else []
        console.print(f"[green]OK[/]: every turn restored the longest boundary published for its prompt "
                      f"({depth}); " + "; ".join(said), highlight=False)
    elif not (result.tokens_equal and result.logprobs_equal):
        console.print("[red]DIVERGED[/]: " + "; ".join(result.problems))
    else:
        console.print("[red]FAILED[/]: " + "; ".join(result.problems))


def to_json(result: ReproResult) -> str:
    return json.dumps(asdict(result))
