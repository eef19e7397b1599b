"""vLLM's KV cache configuration, described as a prefixvault ``CacheLayout``.

Scheduler and workers build the same layout from the same ``KVCacheConfig``, so they agree on
the fingerprint and object sizes without talking to each other. Workers check it against the
tensors they are given.

An object's bytes are what vLLM itself says a page holds: an attention block of one layer is
``num_heads x num_states x state_content_size_bytes`` (vLLM's page description, which covers
K+V per head, MLA's single latent, packed and quantized pages with inline scales, and
``head_size_v != head_size``); a state is its tensors' bytes, without the padding vLLM adds to
line pages up. Only the spec classes whose resume rule is known are accepted (``SUPPORTED``);
anything else is refused with one line (``Unsupported``), and the connector stays inert.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefixvault.identity import model_content
from prefixvault.layout import DTYPE_SIZES, CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec
from prefixvault.vllm.compat import unwrap

log = logging.getLogger("vllm.prefixvault")

#: Bump when the way bytes are gathered from vLLM's tensors changes.
#: 2: attention objects described by vLLM's page (heads x states x content; bytes where packed).
ADAPTER_LAYOUT_VERSION = "2"

#: Spec classes (by exact name) whose resume rule prefixvault knows, and the kind each gives.
#: A subclass is not accepted through its parent: ``RSWASpec``, ``SinkFullAttentionSpec`` and
#: ``HiddenStateCacheSpec`` derive from the full-attention specs but keep other tokens.
SUPPORTED: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "MLAAttentionSpec": GroupKind.FULL_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "MambaSpec": GroupKind.STATE,
}


class Unsupported(ValueError):
    """An engine cache prefixvault cannot save exactly; the message is one line saying why."""


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _family(spec: Any) -> StateFamily:
    name = str(getattr(spec, "mamba_type", "")).lower()
    for key, fam in (("gdn", StateFamily.GDN), ("short_conv", StateFamily.SHORTCONV),
                     ("mamba2", StateFamily.MAMBA2), ("mamba1", StateFamily.MAMBA1)):
        if key in name:
            return fam
    return StateFamily.GENERIC


def _kind(spec: Any) -> GroupKind:
    """The spec's kind, or ``Unsupported`` naming what is not handled."""
    name = type(spec).__name__
    kind = SUPPORTED.get(name)
    if kind is None:
        raise Unsupported(f"cache spec {name} is not supported (supported: {', '.join(SUPPORTED)})")
    if not getattr(spec, "prefix_cacheable", True):
        raise Unsupported(f"cache spec {name} does not take part in prefix caching")
    if kind is GroupKind.STATE:
        return kind
    if getattr(spec, "attention_chunk_size", None):
        raise Unsupported("chunked local attention is not supported")
    if getattr(spec, "non_causal", False):
        raise Unsupported("non-causal (prefix-LM) attention is not supported: a block's cache "
                          "depends on tokens after it")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise Unsupported(f"attention pages holding {spec.tokens_per_state} tokens per state are "
                          "not supported")
    if kind is GroupKind.FULL_ATTENTION and getattr(spec, "sliding_window", None):
        return GroupKind.SLIDING_WINDOW  # hybrid allocator off: the manager keeps every block
    return kind


