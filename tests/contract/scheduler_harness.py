"""vLLM's real scheduler driving the connector's scheduler side, with the test as the workers.

Why: the connector's scheduler side is only as right as what it does with what vLLM's
``Scheduler`` really hands it (chunks, block tables, checkpoint offers, preemptions, lookups
asked again). Hand-built scheduler outputs (tests/test_step_chunks.py) prove the boundary
rule; this harness proves the contract against each vLLM version's own scheduler and KV cache
manager, which are plain Python and run here without a GPU or a model.

The harness plays the model runner (sampled tokens, draft tokens) and the workers: it
stores and publishes what the connector planned through the connector's own ``Vault`` (as
``WorkerSide`` does), reports the saves settled and the loads finished, and records every
step. ``Published`` is the independent oracle of what the store holds; the checks below
compare each step's plans and each lookup answer against it and against vLLM's own rules.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import vllm
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from prefixvault.boundary import max_resume_tokens, resume_limit
from prefixvault.codec import ObjectKind
from prefixvault.vllm.mailbox import Mailboxes
from prefixvault.vllm.metadata import LoadMode, PrefixVaultMetadata, SavesSettled
from prefixvault.vllm.request import extra_keys

VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
MAX_MODEL_LEN = 1 << 15
#: The token the fake model samples (no request has a stop token: each ends at its length).
SAMPLED_TOKEN = 7
#: The lookup thread gets this long (seconds) before a lookup is a miss: far above any
#: scheduling delay on a loaded 2-core machine, so a miss is never a timeout here.
LOOKUP_TIMEOUT = 60.0
#: A scenario that is not done after this many steps is stuck (a request never scheduled).
MAX_STEPS = 10_000


@contextmanager
def _no_full_collections() -> Iterator[None]:
    """No garbage collection while an engine steps. vLLM's engine core freezes its heap once
    started (``freeze_gc_heap``), so its collections never walk every object of the process;
    this test process holds hundreds of schedulers unfrozen, and a full collection of them
    (hundreds of ms, on whichever thread allocates: often a lookup lane) would exceed the
    bounded wait of a restore in the step (``IN_STEP_WAIT_S``) for a reason no engine has."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -- cache geometries shaped like real hybrid models on CUDA --------------------------------------


@dataclass(frozen=True)
class Geometry:
    """One hybrid model's cache, as vLLM on CUDA gives it to the scheduler: a full-attention
    group and state groups of one kind, the block size vLLM derives for the model
    (`bench/geometry.py`; bench/model_configs), and whether its state layers reserve a
    prefill checkpoint block (vLLM's Mamba2 layers do: 1 block, alignment 1; 0.33+ Qwen GDN
    with FlashInfer too). Heads and state shapes are small: the scheduler never reads bytes."""

    name: str
    block_size: int
    mamba_type: str  # MambaAttentionBackendEnum member name
    checkpoint_blocks: int
    state_groups: int = 1
    # vLLM's hash unit (``--prefix-match-unit``) where finer than the block: its own cache then
    # hits at that unit, and its prompt checkpoint falls on it (0: the block)
    hash_unit: int = 0

    @property
    def id(self) -> str:
        unit = f"-u{self.hash_unit}" if self.hash_unit else ""
        return f"{self.name}-bs{self.block_size}-ckpt{self.checkpoint_blocks}{unit}"

    @property
    def hash_block(self) -> int:
        return self.hash_unit or self.block_size


GEOMETRIES = (
    Geometry("qwen3-next-gdn", 544, "GDN_ATTN", 0, state_groups=2),
    Geometry("qwen3-next-gdn-flashinfer", 544, "GDN_ATTN", 1),
    Geometry("granite-4.0-h-mamba2", 528, "MAMBA2", 1),
    Geometry("nemotron-h-mamba2", 1040, "MAMBA2", 1),
    Geometry("falcon-h1-mamba2", 1568, "MAMBA2", 1),
    Geometry("zamba2-mamba2", 48, "MAMBA2", 1),
    Geometry("lfm2-shortconv", 16, "SHORT_CONV", 0),
    # vLLM's fine-grained hybrid matching: its own cache hits on 16-token units
    Geometry("qwen3-next-gdn", 544, "GDN_ATTN", 0, state_groups=2, hash_unit=16),
    Geometry("granite-4.0-h-mamba2", 528, "MAMBA2", 1, hash_unit=16),
)

HEAD_SIZE = 8  # one KV head of 8 (fp16): a block is 2 * 8 * 2 = 32 bytes per token


