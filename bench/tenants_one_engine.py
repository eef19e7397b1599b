"""Two tenants of one engine (two cache salts), one filling the store: whether the other's working
set still restores, served by real vLLM servers.

    python bench/tenants_one_engine.py [--profile gdn-hybrid] [--capacity-mib 64] [--share 50]
        [--bob 8] [--fill 3] [--workdir DIR]

One producer server (``prefixvault serve``, kv_both, a namespace with a secret) on a local store
bounded per namespace (``namespace_share=--share%``): bob's requests (``cache_salt`` bob) store
``--bob`` prefixes (a working set within one share: about 2 MiB each with the default profile and
capture, a state stored at every step), then alice's requests store new prefixes worth ``--fill``
times the capacity. A consumer server on the same store (``kv_consumer``: it loads and never
saves), a fresh engine whose own prefix cache holds nothing, then serves bob's prompts again and each
restores what the store still holds (``usage.prompt_tokens_details.cached_tokens``; its own cache
emptied after it first served them, before the fill, which tells what was restorable then); and
alice's last prompts, to show she still caches (from her own oldest). Run twice on fresh stores: with
``tenant_namespaces`` (each salt's keys a namespace of its own, bounded on its own) and without
(the control: both salts in the engine's namespace, under one bound).

The last line printed is one JSON object: per run, bob's prefixes restored whole (of those
restorable before alice's fill), alice's last prefixes restored, the bytes each namespace holds,
and what the fill stored (saves dropped or refused are counted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

NAME = "tenants"
NAMESPACE = "pv"


def complete(url: str, prompt: list[int], salt: str) -> int:
    """One greedy completion of ``prompt`` (token ids) as tenant ``salt``: its cached tokens."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        usage = json.load(r)["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def reset_own_cache(url: str) -> None:
    """Empty the server's own prefix cache (vLLM's dev endpoint; the store is left as it is)."""
    req = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        if not json.load(r).get("success", True):
            raise RuntimeError(f"{url} did not reset its prefix cache")


def prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def held(store_uri: str) -> dict[str, int]:
    """Bytes per namespace the store holds now (opened beside the servers, as any process may)."""
    from prefixvault.stores import open_store
    from prefixvault.stores.base import namespace_of

    out: dict[str, int] = {}
    with open_store(store_uri) as store:
        for key, size in store.scan():
            out[namespace_of(key)] = out.get(namespace_of(key), 0) + size
    return out


def settle(url: str, name: str = "vllm:prefixvault_records_published_total", quiet_s: float = 3.0) -> None:
    """Wait until the producer's saves are stored (its published records stop growing)."""
    from prefixvault.scenarios.servers import metric

    last, since = -1.0, time.monotonic()
    while time.monotonic() - since < quiet_s:
        now = metric(url, name)
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.5)


