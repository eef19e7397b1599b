"""Per-layer cache tensors laid out as vLLM lays them out, for tests and benchmarks (torch only).

vLLM 0.32 describes an attention group's physical layout with ``KVCacheLayout``: a permutation
of the logical axes [L, B, H, N, C] (layer, block, head, token in block, content) into memory
order. Each layer's tensor has the logical shape [B, H, N, C] and the strides of that
permutation; where L is not outermost (BLHNC, BLNHC, BHLNC) the layers are views into one
shared buffer. State groups (Mamba, GDN, ShortConv) are [B, ...] per layer, one block per state.
"""

from __future__ import annotations

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