def kv_cache_config(geo: Geometry, num_blocks: int, spec_tokens: int = 0) -> KVCacheConfig:
    """The KV cache config vLLM's engine core would hand the scheduler for ``geo``: state pages
    padded to the attention page (vLLM's hybrid page unification), align mode, and the prefix
    cache's retention interval resolved from vLLM's default (0: a state group keeps only each
    request's replay boundary and junction), where the version has one."""
    import dataclasses

    import torch

    attn = FullAttentionSpec(block_size=geo.block_size, num_kv_heads=1, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    page = attn.page_size_bytes
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attn)]
    for i in range(geo.state_groups):
        state = MambaSpec(
            block_size=geo.block_size, shapes=((3, 16), (2, 4, 4)), dtypes=(torch.float16, torch.float32),
            page_size_padded=page, mamba_type=MambaAttentionBackendEnum[geo.mamba_type],
            mamba_cache_mode="align", num_speculative_blocks=spec_tokens,
            num_prefill_checkpoint_blocks=geo.checkpoint_blocks,
            prefill_checkpoint_alignment=1 if geo.checkpoint_blocks else None)
        groups.append(KVCacheGroupSpec([f"model.layers.{i + 1}.mixer"], state))
    retention = {"prefix_cache_retention_interval": 0} \
        if "prefix_cache_retention_interval" in {f.name for f in dataclasses.fields(KVCacheConfig)} else {}
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, **retention)


# -- the engine: vLLM's scheduler built from config objects, as its engine core builds it -------


_MODEL_CONFIGS: dict[str, ModelConfig] = {}


def model_config(model_dir: Path) -> ModelConfig:
    """A model config read from a local config.json (no weights, no tokenizer): what the
    scheduler reads of it is the context length and that it is a text decoder."""
    key = str(model_dir)
    if key not in _MODEL_CONFIGS:
        if not (model_dir / "config.json").exists():
            model_dir.mkdir(parents=True, exist_ok=True)
            (model_dir / "config.json").write_text(json.dumps({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 1024, "rms_norm_eps": 1e-5,
                "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float16"}))
        _MODEL_CONFIGS[key] = ModelConfig(model=key, tokenizer=key, skip_tokenizer_init=True,
                                          dtype="float16", seed=0, max_model_len=MAX_MODEL_LEN)
    return _MODEL_CONFIGS[key]