def run_once(args: argparse.Namespace, work: Path, model: Path, flags: list[str], bounded: bool,
             secret: Path, length: int, vocab: int) -> dict[str, Any]:
    from prefixvault.scenarios.servers import metric, metric_by_label, servers
    from prefixvault.serve import serve_command

    mode = "tenant_namespaces" if bounded else "control"
    capacity = args.capacity_mib << 20
    uri = f"local://{work / ('store-' + mode)}?capacity={args.capacity_mib}MiB&namespace_share={args.share}%"
    commands = [(serve_command(str(model), uri, role, NAMESPACE, extra=flags, secret_file=str(secret),
                               tenant_namespaces=bounded), work / f"{mode}-{side}.log")
                for side, role in (("producer", "kv_both"), ("consumer", "kv_consumer"))]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # (for /reset_prefix_cache)
    with servers(commands, env) as (producer, consumer), ThreadPoolExecutor(args.concurrency) as pool:
        bob = prompts(1, args.bob, length, vocab)  # bob's working set
        list(pool.map(lambda p: complete(producer, p, "bob"), bob))
        settle(producer)
        before, put_before = held(uri), metric(producer, "vllm:prefixvault_put_bytes_total")
        block = int(args.block_size)
        whole = length // block * block if length % block else length - block
        restorable = [complete(consumer, p, "bob") >= whole for p in bob]  # before alice's fill
        reset_own_cache(consumer)
        per_prefix = max(1, sum(before.values()) // len(bob))
        alice = prompts(2, args.fill * capacity // per_prefix + 1, length, vocab)
        print(f"  {mode}: bob stored {len(bob)} prefixes ({sum(before.values()) >> 10} KiB); "
              f"alice sends {len(alice)}", flush=True)
        list(pool.map(lambda p: complete(producer, p, "alice"), alice))
        settle(producer)
        after, put = held(uri), metric(producer, "vllm:prefixvault_put_bytes_total") - put_before
        dropped = metric(producer, "vllm:prefixvault_save_dropped_total")
        errors = metric(producer, "vllm:prefixvault_save_errors_total")
        bob_hits = [complete(consumer, p, "bob") for p in bob]
        kept = sum(h >= whole for h, r in zip(bob_hits, restorable, strict=True) if r)
        alice_hits = [complete(consumer, p, "alice") for p in alice[-len(bob):]]
        decisions = {name: metric_by_label(consumer, f"vllm:prefixvault_{name}_total", label)
                     for name, label in (("lookup_misses", "reason"), ("restore_judgments", "judgment"))}
    return {"mode": mode, "bob_prefixes": len(bob), "alice_prefixes": len(alice),
            "bob_restorable_before": sum(restorable), "bob_restored_whole": kept,
            "bob_restored_share": round(kept / max(1, sum(restorable)), 3),
            "alice_last_restored_whole": sum(h >= whole for h in alice_hits),
            "bob_hit_tokens": bob_hits, "alice_hit_tokens": alice_hits, "consumer": decisions,
            "held_before_fill": before, "held_after_fill": after,
            "fill_stored_times_capacity": round(put / capacity, 2),  # (bytes alice's saves put)
            "save_dropped": dropped, "save_errors": errors, "restorable_tokens": whole}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="gdn-hybrid")
    p.add_argument("--capacity-mib", type=int, default=64)
    p.add_argument("--share", type=int, default=50, help="namespace_share, percent of the capacity")
    p.add_argument("--bob", type=int, default=8, help="bob's prefixes (his working set)")
    p.add_argument("--fill", type=int, default=3, help="alice's prefixes, times the capacity")
    p.add_argument("--blocks", type=int, default=4, help="full blocks per prompt (plus a few tokens)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workdir", default="")
    args = p.parse_args(argv)
    if not (0 < args.share <= 100 and args.bob >= 1 and args.fill >= 1 and args.blocks >= 1):
        p.error("--share is a percent in (0, 100]; --bob, --fill and --blocks at least 1")
    from prefixvault.scenarios.models import build_model, engine_kwargs
    from prefixvault.serve import engine_flags

    work = Path(args.workdir or tempfile.mkdtemp(prefix="prefixvault-tenants-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work: {work}", flush=True)
    model = build_model(args.profile, work / "model", seed=0)
    engine = engine_kwargs(args.profile, model)
    engine.pop("model")
    engine.pop("tokenizer", None)
    args.block_size = int(engine["block_size"])
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    flags = [*engine_flags(engine), "--served-model-name", NAME, "--enable-prompt-tokens-details"]
    secret = work / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    length = args.blocks * args.block_size + 5
    started = time.perf_counter()
    runs = [run_once(args, work, model, flags, bounded, secret, length, vocab) for bounded in (True, False)]
    for r in runs:
        print(f"{r['mode']:18} bob restores {r['bob_restored_whole']}/{r['bob_restorable_before']} whole "
              f"after alice put {r['fill_stored_times_capacity']}x the capacity "
              f"({r['alice_prefixes']} prefixes); "
              f"alice's last {r['bob_prefixes']}: {r['alice_last_restored_whole']} whole; saves dropped "
              f"{r['save_dropped']:.0f}, errors {r['save_errors']:.0f}", flush=True)
    print(json.dumps({"profile": args.profile, "capacity_mib": args.capacity_mib, "share": args.share,
                      "bob": args.bob, "fill": args.fill, "prompt_tokens": length, "runs": runs,
                      "bench_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
