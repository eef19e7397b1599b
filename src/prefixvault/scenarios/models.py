"""Tiny random hybrid / recurrent models and a matching tokenizer, built locally.

Why: prefixvault must restore attention KV *and* recurrent state (GDN, ShortConv,
Mamba2) bit-exactly.  Tests need real vLLM engines on CPU, but weights cannot be
downloaded, so each profile is built from a ``transformers`` config with a fixed
seed and saved with ``save_pretrained``.  Random models with default init forget
their recurrent state within a few tokens, which would hide a wrongly restored
state; the builders below therefore enlarge the init and slow the state decay so
that a wrong state visibly changes the logprobs hundreds of tokens later.

torch / transformers / tokenizers are imported lazily: prefixvault's core does not
depend on them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "PROFILES",
    "Profile",
    "build_model",
    "consumer_prompt",
    "engine_kwargs",
    "filler",
    "producer_prompt",
    "train_tokenizer",
]

#: Tokenizer size; every model's ``vocab_size`` equals it exactly.
VOCAB_SIZE = 1024
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_SPECIAL = (PAD, BOS, EOS)  # ids 0, 1, 2


@dataclass(frozen=True)
class Profile:
    """What a profile builds and how to start vLLM (CPU) on it."""

    name: str
    architecture: str
    model_type: str
    layers: tuple[str, ...]
    state: str
    vllm_cpu: bool
    engine: Mapping[str, Any] = field(default_factory=dict)
    notes: str = ""


#: Block size used by every profile.  256 is what vLLM CPU picks for hybrids anyway
#: (attention page >= mamba page); fixing it keeps the layouts comparable.
BLOCK_SIZE = 256

_COMMON_ENGINE: Mapping[str, Any] = MappingProxyType(
    {
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "max_model_len": 4096,
        "block_size": BLOCK_SIZE,
        # One block per scheduler step: (1) the CPU Mamba2 scan cannot emit the
        # intermediate states that a chunk spanning a block boundary needs
        # (IndexError in mamba_mixer2), (2) every run then computes the same chunks,
        # so a prefix-cache hit at any block boundary is bit-exact with a fresh run.
        "max_num_batched_tokens": BLOCK_SIZE,
        # "auto" is host-dependent on CPU: float32 on AVX512-BF16 hosts, else the model
        # dtype (bfloat16 for GDN).  Pin it so state layouts match across hosts.
        "mamba_ssm_cache_dtype": "float32",
        "seed": 0,
    }
)


def _engine(**extra: Any) -> Mapping[str, Any]:
    return MappingProxyType({**_COMMON_ENGINE, **extra})


PROFILES: dict[str, Profile] = {
    "gdn-hybrid": Profile(
        name="gdn-hybrid",
        architecture="Qwen3NextForCausalLM",
        model_type="qwen3_next",
        layers=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        state="gdn",
        vllm_cpu=True,
        engine=_engine(dtype="bfloat16"),
        notes="CPU GDN kernel requires bfloat16 and linear head dims of 64 (32 fails); "
        "vLLM's Qwen3-Next needs >= 1 MoE layer (tiny 4-expert MoE).",
    ),
    "shortconv-hybrid": Profile(
        name="shortconv-hybrid",
        architecture="Lfm2ForCausalLM",
        model_type="lfm2",
        layers=("conv", "full_attention", "conv", "full_attention"),
        state="shortconv",
        vllm_cpu=True,
        engine=_engine(),
        notes="config.json gets conv_dim/block_dim for vLLM; head 0 of each attention "
        "layer is a recency head so a wrong conv state is visible.",
    ),
    "mamba2": Profile(
        name="mamba2",
        architecture="Mamba2ForCausalLM",
        model_type="mamba2",
        layers=("mamba2", "mamba2", "mamba2"),
        state="mamba2",
        vllm_cpu=True,
        engine=_engine(mamba_block_size=BLOCK_SIZE),
        notes="align mode crashes with the default mamba_block_size (16) and whenever a "
        "prefill chunk spans a block boundary.",
    ),
    "mamba2-hybrid": Profile(
        name="mamba2-hybrid",
        architecture="Zamba2ForCausalLM",
        model_type="zamba2",
        layers=("mamba", "hybrid", "mamba", "hybrid"),
        state="mamba2",
        vllm_cpu=True,
        engine=_engine(),
        notes="Zamba2: 4 Mamba2 layers, 1 shared attention block used by the 2 hybrid "
        "layers; lm_head tied to the embedding.",
    ),
    "mamba1": Profile(
        name="mamba1",
        architecture="MambaForCausalLM",
        model_type="mamba",
        layers=("mamba", "mamba"),
        state="mamba1",
        vllm_cpu=False,
        engine=_engine(mamba_block_size=BLOCK_SIZE),
        notes="vLLM CPU has no Mamba1 kernels (selective_scan_fwd); the tests run it with a "
        "reference kernel of their own (tests/vllm_support/mamba1_ops.py).",
    ),
    "nemotron-h": Profile(
        name="nemotron-h",
        architecture="NemotronHForCausalLM",
        model_type="nemotron_h",
        layers=("mamba", "mlp", "mamba", "attention"),
        state="mamba2",
        vllm_cpu=True,
        engine=_engine(),
        notes="Nemotron-H: Mamba2, MLP and attention layers, one kind per layer "
        "(hybrid_override_pattern 'M-M*').",
    ),
    "granite-4-h": Profile(
        name="granite-4-h",
        architecture="GraniteMoeHybridForCausalLM",
        model_type="granitemoehybrid",
        layers=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        state="mamba2",
        vllm_cpu=True,
        engine=_engine(),
        notes="Granite-4.0-H: Mamba2 + attention layers, each with a tiny MoE (4 experts, "
        "top 2) and a shared MLP.",
    ),
    "falcon-h1": Profile(
        name="falcon-h1",
        architecture="FalconH1ForCausalLM",
        model_type="falcon_h1",
        layers=("parallel", "parallel", "parallel", "parallel"),
        state="mamba2",
        vllm_cpu=True,
        engine=_engine(),
        notes="Falcon-H1: attention and Mamba2 side by side in every layer.",
    ),
    "lfm2-moe": Profile(
        name="lfm2-moe",
        architecture="Lfm2MoeForCausalLM",
        model_type="lfm2_moe",
        layers=("conv", "full_attention", "conv", "full_attention"),
        state="shortconv",
        vllm_cpu=True,
        engine=_engine(),
        notes="LFM2-MoE: ShortConv + attention, layer 0 dense, the others a tiny MoE "
        "(4 experts, top 2); recency heads as in shortconv-hybrid.",
    ),
    "qwen3.5": Profile(
        name="qwen3.5",
        architecture="Qwen3_5ForCausalLM",
        model_type="qwen3_5_text",
        layers=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        state="gdn",
        vllm_cpu=True,
        engine=_engine(dtype="bfloat16"),
        notes="Qwen3.5 (dense, text only). vLLM's qwen3_5.py imports the Qwen3-VL code, "
        "which needs torchvision importable.",
    ),
    "jamba": Profile(
        name="jamba",
        architecture="JambaForCausalLM",
        model_type="jamba",
        layers=("mamba", "attention", "mamba", "attention"),
        state="mamba1",
        vllm_cpu=False,
        engine=_engine(),
        notes="Jamba: Mamba1 + attention, MoE in layers 1 and 3. vLLM CPU has no Mamba1 "
        "kernels; the tests run it with a reference kernel of their own.",
    ),
}


def engine_kwargs(profile: str, path: Path | str) -> dict[str, Any]:
    """Return ready ``vllm.LLM(**kwargs)`` arguments for a built profile."""
    return {"model": str(path), "tokenizer": str(path), **PROFILES[profile].engine}


# --------------------------------------------------------------------------- prompts

SHARED = (
    "Cache correctness record. The exact verification code is {code}. "
    "Remember it for a later question. "
)
FILLER = "neutral cache context "
PRODUCER_TAIL = "Producer-only task: write the cache and answer ACK:"
CONSUMER_TAIL = (
    "Consumer-only question: What is the exact verification code? Answer only with the code:"
)


def filler(repeats: int, varied: bool = False) -> str:
    """``repeats`` copies of the neutral filler.

    With ``varied`` each copy gets one extra word drawn from a fixed-seed RNG, so the
    text (and hence a recurrent state) never becomes periodic; a periodic state can
    make a state restored at the wrong block look right.
    """
    if not varied:
        return FILLER * repeats
    rng = random.Random(0)  # fixed: filler(n) is a prefix of filler(m) for n < m
    return "".join(f"{FILLER}{rng.choice(_WORDS)} " for _ in range(repeats))


def producer_prompt(code: str, repeats: int, varied: bool = False) -> str:
    """Producer prompt of the cache-correctness bug report (shared prefix + filler)."""
    return SHARED.format(code=code) + filler(repeats, varied) + PRODUCER_TAIL


def consumer_prompt(code: str, repeats: int, varied: bool = False) -> str:
    """Consumer prompt: same shared prefix, different filler length and question."""
    return SHARED.format(code=code) + filler(repeats, varied) + CONSUMER_TAIL


# --------------------------------------------------------------------------- tokenizer

_WORD_TEXT = (
    "the a an of to in on at for with by from and or but not is are was were be been has have "
    "had do does did will would can could should may might must this that these those it its "
    "we you they he she i me my our your their what which who when where why how all any each "
    "some no only same other new old first last next later early long short high low big small "
    "exact correct wrong true false good bad fast slow hot cold open close start stop read write "
    "load store save keep drop send take give make use find show tell ask answer question task "
    "code cache record context prefix suffix block state token model layer engine request "
    "reply value key hash page chunk batch memory disk vault restore verify check test run step "
    "producer consumer neutral remember verification only write please system user assistant "
    "number name time day year world people place water light sound word line point part side "
    "hand head house room door table paper book story music river stone tree green blue red "
    "black white one two three four five six seven eight nine ten zero hundred thousand"
)
_WORDS = tuple(_WORD_TEXT.split())

_SUFFIXES = ("", "", "", "", "s", "ed", "ing", "er", "ly", "ness", "able")

_PHRASES = (
    "Cache correctness record.",
    "The exact verification code is",
    "Remember it for a later question.",
    "neutral cache context",
    "Producer-only task: write the cache and answer ACK:",
    "Consumer-only question: What is the exact verification code?",
    "Answer only with the code:",
)


def _corpus() -> list[str]:
    """Deterministic training text: key phrases, digits and a little English."""
    rng = random.Random(1234)
    lines: list[str] = []
    for i in range(400):
        code = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
        lines.append(
            f"{_PHRASES[0]} {_PHRASES[1]} {code}. {_PHRASES[2]} "
            + (_PHRASES[3] + " ") * rng.randint(1, 6)
            + (_PHRASES[4] if i % 2 else _PHRASES[5] + " " + _PHRASES[6])
        )
    for _ in range(3000):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) + rng.choice(_SUFFIXES) for _ in range(n)]
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,:;"))
    return lines


#: A plain-text chat template (the tiny vocabulary has no special turn tokens): each message
#: as "### role:" and its text on the next line; the generation prompt opens an assistant turn.
#: Rendering more messages only appends text, as the templates of real chat models do.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)


def train_tokenizer(path: Path | str, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a byte-level BPE on ``_corpus()`` and save it as a HF fast tokenizer.

    Digits are split individually, so verification codes stay token-per-digit.
    The output (``tokenizer.json`` + ``tokenizer_config.json``) loads with
    ``AutoTokenizer`` and vLLM.  Same corpus and size give the same bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# --------------------------------------------------------------------------- models


def _qwen3_next_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": list(PROFILES["gdn-hybrid"].layers),
        "num_attention_heads": 2,
        # 2 KV heads: the attention page (256 tokens) must hold the fp32 GDN state,
        # otherwise vLLM raises the hybrid block size to 512.
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        # vLLM's Qwen3-Next needs at least one MoE layer: keep a tiny one everywhere.
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _lfm2_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": list(PROFILES["shortconv-hybrid"].layers),
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "block_auto_adjust_ff_dim": False,
        "conv_L_cache": 3,
        "initializer_range": 0.1,
    }


def _mamba2_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_heads": 8,
        "head_dim": 32,
        "expand": 2,
        "n_groups": 1,
        "state_size": 32,
        "conv_kernel": 4,
        "chunk_size": 256,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _zamba2_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layers_block_type": list(PROFILES["mamba2-hybrid"].layers),
        "mamba_d_state": 32,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "n_mamba_heads": 8,
        "num_attention_heads": 2,
        "intermediate_size": 256,
        "max_position_embeddings": 4096,
        "chunk_size": 256,
        "initializer_range": 0.1,
    }


def _mamba1_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "state_size": 16,
        "expand": 2,
        "initializer_range": 0.1,
    }


def _nemotron_h_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "hybrid_override_pattern": "M-M*",
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "n_groups": 1,
        "ssm_state_size": 32,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 256,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _granite_hybrid_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": list(PROFILES["granite-4-h"].layers),
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 128,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_n_groups": 1,
        "mamba_d_state": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "position_embedding_type": "rope",
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _falcon_h1_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_d_ssm": 256,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_n_groups": 1,
        "mamba_d_state": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _lfm2_moe_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": list(PROFILES["lfm2-moe"].layers),
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "conv_L_cache": 3,
        "initializer_range": 0.1,
    }


def _qwen3_5_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": list(PROFILES["qwen3.5"].layers),
        "num_attention_heads": 2,
        "num_key_value_heads": 2,  # as gdn-hybrid: the attention page must hold the GDN state
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _jamba_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


_CONFIGS: dict[str, tuple[str, str, Callable[[], dict[str, Any]]]] = {
    "gdn-hybrid": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _qwen3_next_config),
    "shortconv-hybrid": ("Lfm2Config", "Lfm2ForCausalLM", _lfm2_config),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", _mamba2_config),
    "mamba2-hybrid": ("Zamba2Config", "Zamba2ForCausalLM", _zamba2_config),
    "mamba1": ("MambaConfig", "MambaForCausalLM", _mamba1_config),
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", _nemotron_h_config),
    "granite-4-h": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", _granite_hybrid_config),
    "falcon-h1": ("FalconH1Config", "FalconH1ForCausalLM", _falcon_h1_config),
    "lfm2-moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", _lfm2_moe_config),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _qwen3_5_config),
    "jamba": ("JambaConfig", "JambaForCausalLM", _jamba_config),
}


#: Gain on the final norm: sharper next-token distributions, so a changed hidden
#: state shows up as a larger logprob change (random models are otherwise near-uniform).
LOGIT_GAIN = 4.0
#: (final norm parameter, whether that norm stores ``weight - 1``) per model family.
_FINAL_NORM = {
    "gdn-hybrid": ("model.norm.weight", True),
    "shortconv-hybrid": ("model.embedding_norm.weight", False),
    "mamba2": ("backbone.norm_f.weight", False),
    "mamba2-hybrid": ("model.final_layernorm.weight", False),
    "mamba1": ("backbone.norm_f.weight", False),
    "nemotron-h": ("model.norm_f.weight", False),
    "granite-4-h": ("model.norm.weight", False),
    "falcon-h1": ("model.final_layernorm.weight", False),
    "lfm2-moe": ("model.embedding_norm.weight", False),
    "qwen3.5": ("model.norm.weight", True),
    "jamba": ("model.final_layernorm.weight", False),
}
#: Recurrent memory: per-head decay time constants, log-spaced over this range (tokens).
TAU_RANGE = (30.0, 10000.0)
#: Median step size softplus(dt_bias) and the spread of the input-dependent part of dt:
#: a selective dt lets a few tokens (e.g. the code digits) dominate the state.
DT_MEDIAN = 0.125
DT_STD = 2.0


def _tune(model: Any, profile: str, seed: int) -> None:
    """Make the random model state-sensitive (long, selective memory; sharp logits)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7)
    params = dict(model.named_parameters())
    config = model.config
    norm_name, centered = _FINAL_NORM[profile]
    with torch.no_grad():
        norm = params[norm_name]
        norm.copy_((norm + 1) * LOGIT_GAIN - 1 if centered else norm * LOGIT_GAIN)
        for name in sorted(params):
            param = params[name]
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log" and param.dim() == 2:
                # Mamba1: A is (channels, states); decay per token exp(-dt * exp(A_log)).
                tau = torch.logspace(math.log10(TAU_RANGE[0]), math.log10(TAU_RANGE[1]),
                                     param.numel(), dtype=torch.float64)
                tau = tau[torch.randperm(param.numel(), generator=gen)].reshape(param.shape)
                param.copy_(torch.log(1.0 / (DT_MEDIAN * tau)).to(param.dtype))
            elif name.endswith("dt_proj.bias"):  # Mamba1: dt = softplus(dt_proj(x) + bias)
                param.fill_(math.log(math.expm1(DT_MEDIAN)))
            elif name.endswith("dt_proj.weight"):
                rows = torch.randn(param.shape, generator=gen)
                param.copy_(rows * (DT_STD / math.sqrt(param.shape[1])))
            elif leaf == "A_log" and param.dim() == 1:
                heads = param.numel()
                tau = torch.logspace(
                    math.log10(TAU_RANGE[0]), math.log10(TAU_RANGE[1]), heads, dtype=torch.float64
                )
                tau = tau[torch.randperm(heads, generator=gen)]
                # decay per token = exp(-dt * exp(A_log)) = exp(-1 / tau) at the median dt.
                param.copy_(torch.log(1.0 / (DT_MEDIAN * tau)).to(param.dtype))
            elif leaf == "dt_bias" and param.dim() == 1:
                param.fill_(math.log(math.expm1(DT_MEDIAN)))
            elif PROFILES[profile].state == "mamba2" and name.endswith("in_proj.weight"):
                # Mamba2 in_proj rows are [z, x, B, C, dt]: the last n_heads rows give dt.
                heads = params[name.removesuffix("in_proj.weight") + "A_log"].numel()
                rows = torch.randn(heads, param.shape[1], generator=gen)
                param[-heads:] = rows * (DT_STD / math.sqrt(param.shape[1]))
        if PROFILES[profile].state == "shortconv":
            _recency_heads(params, config)


