"""Consumer time-to-first-token with a restored prefix against cold, measured in one run.

    python bench/ttft.py [--profile gdn-hybrid] [--hidden 768] [--layers 8]
                         [--prefix-tokens 3000] [--reps 3] [--batched 512]

Why a bigger model: the seed profiles are so small that a cold 3k-token prefill costs
little more than engine overhead, which would hide what a restore saves. This bench builds
the profile's architecture scaled up (hidden size, layers, heads) with random weights and
the profile's tokenizer, so that the prefill's compute dominates.

Three engines, each in its own process (vLLM in-process mode inside it, for a fast start):
cold (no connector), a producer that fills a fresh local store, and a consumer that
restores from it. Each engine runs ``--reps`` prompts with distinct cache salts, so vLLM's
own prefix cache never helps; the producer runs its prompt once per salt because the salt
is part of every key. TTFT is the time of ``llm.generate`` with ``max_tokens=1`` for one
consumer prompt; each figure is the best of the repetitions. A short warm-up request with
its own salt runs first in every engine and is not timed.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixvault.scenarios.engine import EngineSpec, common_prefix, completions, run_engine
from prefixvault.scenarios.models import (
    PROFILES,
    VOCAB_SIZE,
    consumer_prompt,
    engine_kwargs,
    producer_prompt,
    train_tokenizer,
)
from prefixvault.stores import open_store

TARGET_RATIO = 0.3
CODE = "TTFT-4096-BENCH"
#: Scheduler and worker in the engine's process: engines start in seconds, not tens.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: Head size of every attention and linear-attention head (the CPU GDN kernel needs 64).
HEAD_DIM = 64
#: KV heads of full attention. With 4 the attention page of a 256-token block is larger than
#: the float32 GDN state of 8 value heads, so vLLM keeps the block size at 256.
KV_HEADS = 4
SCALABLE = ("gdn-hybrid", "shortconv-hybrid")


# --------------------------------------------------------------------------- model


def _layer_types(profile: str, layers: int) -> list[str]:
    pattern = PROFILES[profile].layers
    return [pattern[i % len(pattern)] for i in range(layers)]


def scaled_config(profile: str, hidden: int, layers: int) -> dict[str, Any]:
    """The profile's transformers config with a larger hidden size and more layers."""
    if hidden % (HEAD_DIM * KV_HEADS):
        raise ValueError(f"--hidden must be a multiple of {HEAD_DIM * KV_HEADS}, got {hidden}")
    heads = hidden // HEAD_DIM
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layer_types": _layer_types(profile, layers),
        "num_attention_heads": heads,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if profile == "gdn-hybrid":
        return {
            **common,
            "intermediate_size": 2 * hidden,
            "head_dim": HEAD_DIM,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": HEAD_DIM,
            "linear_value_head_dim": HEAD_DIM,
            "linear_conv_kernel_dim": 4,
            # Like the profile: every layer a small MoE (vLLM's Qwen3-Next needs one).
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": hidden,
            "shared_expert_intermediate_size": hidden,
            "tie_word_embeddings": False,
        }
    if profile == "shortconv-hybrid":
        return {**common, "intermediate_size": 3 * hidden, "block_auto_adjust_ff_dim": False,
                "conv_L_cache": 3}
    raise ValueError(f"profile {profile!r} cannot be scaled here; choose from {SCALABLE}")


