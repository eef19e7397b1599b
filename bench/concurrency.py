"""Exactness under load, as operators run it: OpenAI servers and vLLM's own benchmark client.

Workload: vLLM's ``prefix_repetition`` dataset (shared prefixes, random suffixes), greedy,
``--ignore-eos``, at most ``--concurrency`` requests in flight. Servers are started as users
start them (no ``--block-size``), except the reference, which is told the hybrid block size so
that vLLM's own prefix cache is right:

- ``reference``: no connector, ``--block-size`` given, one request at a time;
- ``reference_load``: the same under load; where its texts equal ``reference``'s, cold is
  invariant to load (vLLM CPU is not batch-invariant) and the other servers are judged there;
- ``vllm_own``: no connector, as users start it; serves the workload twice (its own prefix
  cache under load);
- ``producer`` then ``consumer``: prefixvault over one local store.

Prints, per seed and in total, how many of the invariant requests each server got wrong; the
last line is one JSON object.

    python bench/concurrency.py [--profile gdn-hybrid] [--seeds 7 8] [--batched 512]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.servers import add_workload_args, benchmark, metric, prefix_repetition, server
from prefixvault.serve import engine_flags, serve_command, vllm_command


def _texts(result: dict[str, Any]) -> list[str]:
    texts: list[str] = result["generated_texts"]
    return texts


def run_seed(model: Path, profile: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    engine = engine_kwargs(profile, model)
    block = int(engine.pop("block_size"))
    engine.pop("model")
    engine.pop("tokenizer", None)
    engine["max_num_batched_tokens"] = args.batched
    flags = engine_flags(engine)
    load = prefix_repetition(args.prefix, args.suffix, args.prefixes, args.output, args.prompts,
                             args.concurrency, seed, args.request_rate)
    alone = prefix_repetition(args.prefix, args.suffix, args.prefixes, args.output, args.prompts, 1, seed)
    name = str(model)
    out: dict[str, Any] = {"seed": seed}

    def serve(tag: str, command: list[str], runs: list[list[str]]
              ) -> tuple[list[list[str]], dict[str, float]]:
        texts, metrics = [], {}
        # The same reserved core for every server: vLLM CPU reserves one more for a KV
        # connector, and other OpenMP thread counts give other sums (bench/serving.py).
        with server(command, work / f"{tag}-{seed}.log", env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}) as url:
            for i, bench_args in enumerate(runs):
                texts.append(_texts(benchmark(url, name, work / f"{tag}-{seed}-{i}.json", bench_args)))
            for m in ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                      "vllm:prefixvault_refused_total"):
                metrics[m] = metric(url, m)
        print(f"  seed {seed}: {tag} done", flush=True)
        return texts, metrics

    plain = [*vllm_command(name), *flags]
    (ref,), _ = serve("reference", [*plain, "--block-size", str(block)], [alone])
    (ref_load,), _ = serve("reference_load", [*plain, "--block-size", str(block)], [load])
    invariant = [i for i, (a, b) in enumerate(zip(ref, ref_load, strict=True)) if a == b]
    out["invariant"] = len(invariant)

    def wrong(texts: list[str]) -> list[int]:
        return [i for i in invariant if texts[i] != ref[i]]

    def where(texts: list[str]) -> list[str]:
        """For each wrong request: characters equal to the reference before it diverged / length."""
        def same(a: str, b: str) -> int:
            diff = (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            return next(diff, min(len(a), len(b)))

        return [f"{same(texts[i], ref[i])}/{len(ref[i])}" for i in wrong(texts)]

    own, _ = serve("vllm_own", plain, [load, load])
    out["vllm_own_pass1_wrong"] = wrong(own[0])
    out["vllm_own_pass2_wrong"] = wrong(own[1])
    store = f"local://{work}/store-{seed}?capacity=2GiB"
    _, prod_metrics = serve("producer", serve_command(name, store, "kv_producer", extra=flags), [load])
    (cons,), cons_metrics = serve("consumer", serve_command(name, store, "kv_consumer", extra=flags), [load])
    out["consumer_wrong"] = wrong(cons)
    out["consumer_diverged_at"] = where(cons)
    out["vllm_own_diverged_at"] = where(own[1])
    out["consumer_external_hit_tokens"] = cons_metrics["vllm:external_prefix_cache_hits_total"]
    out["producer_refused"] = prod_metrics["vllm:prefixvault_refused_total"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="gdn-hybrid")
    p.add_argument("--seeds", type=int, nargs="+", default=[7])
    add_workload_args(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pv-concurrency-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_model(args.profile, work / "model", seed=0)
        rows = []
        for seed in args.seeds:
            row = run_seed(model, args.profile, seed, args, work)
            print(f"seed {seed}: cold invariant on {row['invariant']}/{args.prompts}; wrong there: "
                  f"vLLM's own cache {len(row['vllm_own_pass2_wrong'])} (second pass), "
                  f"prefixvault consumer {len(row['consumer_wrong'])}", flush=True)
            rows.append(row)
    summary = {
        "bench": "concurrency", "profile": args.profile, "batched": args.batched, "prompts": args.prompts,
        "concurrency": args.concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate, "seeds": rows,
        "invariant": sum(r["invariant"] for r in rows),
        "vllm_own_wrong": sum(len(r["vllm_own_pass2_wrong"]) for r in rows),
        "consumer_wrong": sum(len(r["consumer_wrong"]) for r in rows),
        # The seed bug's symptom: wrong from the first generated character on.
        "vllm_own_wrong_from_start": sum(d.startswith("0/") for r in rows for d in r["vllm_own_diverged_at"]),
        "consumer_wrong_from_start": sum(d.startswith("0/") for r in rows for d in r["consumer_diverged_at"]),
    }
    print(json.dumps(summary))
    sys.exit(0)


if __name__ == "__main__":
    main()
