"""What a model's cache costs and what restoring it saves, from its Hugging Face config.

The tiny test models hide the one fact cache policy is about: for real hybrid models one
recurrent state costs megabytes (tens of MiB for Qwen3-Next), a KV block kilobytes per token,
and restoring a prefix of n tokens saves the prefill FLOPs of those n tokens. This module
computes those three numbers from a config's own fields (layers of each kind, heads, head
dims, state shapes and dtypes), so the policy simulator (`bench/policy_sim.py`) weighs what
a real model costs; nothing here imports an engine.

Counting conventions (stated once, used everywhere):

- KV bytes per token: K and V of every attention layer (every application of a shared
  attention block counts), in the model's dtype.
- State bytes per boundary: every recurrent layer's conv window and SSM state, conv in the
  model's dtype, SSM in the dtype vLLM 0.32 picks on CUDA by default: float32 for Nemotron-H
  (unless its config names ``mamba_ssm_cache_dtype``), the model's dtype for the others.
- Prefill FLOPs of a prefix of n tokens: 2 x (active, non-embedding parameters) per token,
  plus 4 x heads x head_dim per earlier token per attention layer (QK^T and AV), summed
  over the prefix: ``2 P n + 2 A n^2`` with ``A`` the sum of heads x head_dim over attention
  layers. The LM head runs only for the last token of a prefill and is not counted.
- Block size: vLLM's rule for hybrids on CUDA (``_align_hybrid_block_size``): the smallest
  multiple of 16 tokens whose attention page (one layer) holds one layer's state page.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
#: vLLM's smallest CUDA attention kernel block; hybrid block sizes are multiples of it.
KERNEL_BLOCK = 16


@dataclass(frozen=True)
class ModelGeometry:
    """Per-token and per-boundary costs of one model's cache (one rank, no parallelism)."""

    name: str
    attention_layers: int  # attention applications per token (shared blocks count each time)
    state_layers: int
    kv_bytes_per_token: int
    state_bytes: int  # one boundary: every recurrent layer's conv window + SSM state
    state_page_bytes: int  # the largest single layer's state (vLLM's page unit)
    attn_page_bytes_per_token: int  # one attention layer's K and V for one token
    active_params: int  # non-embedding parameters applied per token (a shared block: each time it runs)
    total_params: int  # every parameter, embeddings included
    attn_width: int  # sum over attention layers of query heads x head dim

    @property
    def block_size(self) -> int:
        """vLLM's hybrid block size on CUDA (tokens): one attention page >= one state page."""
        if not self.state_layers or not self.attention_layers:
            return KERNEL_BLOCK
        per = KERNEL_BLOCK * self.attn_page_bytes_per_token
        return KERNEL_BLOCK * max(1, math.ceil(self.state_page_bytes / per))

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs to prefill a prefix of ``tokens`` tokens (what restoring it saves)."""
        n = float(tokens)
        return 2.0 * self.active_params * n + 2.0 * self.attn_width * n * n

    def block_bytes(self) -> int:
        """Bytes of one block of KV (every attention layer)."""
        return self.kv_bytes_per_token * self.block_size

    def state_tokens_equivalent(self) -> float:
        """How many tokens of KV weigh as much as one state."""
        return self.state_bytes / self.kv_bytes_per_token if self.kv_bytes_per_token else math.inf


def _dtype(cfg: Mapping[str, Any], name: str = "torch_dtype", default: str = "bfloat16") -> int:
    value = str(cfg.get(name) or cfg.get("dtype") or default)
    try:
        return _DTYPE_BYTES[value.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"{name} {value!r} is not one of {sorted(_DTYPE_BYTES)}") from None


#: vLLM's default SSM cache dtype per model type where it is not the model's dtype.
_SSM_DEFAULT = {"nemotron_h": "float32"}


def _ssm_dtype(cfg: Mapping[str, Any]) -> int:
    name = cfg.get("mamba_ssm_cache_dtype") or _SSM_DEFAULT.get(str(cfg.get("model_type")))
    return _DTYPE_BYTES[str(name)] if name else _dtype(cfg)


@dataclass
class _Tally:
    """Sums layer by layer; ``geometry`` turns them into a ModelGeometry."""

    hidden: int
    dtype: int
    attention_layers: int = 0
    state_layers: int = 0
    kv_bytes: int = 0
    attn_page: int = 0
    state_bytes: int = 0
    state_page: int = 0
    params: int = 0  # active, non-embedding
    inactive: int = 0  # parameters not used per token (unrouted experts)
    repeated: int = 0  # parameters counted per application of a shared block beyond its first
    attn_width: int = 0

    def attention(self, q_heads: int, kv_heads: int, head_dim: int, width: int | None = None,
                  gated: bool = False) -> None:
        """A softmax attention layer over an input of ``width`` (default: hidden)."""
        w = width or self.hidden
        self.attention_layers += 1
        page = 2 * kv_heads * head_dim * self.dtype
        self.kv_bytes += page
        self.attn_page = max(self.attn_page, page)
        q = q_heads * head_dim
        self.params += w * q * (2 if gated else 1) + 2 * w * kv_heads * head_dim + q * self.hidden
        self.attn_width += q

    def state(self, conv_bytes: int, ssm_bytes: int, params: int) -> None:
        self.state_layers += 1
        self.state_bytes += conv_bytes + ssm_bytes
        self.state_page = max(self.state_page, conv_bytes + ssm_bytes)
        self.params += params

    def mamba2(self, cfg: Mapping[str, Any], heads: int, head_dim: int, d_state: int, groups: int,
               conv: int) -> None:
        d_inner = heads * head_dim
        conv_dim = d_inner + 2 * groups * d_state
        self.state((conv - 1) * conv_dim * self.dtype, heads * head_dim * d_state * _ssm_dtype(cfg),
                   self.hidden * (2 * d_inner + 2 * groups * d_state + heads) + conv_dim * conv
                   + d_inner * self.hidden)

    def mlp(self, inter: int, gated: bool = True) -> None:
        self.params += (3 if gated else 2) * self.hidden * inter

    def moe(self, experts: int, top_k: int, inter: int, shared_inter: int = 0) -> None:
        per = 3 * self.hidden * inter
        self.params += top_k * per + 3 * self.hidden * shared_inter + self.hidden * experts
        self.inactive += (experts - top_k) * per

    def geometry(self, name: str, vocab: int, tied: bool) -> ModelGeometry:
        embed = vocab * self.hidden * (1 if tied else 2)
        return ModelGeometry(name, self.attention_layers, self.state_layers, self.kv_bytes,
                             self.state_bytes, self.state_page, self.attn_page, self.params,
                             self.params + self.inactive - self.repeated + embed, self.attn_width)


def _qwen3_next(cfg: Mapping[str, Any], t: _Tally) -> None:
    interval = int(cfg["full_attention_interval"])
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    conv = int(cfg["linear_conv_kernel_dim"])
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    for i in range(int(cfg["num_hidden_layers"])):
        if (i + 1) % interval == 0:
            t.attention(int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                        int(cfg["head_dim"]), gated=True)
        else:  # gated delta net: in_proj_qkvz + in_proj_ba, conv, out_proj
            t.state((conv - 1) * conv_dim * t.dtype, nv * dk * dv * _ssm_dtype(cfg),
                    t.hidden * (2 * key_dim + 2 * value_dim + 2 * nv) + conv_dim * conv
                    + value_dim * t.hidden)
        t.moe(int(cfg["num_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
              int(cfg.get("shared_expert_intermediate_size") or 0))


def _nemotron_h(cfg: Mapping[str, Any], t: _Tally) -> None:
    head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim")
                   or t.hidden // int(cfg["num_attention_heads"]))
    for kind in str(cfg["hybrid_override_pattern"]):
        if kind == "M":
            t.mamba2(cfg, int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"]), int(cfg["ssm_state_size"]),
                     int(cfg["n_groups"]), int(cfg["conv_kernel"]))
        elif kind == "*":
            t.attention(int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), head_dim)
        elif kind == "-":
            t.mlp(int(cfg["intermediate_size"]), gated=False)  # squared-ReLU MLP
        elif kind == "E":
            t.moe(int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
                  int(cfg["moe_intermediate_size"]), int(cfg.get("moe_shared_expert_intermediate_size") or 0))
        else:
            raise ValueError(f"unknown hybrid_override_pattern layer {kind!r}")


def _granite_hybrid(cfg: Mapping[str, Any], t: _Tally) -> None:
    heads = int(cfg["mamba_n_heads"])
    head_dim = int(cfg.get("mamba_d_head") or int(cfg["mamba_expand"]) * t.hidden // heads)
    for kind in cfg["layer_types"]:
        if kind == "mamba":
            t.mamba2(cfg, heads, head_dim, int(cfg["mamba_d_state"]), int(cfg["mamba_n_groups"]),
                     int(cfg["mamba_d_conv"]))
        elif kind == "attention":
            t.attention(int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                        t.hidden // int(cfg["num_attention_heads"]))
        else:
            raise ValueError(f"unknown layer type {kind!r}")
        experts = int(cfg.get("num_local_experts") or 0)
        if experts:
            t.moe(experts, int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                  int(cfg.get("shared_intermediate_size") or 0))
        else:
            t.mlp(int(cfg.get("shared_intermediate_size") or cfg["intermediate_size"]))


def _falcon_h1(cfg: Mapping[str, Any], t: _Tally) -> None:
    heads = int(cfg["mamba_n_heads"])
    head_dim = int(cfg.get("mamba_d_head") or int(cfg["mamba_d_ssm"]) // heads)
    for _ in range(int(cfg["num_hidden_layers"])):  # attention and Mamba2 side by side in every layer
        t.attention(int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"]))
        t.mamba2(cfg, heads, head_dim, int(cfg["mamba_d_state"]), int(cfg["mamba_n_groups"]),
                 int(cfg["mamba_d_conv"]))
        t.mlp(int(cfg["intermediate_size"]))


def _zamba2(cfg: Mapping[str, Any], t: _Tally) -> None:
    d_inner = int(cfg["mamba_expand"]) * t.hidden
    head_dim = int(cfg["mamba_headdim"])
    heads = int(cfg.get("n_mamba_heads") or d_inner // head_dim)
    q_heads = int(cfg["num_attention_heads"])
    attn_head = int(cfg.get("attention_head_dim") or 2 * t.hidden // q_heads)
    shared_blocks = int(cfg.get("num_mem_blocks") or 1)
    applications = 0
    for kind in cfg["layers_block_type"]:
        if kind == "hybrid":
            # The shared transformer block runs on [hidden, embeddings] (2 x hidden wide), then
            # a linear back to hidden; every application costs compute and keeps its own KV,
            # but its weights exist ``num_mem_blocks`` times in all.
            before = t.params
            t.attention(q_heads, int(cfg.get("num_key_value_heads") or q_heads), attn_head,
                        width=2 * t.hidden)
            t.mlp(int(cfg["intermediate_size"]))
            applications += 1
            if applications > shared_blocks:
                t.repeated += t.params - before
            t.params += t.hidden * t.hidden  # the per-layer linear after the shared block
        t.mamba2(cfg, heads, head_dim, int(cfg["mamba_d_state"]), int(cfg["mamba_ngroups"]),
                 int(cfg["mamba_d_conv"]))


def _lfm2(cfg: Mapping[str, Any], t: _Tally) -> None:
    ff = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier"):
            ff = int(float(cfg["block_ffn_dim_multiplier"]) * ff)
        multiple = int(cfg.get("block_multiple_of") or 1)
        ff = multiple * ((ff + multiple - 1) // multiple)
    heads = int(cfg["num_attention_heads"])
    kinds = cfg.get("layer_types") or [
        "full_attention" if i in set(cfg["full_attn_idxs"]) else "conv"
        for i in range(int(cfg["num_hidden_layers"]))]
    lcache = int(cfg.get("conv_L_cache") or 3)
    for kind in kinds:
        if kind == "full_attention":
            t.attention(heads, int(cfg["num_key_value_heads"]), t.hidden // heads)
        elif kind == "conv":  # short conv: in_proj to B, C, x; depthwise conv; out_proj
            t.state((lcache - 1) * t.hidden * t.dtype, 0, 4 * t.hidden * t.hidden + lcache * t.hidden)
        else:
            raise ValueError(f"unknown layer type {kind!r}")
        t.mlp(ff)


_FAMILIES = {
    "qwen3_next": _qwen3_next,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite_hybrid,
    "falcon_h1": _falcon_h1,
    "zamba2": _zamba2,
    "lfm2": _lfm2,
}


def geometry_from_config(cfg: Mapping[str, Any], name: str = "") -> ModelGeometry:
    """The geometry of the model a Hugging Face ``config.json`` describes.

    Raises ValueError for a model type this module does not know (say which are known).
    """
    model_type = str(cfg.get("model_type", ""))
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"no cache geometry for model_type {model_type!r}; known: {sorted(_FAMILIES)}")
    t = _Tally(hidden=int(cfg["hidden_size"]), dtype=_dtype(cfg))
    family(cfg, t)
    return t.geometry(name or str(cfg.get("_name_or_path") or model_type), int(cfg["vocab_size"]),
                      bool(cfg.get("tie_word_embeddings", False)))