@contextmanager
def _cpu_platform_checks_without_triton() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses x86 hosts without triton-cpu when a config is built
    (platforms/cpu.py ``check_and_update_config``): a check for the model runner's kernels,
    which no scheduler runs. Lifted while the config is built, then put back."""
    try:
        import vllm.triton_utils as triton_utils
    except ImportError:
        yield
        return
    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had


def connector_extra(store: str, **extra: Any) -> dict[str, Any]:
    """Every hit restored (``restore_when: always``): the harness runs no forward, so its steps
    cost nothing and no restore would pay; the contract is what a restore does once taken."""
    return {"store": store, "namespace": "contract", "lookup_timeout": LOOKUP_TIMEOUT,
            "restore_when": "always", **extra}


def build_scheduler(model_dir: Path, geo: Geometry, store: str, *, budget: int, num_blocks: int = 4000,
                    max_num_seqs: int = 16, spec_tokens: int = 0, extra: dict[str, Any] | None = None,
                    async_scheduling: bool = False) -> Scheduler:
    """vLLM's ``Scheduler`` with prefix caching in align mode and PrefixVaultConnector
    (kv_both) on ``store``; vLLM's scheduler constructs the connector itself.

    ``async_scheduling``: vLLM's ``AsyncScheduler``, with ``SchedulerConfig.async_scheduling``
    on as CUDA's default resolves it (vLLM's CPU platform turns it off, and the connector and
    0.34's scheduler read it). Else the plain ``Scheduler``, the flag off
    (``--no-async-scheduling``). A step driven by ``Engine.step`` lands its output before the
    next is scheduled: each step's placeholders are resolved by then; the engine core's batch
    queue, which schedules a step before the previous one's output lands, is ``Engine.launch``
    and ``Engine.land`` driven two deep."""
    mc = model_config(model_dir)
    sched = SchedulerConfig(max_num_seqs=min(max_num_seqs, budget), max_num_batched_tokens=budget,
                            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                            is_encoder_decoder=False)
    cache = CacheConfig(block_size=geo.block_size, enable_prefix_caching=True, mamba_cache_mode="align",
                        prefix_match_unit=geo.hash_unit or None)
    ktc = KVTransferConfig(kv_connector="PrefixVaultConnector", kv_connector_module_path="prefixvault.vllm",
                           kv_role="kv_both",
                           kv_connector_extra_config=connector_extra(store, **(extra or {})))
    spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens, prompt_lookup_max=4,
                              prompt_lookup_min=1) if spec_tokens else None)
    with _cpu_platform_checks_without_triton():
        config = VllmConfig(model_config=mc, scheduler_config=sched, cache_config=cache,
                            kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                            speculative_config=spec)
    config.cache_config.num_gpu_blocks = num_blocks
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    # as the engine core resolves them before it builds the scheduler
    kvc = kv_cache_config(geo, num_blocks, spec_tokens)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kvc, config)
    kvc.hash_block_size = hash_block_size
    kvc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kvc, config, block_size,
                                                                        hash_block_size)
    assert hash_block_size == geo.hash_block, (hash_block_size, geo)
    cls = Scheduler
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        config.scheduler_config.async_scheduling = True  # before the connector is built: it reads it
        cls = AsyncScheduler
    return cls(vllm_config=config, kv_cache_config=kvc,
               structured_output_manager=StructuredOutputManager(config), block_size=block_size,
               hash_block_size=hash_block_size, log_stats=False)


_hash_ready = False


def make_request(req_id: str, prompt: Sequence[int], geo: Geometry | int, max_tokens: int = 3,
                 cache_salt: str | None = None, **params: Any) -> Request:
    """A request as vLLM's engine core makes one: block hashes for vLLM's own prefix cache, one
    per hash unit of ``geo`` (or per ``geo`` tokens)."""
    unit = geo.hash_block if isinstance(geo, Geometry) else geo
    global _hash_ready
    from vllm.utils.hashing import sha256

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                   pooling_params=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(unit, sha256))


def skips_external_by_vllm(request: Request) -> bool:
    """Whether this version's scheduler discards a connector's answer for the request: 0.34
    ``Request.skip_reading_external_kv`` (prompt logprobs too), else the request's
    ``skip_reading_prefix_cache`` (v1/core/sched/scheduler.py, right after
    ``get_num_new_matched_tokens``)."""
    if hasattr(type(request), "skip_reading_external_kv"):
        return bool(request.skip_reading_external_kv)
    return bool(request.skip_reading_prefix_cache)


# -- the oracle: what the store holds -------------------------------------------------------------


#: Where a request's keys live: its cache salt, and its engine's epoch (``ExtraKeys.epoch``:
#: after a reset of the engine's cache).
Space = tuple[str | None, str | None]


@dataclass
class Published:
    """Every boundary published in one store, by (key space: cache salt and epoch, tokens
    before it), with the version (a counter) at which it appeared: lookups are judged against
    the store as it was when they were asked and as it is when they answer."""

    keys: dict[tuple[Space, tuple[int, ...]], int] = field(default_factory=dict)
    version: int = 0

    def add(self, salt: Space, tokens: Sequence[int]) -> None:
        key = (salt, tuple(tokens))
        if key not in self.keys:
            self.version += 1
            self.keys[key] = self.version

    def has(self, salt: Space, tokens: Sequence[int], version: int | None = None) -> bool:
        v = self.keys.get((salt, tuple(tokens)))
        return v is not None and (version is None or v <= version)

    def longest(self, salt: Space, tokens: Sequence[int], limit: int, block_size: int,
                version: int | None = None) -> int:
        """The longest published boundary of ``tokens`` at most ``limit`` (0 if none), at any
        token count: a tail boundary too."""
        best, prompt = 0, tuple(tokens)
        for (s, published), v in self.keys.items():
            n = len(published)
            fits = s == salt and best < n <= limit and (version is None or v <= version)
            if fits and prompt[:n] == published:
                best = n
        return best


# -- one step as the connector saw it -------------------------------------------------------------


@dataclass
class Chunk:
    start: int
    end: int
    prompt_len: int
    num_tokens: int  # the request's tokens (prompt + outputs) when the step was scheduled
    tables: tuple[list[int], ...]
    offers: list[tuple[int, int, int]]  # (group, block id, tokens) vLLM offered this step
    drafts: int


@dataclass
class Step:
    number: int
    chunks: dict[str, Chunk]
    meta: PrefixVaultMetadata
    preempted: set[str]


@dataclass
class Launched:
    """A step scheduled and run, its output not yet handed to the scheduler."""

    step: Step
    out: Any  # vLLM's SchedulerOutput
    output: ModelRunnerOutput


@dataclass
class Ask:
    req_id: str
    computed: int
    answer: tuple[int | None, bool]
    lookups: int  # lookups the connector started during this call
    version: int  # Published.version when asked


@dataclass
class Problems:
    """Contract violations found, with where (kept to report them all at once)."""

    found: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.found.append(what)


# -- the engine -----------------------------------------------------------------------------------


class Engine:
    """vLLM's scheduler with the test as model runner and workers."""

    def __init__(self, scheduler: Scheduler, geo: Geometry, published: Published, store: str = "",
                 exporting: bool = False, in_process_worker: bool = True) -> None:
        """``in_process_worker``: the engine's one worker runs in the scheduler's process, as
        on a one-rank engine (restores over a fast store are synchronous loads then)."""
        self.scheduler = scheduler
        self.store = store
        self.geo = geo
        self.bs = geo.block_size
        self.published = published
        self.exporting = exporting  # the platform exports in-chunk checkpoints (else: refused)
        self.connector: Any = scheduler.connector
        assert self.connector is not None and type(self.connector).__name__ == "PrefixVaultConnector"
        assert self.connector.scheduler is not None, "the connector is inert for this cache config"
        self.vault = self.connector.vault
        layout = self.vault.layout
        self.state_groups = [i for i, g in enumerate(layout.groups) if g.is_state]
        self.attn_groups = [i for i, g in enumerate(layout.groups) if not g.is_state]
        self.requests: dict[str, Request] = {}
        self.steps: list[Step] = []
        self.asks: list[Ask] = []
        self.first_ask: dict[str, int] = {}  # request -> Published.version at its first ask
        self.loads: Counter[str] = Counter()  # LoadSpecs issued per request
        self.local_loaded: dict[str, int] = {}  # the engine's own tokens at a request's last load
        self.problems = Problems()
        self.offers_inside = 0  # offers strictly inside their request's chunk
        self.checkpoints_valid = 0  # chunks in which vLLM's rule says a checkpoint was exported
        self.inside_published = 0  # in-chunk checkpoints the connector planned
        self.hits = 0  # lookup answers > 0
        self.loads_in_step = 0  # synchronous loads (written before the step's forward)
        self.worker_goes_off = False  # set: the next step's workers report their worker went off
        # request -> tokens: its next asynchronous load fails, and the workers say it may still
        # restore that many tokens (as ``Loads`` does, short of the objects that failed)
        self.fail_loads: dict[str, int] = {}
        self.state_copies = 0  # states of synchronous loads also written for another request
        engine_id = str(scheduler.vllm_config.kv_transfer_config.engine_id)
        self.handoff = Mailboxes.serve(engine_id, "uni") if in_process_worker else None
        self.failed: set[str] = set()  # the loads failing in the step being run (``fail_loads``)
        self.preemptions = 0
        self.drafted = 0
        self._step_chunks: dict[str, Chunk] = {}
        self._step_preempted: set[str] = set()
        self._wrap()

    def space(self, request: Any) -> Space:
        """The key space of ``request``: its salt, and the epoch it is keyed in."""
        side = self.connector.scheduler
        tracked = side.tracked(request.request_id)
        return (request.cache_salt, tracked.extra.epoch if tracked is not None else side.epoch)

    # -- recording what the connector is asked and answers --

    def _wrap(self) -> None:
        conn = self.connector
        matched, build = conn.get_num_new_matched_tokens, conn.build_connector_meta

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            if request.request_id not in self.first_ask:
                self.first_ask[request.request_id] = self.published.version
            before = conn.scheduler.counters.lookups
            answer = matched(request, num_computed_tokens)
            self.asks.append(Ask(request.request_id, num_computed_tokens, answer,
                                 conn.scheduler.counters.lookups - before, self.published.version))
            self._check_ask(request, self.asks[-1])
            return answer

        def build_connector_meta(out: Any) -> Any:
            state = out.kv_connector_block_state
            starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            drafts = out.scheduled_spec_decode_tokens or {}
            offers = dict(state.boundary_state_offloads) if state is not None else {}
            chunks = {}
            for rid, n in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[rid]
                tables = state.get_block_ids(rid) if state is not None else None
                chunks[rid] = Chunk(starts[rid], starts[rid] + n, req.num_prompt_tokens, req.num_tokens,
                                    tuple(list(t) for t in tables or ()), list(offers.get(rid, [])),
                                    len(drafts.get(rid, ())))
            self._step_chunks = chunks
            self._step_preempted = set(out.preempted_req_ids or ())
            return build(out)

        conn.get_num_new_matched_tokens = get_num_new_matched_tokens
        conn.build_connector_meta = build_connector_meta

    # -- the contract, per lookup answer and per step --

    def _check_ask(self, request: Request, ask: Ask) -> None:
        """(b) and (d): a hit is the longest published boundary that leaves a token to compute,
        judged against the store between the request's first ask and now; a request vLLM will
        not read an external cache for is answered (0, False) without a lookup."""
        p, rid = self.problems, ask.req_id
        n = ask.answer[0]
        if skips_external_by_vllm(request):
            p.check(ask.answer == (0, False), f"{rid}: skips external reads, answered {ask.answer}")
            p.check(ask.lookups == 0, f"{rid}: skips external reads, yet {ask.lookups} store lookup(s)")
            return
        if n is None:
            return  # undetermined: vLLM asks again next step
        if self.connector.scheduler.off is not None:
            p.check(ask.answer == (0, False), f"{rid}: its engine's worker is off, answered {ask.answer}")
            return
        tracked = self.connector.scheduler.tracked(rid)
        if tracked is not None and tracked.stale:
            p.check(ask.answer == (0, False), f"{rid}: tracked before a reset, answered {ask.answer}")
            return
        if tracked is not None and tracked.restore.not_worth_it:  # (restore_when: faster)
            p.check(ask.answer == (0, False), f"{rid}: judged not worth restoring, answered {ask.answer}")
            return
        tokens = list(request.all_token_ids)
        salt = self.space(request)
        if tracked is not None and tracked.restore.to_junction and n > 0:  # (restore_when: faster)
            total, hi = ask.computed + n, self.published.longest(salt, tokens, len(tokens) - 1, self.bs)
            where = f"{rid}: computed {ask.computed}, answered {ask.answer}, to its junction, longest {hi}"
            p.check(total % self.bs == 0 and self.published.has(salt, tokens[:total]), where)
            p.check(ask.computed < total < hi, where)
            self.hits += 1
            return
        # with state, a tail boundary up to one token short of the prompt; else a block boundary
        limit = (resume_limit(request.num_tokens) if self.state_groups
                 else max_resume_tokens(request.num_tokens, self.bs))
        if tracked is not None and tracked.restore.cap is not None:  # after a failed load: no deeper
            limit = min(limit, tracked.restore.cap)
        total = ask.computed + n if n > 0 else 0
        lo = self.published.longest(salt, tokens, limit, self.bs, self.first_ask[rid])
        hi = self.published.longest(salt, tokens, limit, self.bs)
        where = f"{rid}: computed {ask.computed}, answered {ask.answer}, published then {lo} now {hi}"
        p.check(n >= 0, where)
        if n > 0:
            self.hits += 1
            p.check(total % self.bs == 0 or bool(self.state_groups), f"{where}: hit not block aligned")
            p.check(total <= limit, f"{where}: hit leaves no prompt token to compute")
            p.check(self.published.has(salt, tokens[:total]), f"{where}: hit at an unpublished boundary")
            p.check(total <= hi, f"{where}: hit past the longest published boundary")
        if lo > ask.computed and self.loads[rid] < 2:  # (after 2 loads it is computed: by design)
            p.check(total >= lo, f"{where}: missed a boundary published before it was asked")
        if lo == hi:
            p.check(total == (lo if lo > ask.computed else 0), f"{where}: not the longest published")

    def vllm_checkpoint(self, chunk: Chunk) -> int | None:
        """The prefill checkpoint vLLM's rule says this chunk's state layers exported strictly
        inside it (``is_mamba_prefill_checkpoint_valid``, as ``_mamba_block_aligned_split``
        applies it), or None."""
        s = self.scheduler
        if not getattr(s, "mamba_has_prefill_checkpoint_blocks", False):
            return None
        prefill_end = max(chunk.prompt_len, chunk.num_tokens - 1)
        if chunk.end < prefill_end:
            return None
        hash_bs = getattr(s, "hash_block_size", self.bs)
        granularity = hash_bs if getattr(s, "mamba_partial_cache_hit", False) else self.bs
        drop = bool(getattr(s, "use_eagle_block_drop", False))
        pos = get_mamba_prefill_checkpoint_position(prefill_end, granularity, drop)
        alignment = getattr(s, "mamba_prefill_checkpoint_alignment", None)
        if is_mamba_prefill_checkpoint_valid(query_start=chunk.start, query_end=chunk.end,
                                             checkpoint_position=pos, hash_block_size=hash_bs,
                                             mamba_block_size=self.bs, checkpoint_alignment=alignment):
            return int(pos)
        return None

    def _check_step(self, step: Step) -> None:
        """(a): every planned boundary is the end of its request's chunk this step, or the
        checkpoint vLLM's rule says the chunk exported (only where the platform exports them);
        its blocks are the ones vLLM's tables and offers name; nothing past the prompt."""
        p, bs = self.problems, self.bs
        meta = step.meta
        p.check(not meta.releases, f"step {step.number}: releases without capture_outputs")
        for c in step.chunks.values():
            self.offers_inside += sum(c.start < t < c.end for _, _, t in c.offers)
            self.checkpoints_valid += self.vllm_checkpoint(c) is not None
        for spec in meta.saves:
            where = f"step {step.number} {spec.req_id}"
            p.check(not spec.hold, f"{where}: a held save without capture_outputs")
            chunk = step.chunks.get(spec.req_id)
            if chunk is None:
                p.check(False, f"{where}: a save for a request not scheduled this step")
                continue
            where += f" chunk [{chunk.start}, {chunk.end}) of {chunk.prompt_len}"
            # A step with draft tokens leaves states past what the request keeps if a draft is
            # rejected: nothing of it is published.
            p.check(not chunk.drafts, f"{where}: a save in a step with {chunk.drafts} draft tokens")
            checkpoint = self.vllm_checkpoint(chunk)
            parent = spec.parent
            for plan in spec.plans:
                b = plan.tokens
                w = f"{where}: boundary {b}"
                tail = b % bs != 0
                p.check(chunk.start < b <= chunk.end and (not tail or bool(self.state_groups)),
                        f"{w} not in the chunk")
                p.check(b <= chunk.prompt_len, f"{w} past the prompt (capture_outputs is off)")
                p.check(len(spec.hashes) >= -(-b // bs), f"{w}: {len(spec.hashes)} hashes")
                if tail:  # a save of its own, named by the prefix's own hashes (its tail hash last)
                    req = self.requests[spec.req_id]
                    extra = dataclasses.replace(extra_keys(req), epoch=self.space(req)[1])  # (its key space)
                    named = self.vault.prefix_hashes(list(req.all_token_ids)[:b], extra)
                    p.check(spec.tail == b and len(spec.plans) == 1 and spec.hashes == named,
                            f"{w}: a tail boundary not in a save of its own, or named otherwise")
                    p.check(parent % bs == 0, f"{w}: parent {parent} is not block-aligned")
                inside = b != chunk.end
                if self.state_groups:
                    if inside:
                        self.inside_published += 1
                        p.check(self.exporting, f"{w} inside the chunk on a platform that exports none")
                        p.check(b == checkpoint, f"{w} inside the chunk, not vLLM's checkpoint {checkpoint}")
                    groups = sorted(g for g, _ in plan.states)
                    p.check(groups == self.state_groups, f"{w}: states of groups {groups}")
                    for g, block in plan.states:
                        offered = (g, block, b) in chunk.offers
                        table = chunk.tables[g] if g < len(chunk.tables) else []
                        at_end = (b - 1) // bs < len(table) and table[(b - 1) // bs] == block
                        p.check(block != 0, f"{w}: group {g} state is the null block")
                        p.check(offered or (not inside and at_end),
                                f"{w}: group {g} state block {block} neither offered nor the chunk end's")
                for g in self.attn_groups:
                    idx = sorted(i for gg, i, _ in plan.blocks if gg == g)
                    p.check(idx == list(range(parent // bs, -(-b // bs))),
                            f"{w}: group {g} blocks {idx[:3]}..{idx[-3:]} from parent {parent}")
                for g, i, block in plan.blocks:
                    table = chunk.tables[g] if g < len(chunk.tables) else []
                    p.check(i < len(table) and table[i] == block and block != 0,
                            f"{w}: group {g} block {i} is {block}, vLLM's table says "
                            f"{table[i] if i < len(table) else None}")

    # -- the workers --

    def _work(self, meta: PrefixVaultMetadata) -> tuple[set[str], SavesSettled | None]:
        """Store and publish the step's saves as ``WorkerSide`` does (one batch), and finish
        its loads (their records must exist: a load of an unpublished boundary is a bug)."""
        vault = self.vault
        for load in meta.loads:
            self.loads[load.req_id] += 1
            self.local_loaded[load.req_id] = load.local_tokens
            req = self.requests.get(load.req_id)
            self.problems.check(req is not None and load.tokens > 0 and self.published.has(
                                    self.space(req), list(req.all_token_ids)[:load.tokens]),
                                f"load of {load.req_id} at {load.tokens}: not a published boundary")
            self._check_load_blocks(load)
            if load.in_step:
                self._check_in_step(load, meta.step)
        # a synchronous load is written before the forward: vLLM is told of asynchronous ones only
        recving = {load.req_id for load in meta.loads if not load.in_step}
        failing = {rid: self.fail_loads.pop(rid) for rid in recving if rid in self.fail_loads}
        self.failed = set(failing)
        saves = [s for s in meta.saves if not s.hold]
        if self.worker_goes_off:  # the worker could not use its caches: it says so once
            self.worker_goes_off = False
            return recving, SavesSettled(off=1)
        if not saves:
            return recving, SavesSettled(caps=failing) if failing else None

        def read(ref: Any, block_id: int) -> bytes:
            return bytes(vault.layout.groups[ref.group].nbytes(ref.rank))

        salts = [s.salt for s in saves]  # (each request's tenant, as ``WorkerSide`` passes them)
        acks = vault.save_many(0, [(s.hashes, s.plans) for s in saves], read, salts=salts)
        outcomes = vault.publish_many([(s.hashes, a, s.parent) for s, a in zip(saves, acks, strict=True)],
                                      seeds=[s.seed or None for s in saves], salts=salts)
        settled = SavesSettled(caps=failing)
        for spec, results in zip(saves, outcomes, strict=True):
            req = self.requests[spec.req_id]
            tokens = list(req.all_token_ids)
            sid = spec.sid(meta.step)
            settled.ranks[sid] += 1
            for b, why in results.items():
                self.problems.check(why is None,
                                    f"{spec.req_id}: boundary {b} planned but not published: {why}")
                if why is None:
                    self.published.add(self.space(req), tokens[:b])
            if any(why is not None for why in results.values()):
                settled.failed[sid] += 1
        return recving, settled

    def _check_in_step(self, load: Any, step: int) -> None:
        """A synchronous load: the engine's worker runs in this process; the scheduler handed it
        every object the load writes, read and verified; its request is scheduled this step,
        starting at the boundary; and its state is also written into the running state block
        of exactly the requests this step whose align-mode pre-copy reads the block it fills
        (vLLM's tables: from the block at a request's start to the block at its chunk's end)."""
        p, bs = self.problems, self.bs
        where = f"step {step}: synchronous load of {load.req_id} at {load.tokens}"
        self.loads_in_step += 1
        p.check(self.handoff is not None, f"{where} with no worker in the scheduler's process")
        p.check(load.mode is LoadMode.HANDED_OVER, f"{where} failed ({load.mode})")
        handed = self.handoff is not None and load.mode is LoadMode.HANDED_OVER
        objects = self.handoff.take(load.req_id, load.token, step) if handed and self.handoff else None
        p.check(objects is not None, f"{where}: its objects were not handed over")
        if objects is not None and load.hashes:
            refs = self.vault.needed(load.hashes, load.tokens, ranks=[0], since=load.local_tokens,
                                     salt=load.salt)
            p.check(all(r.key in objects and len(self.vault.open_sealed(r, objects[r.key]))
                        == self.vault.layout.groups[r.group].nbytes(0) for r in refs),
                    f"{where}: objects missing or of the wrong size")
            # and nothing more: a lookup reads ahead from where the load starts (vLLM's offer
            # on KV loads wrote), not from a hit every group holds, KV this engine has
            extra = set(objects) - {r.key for r in refs}
            p.check(not extra, f"{where}: {len(extra)} objects read ahead that the load does not write")
        chunks = self.steps[-1].chunks  # (this step's: ``step`` appended it before its work)
        own = chunks.get(load.req_id)
        p.check(own is not None and own.start == load.tokens,
                f"{where}: its request is not scheduled from the boundary ({own and own.start})")
        want = set()
        for rid, c in chunks.items():
            if not c.start:
                continue
            src, dst = (c.start - 1) // bs, (c.end - 1) // bs
            for g in self.state_groups:
                fills = load.block_ids[g][(load.tokens - 1) // bs]
                own = rid == load.req_id  # (its running block, the boundary's own where src == dst)
                if (src != dst or own) and src < len(c.tables[g]) and c.tables[g][src] == fills:
                    want.add((g, c.tables[g][dst]))
        p.check(set(load.state_copies) == want and len(want) == len(load.state_copies),
                f"{where}: state copies {sorted(load.state_copies)}, vLLM's pre-copies {sorted(want)}")
        self.state_copies += max(0, len(load.state_copies) - len(self.state_groups))

    def _check_load_blocks(self, load: Any) -> None:
        """Every object a load writes has a real block in the request's tables, as
        ``WorkerSide`` picks it: a KV block by its index, a state at the boundary's block."""
        if not load.hashes:
            return  # a load failed on purpose (an error of ours): reported failed, writes nothing
        for ref in self.vault.needed(load.hashes, load.tokens, ranks=[0], since=load.local_tokens):
            table = load.block_ids[ref.group] if ref.group < len(load.block_ids) else []
            idx = (load.tokens - 1) // self.bs if ref.kind is ObjectKind.STATE else ref.block_index
            block = table[idx] if idx < len(table) else 0
            self.problems.check(block != 0, f"load of {load.req_id} at {load.tokens} (local "
                                f"{load.local_tokens}): group {ref.group} block {idx} is not allocated")

    # -- the model runner --

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> Step:
        """One engine step: schedule, the workers' part, the model's part, update."""
        launched = self.launch()
        self.land(launched)
        return launched.step

    def launch(self) -> Launched:
        """Schedule a step and run it (the workers' part, the model's part): its output, not
        yet handed to the scheduler (``land``)."""
        sched = self.scheduler
        out = sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, PrefixVaultMetadata), type(meta)
        step = Step(len(self.steps) + 1, self._step_chunks, meta, self._step_preempted)
        self._step_chunks, self._step_preempted = {}, set()
        self.steps.append(step)
        self.preemptions += len(step.preempted)
        self._check_step(step)
        recving, settled = self._work(meta)
        req_ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            req_ids.append(rid)
            drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            self.drafted += len(drafts)
            # vLLM has advanced num_computed_tokens by the scheduled tokens (drafts included):
            # a request whose prompt (and outputs) are all computed samples; a prefill chunk not.
            if req.num_computed_tokens >= req.num_tokens:
                accepted = drafts[: len(drafts) // 2]  # the first half of the drafts verify
                sampled.append([*accepted, SAMPLED_TOKEN])
            else:
                sampled.append([])
        kv_out = self._connector_output(recving, settled)
        return Launched(step, out, model_runner_output(req_ids, sampled, kv_out))

    def _connector_output(self, recving: set[str], settled: SavesSettled | None) -> KVConnectorOutput | None:
        """What the workers report of a step: loads finished, saves settled."""
        if recving or settled is not None:  # (loads that failed are finished too, as vLLM has it)
            return KVConnectorOutput(finished_recving=recving or None, failed_recving=set(self.failed),
                                     kv_connector_worker_meta=settled)
        return None

    def land(self, launched: Launched) -> None:
        """Hand a launched step's output to the scheduler (and the drafter's proposals)."""
        sched = self.scheduler
        sched.update_from_output(launched.out, launched.output)
        if sched.num_spec_tokens:
            self._propose_drafts()
        p = self.problems
        p.check(self.connector.guard.total == 0, f"step {launched.step.number}: connector errors "
                f"{dict(self.connector.guard.errors)}")

    def _propose_drafts(self) -> None:
        """The drafter: ``num_spec_tokens`` draft tokens for every running request (vLLM
        drops them for prefill chunks itself)."""
        sched = self.scheduler
        ids = [r.request_id for r in sched.running]
        if ids:
            k = sched.num_spec_tokens
            sched.update_draft_token_ids(DraftTokenIds(ids, [[11 + i for i in range(k)] for _ in ids]))

    def run(self, arrivals: dict[int, list[Request]] | None = None) -> None:
        """Step until every request has finished; ``arrivals``: requests added before step n."""
        arrivals = dict(arrivals or {})
        with _no_full_collections():
            for n in itertools.count():
                for req in arrivals.pop(n, []):
                    self.add(req)
                if not arrivals and not self.scheduler.has_unfinished_requests():
                    break
                assert n < MAX_STEPS, f"stuck after {n} steps: {self.scheduler.get_request_counts()}"
                step = self.step()
                if not step.chunks:
                    time.sleep(0.001)  # waiting on lookups only: give the lookup thread the core
        held = self.connector.scheduler.read_ahead_held
        self.problems.check(held == 0, f"{held} bytes read ahead still held with every request finished")
        assert not self.problems.found, "\n".join(self.problems.found[:20]) + (
            f"\n... {len(self.problems.found)} problems" if len(self.problems.found) > 20 else "")

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.withdraw()
        self.scheduler.shutdown()


class Engines:
    """Makes engines on stores shared by name (``memory://`` lives in this process), each
    with its ``Published`` oracle; closes every engine it made."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.made: list[Engine] = []
        self.oracles: dict[str, Published] = {}

    def __call__(self, geo: Geometry, store: str | None = None, *, exporting: bool = False,
                 in_process_worker: bool = True, **kw: Any) -> Engine:
        store = store or store_name()
        engine = Engine(build_scheduler(self.model_dir, geo, store, **kw), geo,
                        self.oracles.setdefault(store, Published()), store, exporting=exporting,
                        in_process_worker=in_process_worker)
        self.made.append(engine)
        return engine


def model_runner_output(req_ids: list[str], sampled: list[list[int]],
                        kv_out: KVConnectorOutput | None) -> ModelRunnerOutput:
    """A ModelRunnerOutput for this version (0.34 dropped ``req_id_to_index``)."""
    names = {f.name for f in fields(ModelRunnerOutput)}
    kw: dict[str, Any] = dict(req_ids=req_ids, sampled_token_ids=sampled, logprobs=None,
                              prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out)
    if "req_id_to_index" in names:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kw)


def store_name() -> str:
    return f"memory://contract-{uuid.uuid4().hex[:12]}"


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    """Distinct token sequences (ids 100..999), one per length, from ``seed``."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(n)] for n in lengths]