def build_scaled(profile: str, path: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """Build (or reuse, if built with the same settings) the scaled model in ``path``."""
    import torch
    import transformers

    marker = path / "bench-model.json"
    wanted = {"profile": profile, "hidden": hidden, "layers": layers, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return path
    shutil.rmtree(path, ignore_errors=True)
    train_tokenizer(path)
    prof = PROFILES[profile]
    config = getattr(transformers, f"{prof.architecture.removesuffix('ForCausalLM')}Config")(
        **scaled_config(profile, hidden, layers))
    config.architectures = [prof.architecture]
    dtype = getattr(torch, str(prof.engine["dtype"]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, prof.architecture)(config).eval()
    # Saved in the engine's dtype: half the bytes to write and load for bfloat16 models.
    model.to(dtype).save_pretrained(path)
    if profile == "shortconv-hybrid":
        # vLLM's LFM2 reads conv_dim / block_dim, which transformers does not write.
        cfg_path = path / "config.json"
        data = json.loads(cfg_path.read_text())
        data.update(conv_dim=data["hidden_size"], block_dim=data["hidden_size"])
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    marker.write_text(json.dumps(wanted))
    return path


def parameter_count(path: Path) -> int:
    """Parameters in the saved safetensors files (header only, no weights read)."""
    total = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total


# --------------------------------------------------------------------------- prompts


def prompts(model: Path, prefix_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Producer, consumer and warm-up token ids; producer and consumer share ~``prefix_tokens``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))

    def ids(text: str) -> list[int]:
        return list(tok.encode(text))

    base = len(ids(consumer_prompt(CODE, 0, varied=True)))
    per_repeat = (len(ids(consumer_prompt(CODE, 200, varied=True))) - base) / 200
    repeats = max(1, round((prefix_tokens - base) / per_repeat))
    producer = ids(producer_prompt(CODE, repeats, varied=True))
    consumer = ids(consumer_prompt(CODE, repeats, varied=True))
    warmup = ids(consumer_prompt("WARMUP-1", 40, varied=False))
    return producer, consumer, warmup


# --------------------------------------------------------------------------- runs


def store_dir() -> Path:
    """A fresh store directory on tmpfs when it has room (store I/O is not what is measured)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 << 30 else None
    return Path(tempfile.mkdtemp(prefix="prefixvault-ttft-store-", dir=base))


def timed_engine(spec: EngineSpec, workdir: Path) -> tuple[list[float], list[int], list[int], float]:
    """Run one engine; per timed prompt: generate seconds, cached tokens, first token id."""
    t0 = time.perf_counter()
    result = run_engine(spec, workdir, env=IN_PROCESS, timeout=1800)
    wall = time.perf_counter() - t0
    comps = completions(result)[1:]  # drop the warm-up request
    seconds = [float(s) for s in result["generate_s"][1:]]
    return seconds, [c.cached_tokens for c in comps], [c.token_ids[0] for c in comps], wall


def mooncake_status() -> str | None:
    """None if vLLM's MooncakeStoreConnector could run here, else why it cannot."""
    if importlib.util.find_spec("mooncake") is None:
        return ("the `mooncake` Python package (mooncake-transfer-engine) is not installed in this "
                "environment, and the connector also needs a running mooncake_master")
    import torch

    if not torch.cuda.is_available():
        # vLLM 0.32's store worker records a torch.cuda.Event before every save
        # (kv_connector/v1/mooncake/store/worker.py), so it cannot save on a CPU engine.
        return "vLLM's MooncakeStoreConnector needs CUDA (its worker records a torch.cuda.Event per save)"
    return "not wired up in this bench yet: it needs a mooncake_master and a MOONCAKE_CONFIG_PATH"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="gdn-hybrid", choices=SCALABLE)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the scaled model")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the scaled model")
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="shared prefix length (about)")
    ap.add_argument("--reps", type=int, default=3, help="timed prompts per engine; the best counts")
    ap.add_argument("--batched", type=int, default=512, help="max_num_batched_tokens (multiple of 256)")
    ap.add_argument("--capture", default="steps", help="producer capture policy")
    ap.add_argument("--model-dir", type=Path, help="build or reuse the model here (default: temporary)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = ap.parse_args(argv)
    if not 256 <= args.prefix_tokens <= 3900:
        ap.error("--prefix-tokens must be in [256, 3900] (max_model_len is 4096)")
    if args.batched % 256:
        ap.error("--batched must be a multiple of the block size (256)")
    started = time.perf_counter()

    work = Path(tempfile.mkdtemp(prefix="prefixvault-ttft-"))
    sdir = store_dir()
    try:
        model_dir = args.model_dir or work / "model"
        t = time.perf_counter()
        model = build_scaled(args.profile, model_dir, args.hidden, args.layers)
        build_s = time.perf_counter() - t
        params = parameter_count(model)
        producer, consumer, warmup = prompts(model, args.prefix_tokens)
        engine = engine_kwargs(args.profile, model)
        engine.pop("model")
        engine["max_num_batched_tokens"] = args.batched
        salts = [f"ttft-{i}" for i in range(args.reps)]
        store = f"local://{sdir / 'store'}?capacity=4GiB"

        def spec(role: str, prompt: list[int], **kw: Any) -> EngineSpec:
            return EngineSpec(model=str(model), engine=dict(engine), prompts=[warmup] + [prompt] * args.reps,
                              role=role, salts=["warmup", *salts], max_tokens=1, logprobs=0, **kw)

        runs = work / "runs"
        cold_s, cold_hit, cold_tok, cold_wall = timed_engine(spec("cold", consumer), runs)
        prod_s, _, _, prod_wall = timed_engine(
            spec("kv_producer", producer, store=store, extra_config={"capture": args.capture}), runs)
        with open_store(store) as s:
            stored = s.stats()
        rest_s, rest_hit, rest_tok, rest_wall = timed_engine(spec("kv_consumer", consumer, store=store), runs)
    finally:
        if not args.keep:
            shutil.rmtree(sdir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)

    cold, restored = min(cold_s), min(rest_s)
    ratio = restored / cold
    why_not = mooncake_status()

    print(f"model    {args.profile} scaled: hidden {args.hidden}, {args.layers} layers"
          f", {params / 1e6:.0f}M parameters, built in {build_s:.1f} s")
    print(f"prompts  consumer {len(consumer)} tokens, producer {len(producer)} tokens, "
          f"shared prefix {common_prefix(producer, consumer)} tokens")
    print(f"store    {stored.objects} objects, {stored.bytes / 2**20:.1f} MiB after the producer "
          f"(capture {args.capture}, max_num_batched_tokens {args.batched})")
    print()
    print(f"{'rep':>4}{'cold s':>10}{'producer s':>12}{'restored s':>12}{'restored tok':>14}"
          f"{'same token':>12}")
    for i in range(args.reps):
        print(f"{i:>4}{cold_s[i]:10.3f}{prod_s[i]:12.3f}{rest_s[i]:12.3f}{rest_hit[i]:14d}"
              f"{cold_tok[i] == rest_tok[i]!s:>12}")
    print()
    print(f"{'':24}{'TTFT s':>10}{'x cold':>8}{'target':>8}")
    print(f"{'cold (best)':24}{cold:10.3f}{1.0:8.2f}")
    print(f"{'producer (best)':24}{min(prod_s):10.3f}{min(prod_s) / cold:8.2f}")
    print(f"{'restored (best)':24}{restored:10.3f}{ratio:8.2f}{TARGET_RATIO:8.2f}")
    print(f"engine wall s: cold {cold_wall:.1f}, producer {prod_wall:.1f}, consumer {rest_wall:.1f}; "
          f"total {time.perf_counter() - started:.1f}")
    print(f"MooncakeStoreConnector: not measured: {why_not}.")
    if any(h == 0 for h in rest_hit) or any(h for h in cold_hit):
        print("warning: a consumer request restored nothing, or a cold one hit a cache", file=sys.stderr)
    print(json.dumps({
        "profile": args.profile,
        "hidden": args.hidden,
        "layers": args.layers,
        "parameters": params,
        "prompt_tokens": len(consumer),
        "restored_tokens": min(rest_hit),
        "cold_ttft_s": round(cold, 4),
        "restored_ttft_s": round(restored, 4),
        "producer_ttft_s": round(min(prod_s), 4),
        "cold_ttft_median_s": round(statistics.median(cold_s), 4),
        "restored_ttft_median_s": round(statistics.median(rest_s), 4),
        "ratio": round(ratio, 4),
        "target": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "same_first_token": cold_tok == rest_tok,
        "mooncake": {"measured": False, "reason": why_not},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