#: Recency head (LFM2 only): attention score amplitude and the rotary period it uses.
RECENCY_AMPLITUDE = 10.0
RECENCY_PERIOD = 400.0


def _recency_heads(params: dict[str, Any], config: Any) -> None:
    """Turn head 0 of every LFM2 attention layer into a content-free recency head.

    Why: a ShortConv state covers only the last ``conv_L_cache - 1`` tokens, so a
    wrong state perturbs two tokens, whose effect on the last token is diluted by
    attention over the whole context.  A head that attends to the last ~150 tokens
    makes that perturbation visible.  Construction: hidden dimension 0 is a
    constant (embedding column 0 = const, nothing writes to it); head 0's q and k
    read only that dimension into one rotary pair, so after q/k RMSNorm they are
    constant and the score is ``A * cos(theta * distance)``.
    """
    head_dim = config.hidden_size // config.num_attention_heads
    half = head_dim // 2
    theta = float(config.rope_parameters["rope_theta"])
    freqs = [theta ** (-2 * i / head_dim) for i in range(half)]
    pair = min(range(half), key=lambda i: abs(math.log(freqs[i] * RECENCY_PERIOD)))
    # score = (1/sqrt(hd)) * 2 * (sqrt(hd/2) * g)^2 * cos = sqrt(hd) * g^2 * cos
    gain = math.sqrt(RECENCY_AMPLITUDE / math.sqrt(head_dim))
    params["model.embed_tokens.weight"][:, 0] = 3.0 * float(config.initializer_range)
    for name, param in params.items():
        if name.endswith(("out_proj.weight", "w2.weight")):
            param[0] = 0.0  # nothing writes to the constant dimension
        elif name.endswith("experts.down_proj"):  # (experts, hidden, intermediate)
            param[:, 0] = 0.0
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            param[:head_dim] = 0.0
            param[pair, 0] = 1.0
            param[pair + half, 0] = 1.0
        elif name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            param[pair] = gain
            param[pair + half] = gain


