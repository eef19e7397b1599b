"""Per-layer cache tensors laid out as vLLM lays them out, for tests and benchmarks (torch only).

vLLM 0.32 describes an attention group's physical layout with ``KVCacheLayout``: a permutation
of the logical axes [L, B, H, N, C] (layer, block, head, token in block, content) into memory
order. Each layer's tensor has the logical shape [B, H, N, C] and the strides of that
permutation; where L is not outermost (BLHNC, BLNHC, BHLNC) the layers are views into one
shared buffer. State groups (Mamba, GDN, ShortConv) are [B, ...] per layer, one block per state.

``vllm_cache`` instead runs vLLM's own allocator (vLLM imported on use only), for the exact
views an engine hands a connector: padded state pages, groups aliasing one allocation, kernel
blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

#: Memory order of the logical axes (L=0, B=1, H=2, N=3, C=4), as in vllm/v1/kv_cache_layout.py.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def attention_layers(layout: str, layers: int, blocks: int, heads: int, block_size: int, content: int,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """``layers`` tensors of logical shape [blocks, heads, block_size, content] in ``layout``,
    filled with random values."""
    order = LAYOUTS[layout]
    logical = (layers, blocks, heads, block_size, content)
    physical = torch.empty([logical[i] for i in order], dtype=dtype, device=device)
    fill_random(physical, generator)
    # back to logical axis order: position of logical axis k in memory order
    inverse = [order.index(k) for k in range(5)]
    full = physical.permute(*inverse)
    return [full[i] for i in range(layers)]


def state_layers(layers: int, blocks: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", generator: torch.Generator | None = None
                 ) -> list[torch.Tensor]:
    """``layers`` state tensors [blocks, *shape], one contiguous state per block."""
    out = []
    for _ in range(layers):
        t = torch.empty((blocks, *shape), dtype=dtype, device=device)
        fill_random(t, generator)
        out.append(t)
    return out


def fill_random(t: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Random bytes (any dtype; NaN patterns included: compare bytes, not values)."""
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=generator).to(t.device))


# -- the views vLLM's own allocator builds (vLLM imported on use only) ----------------------------


@dataclass(frozen=True)
class HybridGeometry:
    """A hybrid model's cache, as vLLM groups it: one full-attention group of
    ``attention_layers`` layers and ``state_groups`` recurrent-state groups of as many layers
    each (vLLM makes groups of equal size; their memory aliases), GDN-like states of a conv
    window and an SSM state."""

    name: str
    attention_layers: int
    state_groups: int
    heads: int
    head_size: int
    block_size: int  # tokens per manager block (raised by vLLM so a page holds a state)
    conv: tuple[int, ...]
    ssm: tuple[int, ...]
    dtype: torch.dtype
    ssm_dtype: torch.dtype
    num_blocks: int


#: Small enough for real bytes on a CPU; every feature of the real thing (padded state pages).
SMALL = HybridGeometry("small", 2, 2, 2, 32, 64, (3, 48), (4, 16, 16), torch.bfloat16, torch.float32, 64)
#: Qwen3-Next-80B-A3B at TP1: 12 attention layers (2 KV heads x 256), 36 GDN layers; the block
#: is raised to 544 tokens so an attention page (1,114,112 B) holds a GDN state (1,097,728 B).
QWEN3_NEXT_80B_TP1 = HybridGeometry("qwen3next80b_tp1", 12, 3, 2, 256, 544, (3, 8192), (32, 128, 128),
                                    torch.bfloat16, torch.bfloat16, 40)
GEOMETRIES = {g.name: g for g in (SMALL, QWEN3_NEXT_80B_TP1)}


