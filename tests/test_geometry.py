"""Cache geometry from real configs: each model's parameter count agrees with its published
size, and the bytes and block size of Qwen3-Next follow from its config by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the geometry lives beside the benchmarks that use it

from geometry import geometry_from_config  # noqa: E402

CONFIGS = BENCH / "model_configs"

#: Published total parameters (safetensors totals where known, else the model's name).
PUBLISHED = {
    "qwen3-next-80b-a3b": 80e9,
    "nemotron-h-8b": 8.100852736e9,
    "granite-4.0-h-small": 32.207337984e9,
    "falcon-h1-7b": 7.585648736e9,
    "zamba2-7b": 7.4e9,
    "lfm2-2.6b": 2.6e9,
}


def config(name: str) -> dict[str, object]:
    return dict(json.loads((CONFIGS / f"{name}.json").read_text()))


def test_every_model_config_is_covered() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_size(name: str) -> None:
    geo = geometry_from_config(config(name), name)
    assert abs(geo.total_params / PUBLISHED[name] - 1) < 0.03, geo.total_params
    assert geo.active_params > 0  # per token; Zamba2 runs its shared block 13 times: more than its total
    assert geo.kv_bytes_per_token > 0 and geo.state_bytes > 0
    assert geo.block_size % 16 == 0
    # A block's attention page (one layer) holds one layer's state page: vLLM's rule.
    assert geo.block_size * geo.attn_page_bytes_per_token >= geo.state_page_bytes


def test_qwen3_next_bytes_by_hand() -> None:
    geo = geometry_from_config(config("qwen3-next-80b-a3b"))
    assert (geo.attention_layers, geo.state_layers) == (12, 36)
    assert geo.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2  # layers x K,V x kv heads x head dim x bf16
    ssm = 32 * 128 * 128 * 2  # value heads x key dim x value dim, bf16 (vLLM's CUDA default)
    conv = (4 - 1) * (2 * 16 * 128 + 32 * 128) * 2  # kernel - 1 x (q, k, v channels), bf16
    assert geo.state_bytes == 36 * (ssm + conv)
    assert geo.block_size == 16 * -(-(ssm + conv) // (16 * 2 * 2 * 256 * 2)) == 544
    assert 3.0e9 < geo.active_params < 4.0e9  # "A3B"


def test_prefill_flops_grow_faster_than_the_tokens() -> None:
    geo = geometry_from_config(config("nemotron-h-8b"))
    assert geo.prefill_flops(0) == 0
    one, two = geo.prefill_flops(4096), geo.prefill_flops(8192)
    assert two > 2 * one  # attention's quadratic term
    assert one == pytest.approx(2 * geo.active_params * 4096 + 2 * geo.attn_width * 4096**2)


def test_an_unknown_model_type_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"known: .*qwen3_next"):
        geometry_from_config({"model_type": "llama", "hidden_size": 8, "vocab_size": 8})


def test_nemotron_h_keeps_its_ssm_state_in_float32_as_vllm_does() -> None:
    cfg = config("nemotron-h-8b")
    geo = geometry_from_config(cfg)
    per_layer = (4 - 1) * (128 * 64 + 2 * 8 * 128) * 2 + 128 * 64 * 128 * 4
    assert geo.state_bytes == 24 * per_layer
    assert geometry_from_config({**cfg, "mamba_ssm_cache_dtype": "bfloat16"}).state_bytes < geo.state_bytes