def build_model(profile: str, path: Path | str, seed: int = 0, layers: int | None = None) -> Path:
    """Build ``profile`` (random weights + tokenizer) into ``path`` and return it.

    Deterministic: the same profile, seed and library versions write the same bytes.
    Load it with ``vllm.LLM(**engine_kwargs(profile, path))``. ``layers``: the profile's layer
    pattern repeated to that many layers (a deeper model, whose prefill costs as many times more
    per cached byte as a real model's does; profiles with a ``layer_types`` pattern only).
    """
    if profile not in _CONFIGS:
        raise KeyError(f"unknown profile {profile!r}; choose from {sorted(_CONFIGS)}")
    import torch
    import transformers

    config_name, model_name, make_config = _CONFIGS[profile]
    out = Path(path)
    kwargs = make_config()
    if layers is not None:
        pattern = kwargs.get("layer_types")
        if not pattern or layers < 1:
            why = "it has no layer pattern to repeat" if not pattern else "at least 1"
            raise ValueError(f"profile {profile!r} cannot be built with {layers} layers ({why})")
        repeated = [pattern[i % len(pattern)] for i in range(layers)]
        kwargs.update(num_hidden_layers=layers, layer_types=repeated)
    train_tokenizer(out)
    kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [model_name]
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    _tune(model, profile, seed)
    model.save_pretrained(out)
    if profile == "shortconv-hybrid":
        # vLLM's LFM2 reads conv_dim / block_dim, which transformers does not write.
        cfg_path = out / "config.json"
        data = json.loads(cfg_path.read_text())
        data.update(conv_dim=data["hidden_size"], block_dim=data["hidden_size"])
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out