@dataclass
class VllmCache:
    """What vLLM's allocator made for a geometry: the per-layer views a connector's
    ``register_kv_caches`` receives, the allocation under them, and vLLM's own specs."""

    geometry: HybridGeometry
    layout: str
    kernel_block_size: int  # tokens per kernel block of the attention group
    num_blocks: int  # manager blocks (``KVCacheConfig.num_blocks``)
    raw_bytes: int
    views: dict[str, torch.Tensor]
    layer_groups: list[list[str]]
    specs: list[Any]  # vLLM's spec of each group
    raw: torch.Tensor | None  # uint8 over the whole allocation (None on ``meta``)

    def spec_object_bytes(self) -> list[int]:
        """One object's bytes per group, from vLLM's spec properties: an attention page is
        ``num_heads * num_states * state_content_size_bytes``, a state the sum of its
        tensors' bytes (``MambaSpec.shapes`` x ``dtypes``); times the group's layers."""
        out = []
        for spec, names in zip(self.specs, self.layer_groups, strict=True):
            if hasattr(spec, "shapes"):
                one = sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                          for s, d in zip(spec.shapes, spec.dtypes, strict=True))
            else:
                one = spec.num_heads * spec.num_states * spec.state_content_size_bytes
            out.append(len(names) * one)
        return out


class _Config(SimpleNamespace):
    """The few engine settings vLLM's planner reads; any other reads as unset (None)."""

    def __getattr__(self, name: str) -> Any:
        return None


def vllm_cache(geometry: HybridGeometry, layout: str, kernel_block_size: int | None = None,
               device: str | torch.device = "cpu") -> VllmCache:
    """Run vLLM's own planner (``get_kv_cache_config_from_groups``) and allocator
    (``allocate_kv_cache``, what the GPU model runners call) for ``geometry`` in ``layout``,
    with the attention group cut into kernel blocks of ``kernel_block_size`` tokens (as a
    backend that cannot take the manager block does). Works with vLLM 0.32 to 0.34."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    try:  # 0.33 moved the planner
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    g = geometry
    attn = FullAttentionSpec(block_size=g.block_size, num_kv_heads=g.heads, head_size=g.head_size,
                             dtype=g.dtype)
    state = MambaSpec(shapes=(g.conv, g.ssm), dtypes=(g.dtype, g.ssm_dtype), block_size=g.block_size)
    if state.page_size_bytes > attn.page_size_bytes:
        raise ValueError(f"{g.name}: a state ({state.page_size_bytes} B) does not fit a page "
                         f"({attn.page_size_bytes} B): raise the block size")
    if state.page_size_bytes < attn.page_size_bytes:  # vLLM pads state pages to the attention page
        state = MambaSpec(shapes=(g.conv, g.ssm), dtypes=(g.dtype, g.ssm_dtype), block_size=g.block_size,
                          page_size_padded=attn.page_size_bytes)
    groups = [KVCacheGroupSpec([f"attn.{i}" for i in range(g.attention_layers)], attn)]
    groups += [KVCacheGroupSpec([f"state.{k}.{i}" for i in range(g.attention_layers)], state)
               for k in range(g.state_groups)]
    kv_layout = KVCacheLayout[layout]
    cache = _Config(get_resolved_kv_cache_layout=lambda: kv_layout, num_gpu_blocks_override=g.num_blocks,
                    prefix_cache_retention_interval=None)
    config = _Config(cache_config=cache, attention_config=_Config(hisparse_config=None))
    memory = g.attention_layers * attn.page_size_bytes * g.num_blocks  # the override decides anyway
    kvc = get_kv_cache_config_from_groups(config, groups, memory)
    kbs = kernel_block_size or g.block_size
    views = allocate_kv_cache(kvc, torch.device(device), kv_layout,
                              [kbs] + [g.block_size] * g.state_groups)
    storages = {t.untyped_storage().data_ptr() for t in views.values()}
    if len(storages) != 1:
        raise AssertionError(f"vLLM's views lie in {len(storages)} allocations, not one")
    size = int(kvc.kv_cache_tensors[0].size)
    raw = None
    if torch.device(device).type != "meta":
        first = next(iter(views.values()))
        raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())[:size]
    return VllmCache(g, layout, kbs, int(kvc.num_blocks), size, dict(views),
                     [list(grp.layer_names) for grp in groups], [grp.kv_cache_spec for grp in groups], raw)
