"""vLLM's KV cache configuration, described as a prefixvault ``CacheLayout``.

Scheduler and workers build the same layout from the same ``KVCacheConfig``, so they agree on
the fingerprint and object sizes without talking to each other. Workers check it against the
tensors they are given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefixvault.identity import model_content
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec

log = logging.getLogger("vllm.prefixvault")

#: Bump when the way bytes are gathered from vLLM's tensors changes.
ADAPTER_LAYOUT_VERSION = "1"


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _unwrap(spec: Any) -> list[Any]:
    """A group's per-layer specs (``UniformTypeKVCacheSpecs`` holds one per layer)."""
    specs = getattr(spec, "kv_cache_specs", None)
    return list(specs.values()) if isinstance(specs, dict) else [spec]


def _family(spec: Any) -> StateFamily:
    name = str(getattr(spec, "mamba_type", "")).lower()
    for key, fam in (("gdn", StateFamily.GDN), ("short_conv", StateFamily.SHORTCONV),
                     ("mamba2", StateFamily.MAMBA2), ("mamba1", StateFamily.MAMBA1)):
        if key in name:
            return fam
    return StateFamily.GENERIC


def group_tensors(
    spec: Any, n_layers: int
) -> tuple[GroupKind, list[TensorSpec], int | None, StateFamily | None]:
    """Kind, per-object tensors (every layer of the group, in order), window and state family."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, SlidingWindowSpec

    specs = _unwrap(spec)
    if len(specs) == 1 and n_layers > 1:
        specs = specs * n_layers
    first = specs[0]
    tensors: list[TensorSpec] = []
    if isinstance(first, MambaSpec):
        for s in specs:
            pairs = zip(s.shapes, s.dtypes, strict=True)
            tensors += [TensorSpec(tuple(shape), dtype_name(dt)) for shape, dt in pairs]
        return GroupKind.STATE, tensors, None, _family(first)
    if isinstance(first, AttentionSpec):
        for s in specs:
            # CPU layout (LBHNC): one block of one layer is [kv_heads, block_size, 2 * head_size].
            tensors.append(TensorSpec((s.num_kv_heads, s.block_size, 2 * s.head_size), dtype_name(s.dtype)))
        if isinstance(first, SlidingWindowSpec):
            return GroupKind.SLIDING_WINDOW, tensors, int(first.sliding_window), None
        window = getattr(first, "sliding_window", None)
        if window:
            return GroupKind.SLIDING_WINDOW, tensors, int(window), None
        return GroupKind.FULL_ATTENTION, tensors, None, None
    raise ValueError(f"prefixvault: unsupported KV cache spec {type(first).__name__}")


@dataclass(frozen=True)
class CacheShape:
    """What the checks need to know of an engine's cache before any layout is built."""

    has_state: bool
    block_size: int  # of the attention groups (state groups' own may differ when caching is off)


def cache_shape(kv_cache_config: Any) -> CacheShape:
    """Whether the engine's cache has state groups, and its attention block size, read before
    a layout can be built (an engine may have no usable layout: see ``preflight``)."""
    kinds = [(group_tensors(g.kv_cache_spec, len(g.layer_names))[0], g.kv_cache_spec.block_size)
             for g in kv_cache_config.kv_cache_groups]
    attention = [bs for kind, bs in kinds if kind is not GroupKind.STATE]
    return CacheShape(any(kind is GroupKind.STATE for kind, _ in kinds),
                      min(attention or [bs for _, bs in kinds]))


def build_layout(vllm_config: Any, kv_cache_config: Any, model_id: str = "") -> CacheLayout:
    """The layout of this engine's cache (every group; TP ranks hold uniform shards)."""
    import vllm
    from vllm.platforms import current_platform

    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise ValueError("prefixvault: pipeline parallelism is not supported yet (tensor parallel is)")
    tp = par.tensor_parallel_size
    groups = []
    block_sizes = set()
    for g in kv_cache_config.kv_cache_groups:
        kind, tensors, window, family = group_tensors(g.kv_cache_spec, len(g.layer_names))
        block_sizes.add(g.kv_cache_spec.block_size)
        groups.append(CacheGroup.uniform(kind, tensors, tp, window=window, family=family,
                                         name=",".join(g.layer_names)))
    if len(block_sizes) != 1:
        raise ValueError(f"prefixvault: cache groups with different block sizes {sorted(block_sizes)}")
    mc = vllm_config.model_config
    version = f"vllm-{vllm.__version__}/{current_platform.device_type}/{ADAPTER_LAYOUT_VERSION}"
    weights = model_content(str(mc.model), str(mc.revision) if mc.revision else None)
    if weights is None:
        log.warning("prefixvault: cannot read the files of %s to name its weights by content; a "
                    "checkpoint replaced under the same name would reuse old caches (set model_id "
                    "to a name that changes with the weights)", mc.model)
    return CacheLayout(
        model=model_id or str(mc.model),
        revision=str(mc.revision or ""),
        block_size=block_sizes.pop(),
        groups=tuple(groups),
        tp_size=tp,
        engine="vllm",
        engine_layout_version=version,
        extra=(("dtype", dtype_name(mc.dtype)), ("weights", weights or "unknown")),
    )