def _object_tensors(spec: Any, kind: GroupKind) -> list[TensorSpec]:
    """One layer's part of an object, as vLLM describes its page."""
    if kind is GroupKind.STATE:
        tensors = [TensorSpec(tuple(shape), dtype_name(dt)) for shape, dt in zip(spec.shapes, spec.dtypes,
                                                                                  strict=True)]
        content = getattr(spec, "state_content_size_bytes", None)
        if content is not None and int(content) != sum(t.nbytes for t in tensors):
            # vLLM 0.34 rounds each state up to ``state_alignment`` (FlashInfer ReplaySSM).
            raise Unsupported(f"state pages with padding between states ({int(content)} bytes for "
                              f"{sum(t.nbytes for t in tensors)} bytes of state) are not supported")
        return tensors
    heads, states, content = int(spec.num_heads), int(spec.num_states), int(spec.state_content_size_bytes)
    dtype = dtype_name(spec.dtype)
    itemsize = DTYPE_SIZES.get(dtype)
    if getattr(spec, "state_content_bytes", None) is None and itemsize and content % itemsize == 0:
        # dense K/V content: the same bytes, described in their own dtype (tools compare values)
        return [TensorSpec((heads, states, content // itemsize), dtype)]
    return [TensorSpec((heads, states, content), "uint8")]  # packed: scales inline, nvfp4, ...


def _describe(spec: Any, kind: GroupKind) -> str:
    """What makes the bytes of a page mean what they mean, beyond their sizes (fingerprinted)."""
    name = type(spec).__name__
    if kind is GroupKind.STATE:
        return (f"{name}:{str(getattr(spec, 'mamba_type', '')).rsplit('.', 1)[-1]}"
                f":align{getattr(spec, 'state_alignment', 1)}")
    return (f"{name}:{dtype_name(spec.dtype)}:quant{int(getattr(spec, 'kv_quant_mode', 0))}"
            f":k{spec.head_size}:v{getattr(spec, 'head_size_v', spec.head_size)}"
            f":headmajor{int(bool(getattr(spec, 'kv_head_major_slots', False)))}")


@dataclass(frozen=True)
class GroupShape:
    """One cache group as prefixvault reads it."""

    kind: GroupKind
    tensors: tuple[TensorSpec, ...]  # every layer's part of an object, in layer order
    window: int | None
    family: StateFamily | None
    block_size: int
    description: str


def group_shape(spec: Any, n_layers: int) -> GroupShape:
    """A group's kind and object tensors; ``Unsupported`` if its specs cannot be saved exactly."""
    specs = unwrap(spec)
    if len(specs) == 1 and n_layers > 1:
        specs = specs * n_layers
    kinds = {_kind(s) for s in specs}
    if len(kinds) != 1:
        raise Unsupported(f"a cache group mixes {sorted(k.value for k in kinds)} layers")
    kind = kinds.pop()
    first = specs[0]
    tensors: list[TensorSpec] = []
    for s in specs:
        tensors += _object_tensors(s, kind)
    window = None
    if kind is GroupKind.SLIDING_WINDOW:
        window = int(first.sliding_window)
    descs = sorted({_describe(s, kind) for s in specs})
    return GroupShape(kind, tuple(tensors), window, _family(first) if kind is GroupKind.STATE else None,
                      int(spec.block_size), "+".join(descs))


@dataclass(frozen=True)
class CacheShape:
    """What the checks need to know of an engine's cache before any layout is built."""

    has_state: bool
    block_size: int  # of the attention groups (state groups' own may differ when caching is off)


def cache_shape(kv_cache_config: Any) -> CacheShape:
    """Whether the engine's cache has state groups, and its attention block size, read before
    a layout can be built (``Unsupported`` for a cache that cannot be saved exactly)."""
    shapes = [group_shape(g.kv_cache_spec, len(g.layer_names)) for g in kv_cache_config.kv_cache_groups]
    if not shapes:
        raise Unsupported("the engine has no KV cache groups")
    attention = [s.block_size for s in shapes if s.kind is not GroupKind.STATE]
    return CacheShape(any(s.kind is GroupKind.STATE for s in shapes),
                      min(attention or [s.block_size for s in shapes]))


def engine_refusal(vllm_config: Any) -> str | None:
    """Why this engine's parallelism cannot be served (one line), or None."""
    par = vllm_config.parallel_config
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        return "pipeline parallelism is not supported (tensor parallel is)"
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:
            return f"context parallelism ({name} > 1) is not supported: it shards a block's tokens"
    return None


def build_layout(vllm_config: Any, kv_cache_config: Any, model_id: str = "") -> CacheLayout:
    """The layout of this engine's cache (every group; TP ranks hold uniform shards)."""
    import vllm
    from vllm.platforms import current_platform

    why = engine_refusal(vllm_config)
    if why:
        raise Unsupported(why)
    tp = vllm_config.parallel_config.tensor_parallel_size
    groups = []
    block_sizes = set()
    descriptions = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        shape = group_shape(g.kv_cache_spec, len(g.layer_names))
        block_sizes.add(shape.block_size)
        groups.append(CacheGroup.uniform(shape.kind, shape.tensors, tp, window=shape.window,
                                         family=shape.family, name=",".join(g.layer_names)))
        descriptions.append((f"group{i}", shape.description))
    if len(block_sizes) != 1:
        raise Unsupported(f"cache groups with different block sizes {sorted(block_sizes)} are not supported")
    mc = vllm_config.model_config
    version = f"vllm-{vllm.__version__}/{current_platform.device_type}/{ADAPTER_LAYOUT_VERSION}"
    weights = model_content(str(mc.model), str(mc.revision) if mc.revision else None)
    if weights is None:
        log.warning("prefixvault: cannot read the files of %s to name its weights by content; a "
                    "checkpoint replaced under the same name would reuse old caches (set model_id "
                    "to a name that changes with the weights)", mc.model)
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    return CacheLayout(
        model=model_id or str(mc.model),
        revision=str(mc.revision or ""),
        block_size=block_sizes.pop(),
        groups=tuple(groups),
        tp_size=tp,
        engine="vllm",
        engine_layout_version=version,
        extra=(("dtype", dtype_name(mc.dtype)), ("weights", weights or "unknown"),
               ("kv_cache_dtype", kv_dtype), *descriptions),
    )
