"""What each capture policy stores and what a consumer gets back from it, in one run.

    python bench/capture_policy.py [--profiles gdn-hybrid[,shortconv-hybrid]]
                                   [--policies steps,checkpoints,interval:1024]
                                   [--repeats 70,140,210,280,350,425]

Why: a recurrent state can only be restored at a boundary where the producer kept it, so
the capture policy trades store bytes for hits. ``checkpoints`` keeps only the prompt
checkpoint the engine offers, ``steps`` also every prefill step end on a block boundary,
``interval:N`` step ends at most once per N tokens. Attention blocks are stored under every
policy; only state objects and records differ.

Per profile and policy: a producer engine runs the seed producer prompt (once per cache
salt, since the salt is part of every key) into a fresh local store of its own; then a
consumer engine runs consumer prompts that share ~300 to ~1700 tokens with it, each with
its own salt so that vLLM's local prefix cache never serves one from another. Reported:
restored tokens (sum of ``cached_tokens``), bytes and objects stored by kind (``/b/``
attention block, ``/s/`` state, ``/r/`` record), and restored tokens per MiB stored. The
restored tokens are checked against the hits the policy's captured boundaries predict.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.scenarios import scenario
from prefixvault.scenarios.engine import EngineSpec, common_prefix, completions, run_engine
from prefixvault.scenarios.models import build_model, consumer_prompt, engine_kwargs, producer_prompt
from prefixvault.stores import open_store

CODE = "HYBRID-528-GDN"
#: The seed scenario's producer prompt: ~1.7k tokens.
PRODUCER_REPEATS = 430
#: Consumer filler repeats: common prefixes with the producer from ~300 to ~1700 tokens.
CONSUMER_REPEATS = (70, 140, 210, 280, 350, 425)
BATCHED = 512
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
KINDS = {"/b/": "block", "/s/": "state", "/r/": "record"}
MIB = 1 << 20


@dataclass
class PolicyResult:
    profile: str
    policy: str
    restored_tokens: int = 0
    expected_tokens: int = 0
    hits: list[int] = field(default_factory=list)
    objects: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    producer_s: float = 0.0
    consumer_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def tokens_per_mib(self) -> float:
        return self.restored_tokens / (self.total_bytes / MIB) if self.total_bytes else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "restored_tokens": self.restored_tokens,
            "expected_tokens": self.expected_tokens,
            "hits": self.hits,
            "bytes": self.total_bytes,
            "bytes_by_kind": self.bytes,
            "objects": sum(self.objects.values()),
            "objects_by_kind": self.objects,
            "restored_tokens_per_mib": round(self.tokens_per_mib, 1),
            "producer_generate_s": round(self.producer_s, 3),
            "consumer_generate_s": round(self.consumer_s, 3),
        }


def captured(prompt_tokens: int, policy: str, block_size: int) -> list[int]:
    """Boundaries a producer keeps a state at under ``policy`` (mirrors the connector's rule)."""
    if not policy.startswith("interval:"):
        return scenario.captured(prompt_tokens, BATCHED, block_size, policy)
    n = int(policy.split(":", 1)[1])
    kept, last = [scenario.checkpoint(prompt_tokens, block_size)], 0
    for end in scenario.schedule(prompt_tokens, BATCHED, block_size):
        if end % block_size == 0 and end // n > last // n:
            kept.append(end)
            last = end
    return sorted(set(kept))


def tally(uri: str) -> tuple[dict[str, int], dict[str, int]]:
    """Objects and bytes in a store, by kind (from the key's path segment)."""
    objects: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    with open_store(uri) as store:
        for key, size in store.scan(""):
            kind = next((k for seg, k in KINDS.items() if seg in key), "other")
            objects[kind] = objects.get(kind, 0) + 1
            nbytes[kind] = nbytes.get(kind, 0) + size
    return objects, nbytes


def run_profile(profile: str, policies: list[str], repeats: list[int], work: Path, stores: Path
                ) -> tuple[list[PolicyResult], dict[str, Any]]:
    """One producer and one consumer engine per policy, each policy with its own store."""
    from transformers import AutoTokenizer

    model = build_model(profile, work / "models" / profile, seed=0)
    tok = AutoTokenizer.from_pretrained(str(model))
    engine = engine_kwargs(profile, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = BATCHED
    bs = int(engine["block_size"])
    producer = list(tok.encode(producer_prompt(CODE, PRODUCER_REPEATS, varied=True)))
    consumers = [list(tok.encode(consumer_prompt(CODE, r, varied=True))) for r in repeats]
    shared = [common_prefix(producer, c) for c in consumers]
    salts = [f"policy-{r}" for r in repeats]
    info = {"producer_tokens": len(producer), "consumer_tokens": [len(c) for c in consumers],
            "shared_prefix_tokens": shared}

    results = []
    for policy in policies:
        uri = f"local://{stores / profile / policy.replace(':', '-')}?capacity=1GiB"
        res = PolicyResult(profile, policy)

        def spec(role: str, prompts: list[list[int]], policy: str = policy, uri: str = uri) -> EngineSpec:
            return EngineSpec(model=str(model), engine=dict(engine), prompts=prompts, role=role, store=uri,
                              extra_config={"capture": policy}, salts=list(salts), max_tokens=1, logprobs=0)

        runs = work / "runs" / profile
        prod = run_engine(spec("kv_producer", [producer] * len(salts)), runs, env=IN_PROCESS)
        cons = run_engine(spec("kv_consumer", consumers), runs, env=IN_PROCESS)
        res.producer_s = sum(prod["generate_s"])
        res.consumer_s = sum(cons["generate_s"])
        res.hits = [c.cached_tokens for c in completions(cons)]
        res.restored_tokens = sum(res.hits)
        kept = captured(len(producer), policy, bs)
        res.expected_tokens = sum(scenario.expected_hit(kept, len(c), s, bs)
                                  for c, s in zip(consumers, shared, strict=True))
        res.objects, res.bytes = tally(uri)
        results.append(res)
    return results, info


def store_root() -> Path:
    """Fresh store directories on tmpfs when it has room, else in the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 << 30 else None
    return Path(tempfile.mkdtemp(prefix="prefixvault-capture-", dir=base))


def print_table(profile: str, info: dict[str, Any], results: list[PolicyResult]) -> None:
    print(f"{profile}: producer {info['producer_tokens']} tokens, consumers share "
          f"{info['shared_prefix_tokens']} tokens with it, max_num_batched_tokens {BATCHED}")
    head = (f"{'policy':16}{'restored':>10}{'expected':>10}{'stored MiB':>12}{'blocks':>14}{'states':>14}"
            f"{'records':>12}{'objects':>9}{'tok/MiB':>9}")
    print(head)
    for r in results:
        def cell(kind: str, r: PolicyResult = r) -> str:
            return f"{r.objects.get(kind, 0)} / {r.bytes.get(kind, 0) / MIB:.2f}"

        print(f"{r.policy:16}{r.restored_tokens:>10}{r.expected_tokens:>10}{r.total_bytes / MIB:>12.2f}"
              f"{cell('block'):>14}{cell('state'):>14}{cell('record'):>12}{sum(r.objects.values()):>9}"
              f"{r.tokens_per_mib:>9.1f}")
    for r in results:
        print(f"  {r.policy:14} hits per consumer {r.hits}; generate s: producer {r.producer_s:.1f}, "
              f"consumer {r.consumer_s:.1f}")
    print("  (blocks / states / records: objects / MiB)")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="gdn-hybrid", help="comma-separated: gdn-hybrid,shortconv-hybrid")
    ap.add_argument("--policies", default="steps,checkpoints,interval:1024", help="comma-separated")
    ap.add_argument("--repeats", default=",".join(map(str, CONSUMER_REPEATS)),
                    help="consumer filler repeats, one consumer prompt each (~4 tokens per repeat)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = ap.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    policies = [p for p in args.policies.split(",") if p]
    repeats = [int(r) for r in args.repeats.split(",") if r]
    if any(not 0 < r <= PRODUCER_REPEATS for r in repeats):
        ap.error(f"--repeats must be in 1..{PRODUCER_REPEATS} (the producer's filler)")
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="prefixvault-capture-work-"))
    stores = store_root()
    out: dict[str, Any] = {}
    mismatched = []
    try:
        for profile in profiles:
            t = time.perf_counter()
            results, info = run_profile(profile, policies, repeats, work, stores)
            print_table(profile, info, results)
            out[profile] = {**info, "runtime_s": round(time.perf_counter() - t, 1),
                            "policies": {r.policy: r.as_json() for r in results}}
            mismatched += [f"{profile}/{r.policy}" for r in results if r.restored_tokens != r.expected_tokens]
    finally:
        if not args.keep:
            shutil.rmtree(stores, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    if mismatched:
        print(f"warning: restored tokens differ from the expected hits for {mismatched}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.1f} s")
    print(json.dumps({"batched": BATCHED, "profiles": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
