"""Does vLLM compute a generated token's continuation the same whether it decoded it or prefilled it?

    PYTHONPATH=src python bench/decode_vs_prefill.py [--profile shortconv-hybrid] [--prompt 600]
        [--tokens 120]

Boundaries over generated tokens (``capture_outputs``) store what decode steps computed; a next
turn prefilling the same tokens computes them again. This measures, with no connector and no
prefix caching, how far the two are apart in the engine itself, and against the reference
implementation (Hugging Face transformers) on the same weights:

1. vLLM greedily decodes ``--tokens`` after a ``--prompt``-token prompt (top-5 logprobs per token);
2. vLLM prefills prompt + the first k generated tokens and gives the next token's top-5 logprobs;
3. transformers computes the same: one forward over prompt + k tokens, and the prompt then the
   k tokens one at a time through its cache.

Printed per k: the largest |logprob difference| over the top-5 tokens of each pair. Two paths of
one correct implementation differ by rounding (float32: ~1e-5); more is a difference in what is
computed. Last line: one JSON object with every figure. No GPU; tiny random model built locally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KS = (1, 5, 30, 60, 100)


def _top_diff(a: dict[int, float], b: dict[int, float]) -> float:
    common = set(a) & set(b)
    return max((abs(a[t] - b[t]) for t in common), default=float("nan"))


#: Top-5 log-probabilities by k (the next token after k generated tokens).
Logprobs = dict[int, dict[int, float]]


def _vllm(model: Path, profile: str, prompt: list[int], n: int) -> tuple[list[int], Logprobs, Logprobs]:
    from vllm import LLM, SamplingParams

    from prefixvault.scenarios.models import engine_kwargs

    kwargs = engine_kwargs(profile, model)
    kwargs.update(enable_prefix_caching=False, max_num_batched_tokens=max(1024, len(prompt) + n))
    kwargs.pop("mamba_cache_mode", None)
    llm = LLM(**kwargs)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    gen = list(out.token_ids)
    assert out.logprobs is not None
    decode = {k: {t: v.logprob for t, v in out.logprobs[k].items()} for k in KS if k < n}
    prefill: Logprobs = {}
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    for k in decode:
        o = llm.generate([{"prompt_token_ids": prompt + gen[:k]}], one, use_tqdm=False)[0].outputs[0]
        assert o.logprobs is not None
        prefill[k] = {t: v.logprob for t, v in o.logprobs[0].items()}
    return gen, decode, prefill


def _reference(model: Path, prompt: list[int], gen: list[int], ks: Sequence[int]
               ) -> tuple[dict[int, Any], dict[int, Any]]:
    """transformers' log-probabilities after prompt + k tokens: one forward, and step by step."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    top = max(ks)
    with torch.no_grad():
        full = torch.log_softmax(m(torch.tensor([prompt + gen[:top]])).logits[0].double(), -1)
        out = m(torch.tensor([prompt]), use_cache=True)
        steps = [torch.log_softmax(out.logits[0, -1].double(), -1)]
        for t in gen[:top]:
            out = m(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            steps.append(torch.log_softmax(out.logits[0, -1].double(), -1))
    return {k: full[len(prompt) + k - 1] for k in ks}, {k: steps[k] for k in ks}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="shortconv-hybrid")
    ap.add_argument("--prompt", type=int, default=600, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=120, help="tokens to generate")
    args = ap.parse_args(argv)
    for name, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(name, value)
    from transformers import AutoTokenizer

    from prefixvault.scenarios.models import build_model, producer_prompt

    with tempfile.TemporaryDirectory(prefix="pv-decode-") as tmp:
        model = build_model(args.profile, Path(tmp) / args.profile)
        tok = AutoTokenizer.from_pretrained(model)
        prompt = list(tok.encode(producer_prompt("DECODE-VS-PREFILL", 400, varied=True)))[: args.prompt]
        gen, decode, prefill = _vllm(model, args.profile, prompt, args.tokens)
        one, stepped = _reference(model, prompt, gen, list(decode))
    rows = []
    for k in decode:
        ref = {t: float(one[k][t]) for t in decode[k]}
        ref_p = {t: float(one[k][t]) for t in prefill[k]}
        ref_steps = {t: float(stepped[k][t]) for t in decode[k]}
        row = {"k": k, "vllm_decode_vs_prefill": _top_diff(decode[k], prefill[k]),
               "vllm_decode_vs_reference": _top_diff(decode[k], ref),
               "vllm_prefill_vs_reference": _top_diff(prefill[k], ref_p),
               "reference_steps_vs_one_forward": _top_diff(ref_steps, ref)}
        rows.append(row)
        print(f"k={k:3d}  vLLM decode vs prefill {row['vllm_decode_vs_prefill']:.3g}  "
              f"vLLM decode vs reference {row['vllm_decode_vs_reference']:.3g}  "
              f"vLLM prefill vs reference {row['vllm_prefill_vs_reference']:.3g}  "
              f"reference step by step vs one forward {row['reference_steps_vs_one_forward']:.3g}")
    print(json.dumps({"profile": args.profile, "prompt_tokens": len(prompt), "generated": len(gen),
                      "max_abs_logprob_diff_top5": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
