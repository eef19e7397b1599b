"""Serving with prefixvault against serving without it, measured by vLLM's own benchmark client.

    python bench/serving.py [--profile gdn-hybrid] [--layers N] [--store local|redis|mooncake]
                            [--redis-delay-ms 20] [--mooncake-delay-ms 20]
                            [--restore-when faster|always]
                            [--prompts 32] [--concurrency 8] [--request-rate inf]
                            [--prefix 2048] [--suffix 512]

OpenAI servers as operators start them (``prefixvault serve`` for the connector; the cold
server is plain vLLM with its own prefix cache): a producer fills the store with the workload,
then a cold server and a consumer server each serve the same requests, one after the other.
The cold server then serves the same requests a second time: ``local``, every prefix a hit in
vLLM's own prefix cache, what a restore is measured against (restored TTFT / local-hit TTFT).
Workload: vLLM's ``prefix_repetition`` dataset (shared prefixes, random suffixes), greedy,
``--ignore-eos``, at most ``--concurrency`` requests in flight, arriving all at once or, with
``--request-rate R``, at random at R a second. ``--store redis`` puts a Valkey
server behind a loopback proxy that adds ``--redis-delay-ms`` to every round trip; ``--store
mooncake`` a Mooncake cluster (``mooncake_master`` and a holder of 2 GiB, engines mounting
nothing) whose master is behind such a proxy adding ``--mooncake-delay-ms``.
``--connector-path OTHER/src`` makes the servers import prefixvault from another checkout, to
measure a version before a change with the same client and workload.

Prints, for cold, local, producer and consumer: mean and p99 TTFT, p50 and p99 ITL, output
throughput, mean TTFT after the first wave of ``--concurrency`` requests (cold's own prefix cache
is warm by then), completed and failed requests, the consumer's external hit tokens, whether every
generated text equals cold's, and which part from cold's, the consumer's beside the producer's
(which restores nothing: where its texts part too, batching did it); then the ratios
consumer/cold (what restoring gains and costs), consumer/local (a restore against a hit in the
engine's own cache: TTFT, after the first wave too, and ITL p99, which the own cache's faster
first tokens also raise above cold's) and producer/cold (what saving costs: the producer
computes everything, as cold does, and stores it); and the consumer's bytes read from the
store over one copy of every object it restored (``store_reads_per_copy``: about 1 with the hot
set of recent loads; a shared prefix's blocks read once per request without it) and the share
of restored bytes the hot set served (``hot_share``); and the consumer's lookups, loads (and
how many were synchronous: their bytes read ahead and handed to the worker), what
``restore_when`` judged and its misses by reason; and what the connector adds to each engine
step on the scheduler's thread and the engine's (``scheduler_us``, ``worker_step_us`` over
``scheduler_steps``), and the consumer's scheduler-side time per lookup (all of it, over its
lookups: misses and the other calls included).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.servers import (
    add_workload_args,
    benchmark,
    metric,
    metric_by_label,
    prefix_repetition,
    server,
)
from prefixvault.serve import engine_flags, serve_command, vllm_command

FIGURES = ("mean_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")
#: Mean TTFT of the requests after the first ``--concurrency`` (in the workload's order): by then
#: cold's own prefix cache holds every shared prefix, so this is what the store costs or gains
#: against a warm server, apart from the first wave, where cold computes every prefix.
WARM = "mean_ttft_after_first_wave_ms"
COLUMNS = (*FIGURES, WARM)
GOALS = {"p99_itl_ms": 1.1, "mean_ttft_ms": 0.5}  # consumer/cold at most


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_model(args.profile, work / "models" / f"{args.profile}-{args.layers or 'default'}", seed=0,
                        layers=args.layers)
    engine = engine_kwargs(args.profile, model)
    engine.pop("model")
    engine.pop("tokenizer", None)
    engine["max_num_batched_tokens"] = args.batched
    flags = engine_flags(engine)  # --block-size included: the same for every server
    load = prefix_repetition(args.prefix, args.suffix, args.prefixes, args.output, args.prompts,
                             args.concurrency, args.seed, args.request_rate)
    name = str(model)
    cleanup: list[Any] = []
    if args.store == "redis":
        from prefixvault.scenarios.netfault import SlowLink
        from prefixvault.scenarios.valkey import Valkey

        valkey = Valkey()
        link = SlowLink(valkey.port, args.redis_delay_ms / 1000)
        cleanup += [link.close, valkey.stop]
        store = f"redis://127.0.0.1:{link.port}/0?prefix=bench:&timeout=5"
    elif args.store == "mooncake":
        from prefixvault.scenarios.mooncake import MooncakeCluster
        from prefixvault.scenarios.netfault import SlowLink

        cluster = MooncakeCluster(segment="2GiB", logs=work / "mooncake")
        link = SlowLink(cluster.rpc_port, args.mooncake_delay_ms / 1000)
        cleanup += [link.close, cluster.stop]
        store = f"mooncake://127.0.0.1:{link.port}?admin=127.0.0.1:{cluster.admin_port}&prefix=bench/&timeout=5"
    else:
        store = f"local://{work}/store?capacity=4GiB"

    # vLLM CPU reserves one more core for a KV connector than for a server without one; on a
    # small machine the servers then run their forward on different numbers of OpenMP threads
    # (other sums: logprobs apart in the last bits, texts apart with them; other speed). Every
    # server here reserves the same one core. (No effect on GPU servers.)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}
    if args.connector_path:
        env["PYTHONPATH"] = args.connector_path

    saves: dict[str, float] = {}

    loads: dict[str, float] = {}
    judged: dict[str, float] = {}  # the consumer's restore_judgments, by judgment
    misses: dict[str, float] = {}  # its lookup_misses, by reason
    estimates: dict[str, float] = {}  # its cost estimates at the end (``costs``): where a restore's time goes
    second: dict[str, Any] = {}

    spent: dict[str, dict[str, float]] = {}  # the connector's time in the steps, by server

    def serve(tag: str, command: list[str], again: bool = False) -> tuple[dict[str, Any], float]:
        with server(command, work / f"{tag}-server.log", env=env) as url:
            result = benchmark(url, name, work / f"{tag}.json", load)
            hits = metric(url, "vllm:external_prefix_cache_hits_total")
            if tag in ("producer", "consumer"):
                spent[tag] = {k: metric(url, f"vllm:prefixvault_{k}_total")
                              for k in ("scheduler_us", "worker_step_us", "scheduler_steps")}
            if tag == "producer":  # what the saves came to (counters of the version measured)
                for k in ("records_published", "save_dropped", "save_errors"):
                    saves[k] = metric(url, f"vllm:prefixvault_{k}_total")
            if tag == "consumer":
                for k in ("get_bytes", "hot_bytes", "reread_bytes", "loads", "loads_in_step", "lookups"):
                    loads[k] = metric(url, f"vllm:prefixvault_{k}_total")
                judged.update(metric_by_label(url, "vllm:prefixvault_restore_judgments_total", "judgment"))
                for k in ("compute_us_per_token", "lookup_us", "restore_us", "restore_in_step_us", "step_us",
                          "load_bytes_per_s", "load_in_step_bytes_per_s"):
                    estimates[k] = metric(url, f"vllm:prefixvault_estimate_{k}")
                misses.update(metric_by_label(url, "vllm:prefixvault_lookup_misses_total", "reason"))
            if again:  # the same requests once more: each prefix a hit in the engine's own cache
                second.update(benchmark(url, name, work / f"{tag}-again.json", load))
        print(f"  {tag} done", flush=True)
        return result, hits

    try:
        producer, _ = serve("producer", serve_command(name, store, "kv_producer", extra=flags))
        cold, _ = serve("cold", [*vllm_command(name), *flags, "--enable-prefix-caching",
                                 "--mamba-cache-mode", "align"], again=True)
        consumer, hits = serve("consumer", serve_command(name, store, "kv_consumer", extra=flags,
                                                         restore_when=args.restore_when))
    finally:
        for close in cleanup:
            close()
    out: dict[str, Any] = {"profile": args.profile, "layers": args.layers, "store": args.store,
                           "redis_delay_ms": args.redis_delay_ms if args.store == "redis" else None,
                           "mooncake_delay_ms": args.mooncake_delay_ms if args.store == "mooncake" else None,
                           "restore_when": args.restore_when or "faster", "prompts": args.prompts,
                           "concurrency": args.concurrency,
                           "request_rate": None if math.isinf(args.request_rate) else args.request_rate}
    for tag, res in (("cold", cold), ("local", second), ("producer", producer), ("consumer", consumer)):
        out[tag] = {k: round(float(res.get(k, 0.0)), 3) for k in FIGURES}
        # (a failed request's TTFT reads 0: left out)
        later = [float(t) for t in res.get("ttfts", [])[args.concurrency:] if t]
        out[tag][WARM] = round(1000 * sum(later) / len(later), 3) if later else 0.0
        out[tag]["completed"] = int(res.get("completed", 0))
        out[tag]["failed"] = int(res.get("failed", 0))
    out["consumer"]["external_hit_tokens"] = hits
    out["consumer"]["loads"] = loads.get("loads", 0.0)
    out["consumer"]["loads_synchronous"] = loads.get("loads_in_step", 0.0)  # (their bytes handed over)
    out["consumer"]["estimates"] = estimates
    out["consumer"]["lookups"] = loads.get("lookups", 0.0)
    out["consumer"]["judged"] = judged  # (empty for a version before restore_when)
    out["consumer"]["misses"] = misses
    # Bytes read from the store over one copy of every object restored (objects read again
    # are what a hot set saves: a shared prefix's blocks, restored by each of its requests).
    got, again = loads.get("get_bytes", 0.0), loads.get("reread_bytes", 0.0)
    out["consumer"]["store_reads_per_copy"] = round(got / (got - again), 2) if got > again else None
    hot = loads.get("hot_bytes", 0.0)
    out["consumer"]["hot_share"] = round(hot / (got + hot), 3) if got else None
    # (ITL too: a server whose requests reach their decode sooner runs more of them beside the
    # others' prefill steps, so its ITL p99 is above cold's with no restore at all; the engine's
    # own cache shows how far)
    out["vs_local"] = {k: round(out["consumer"][k] / out["local"][k], 3) if out["local"][k] else None
                       for k in ("mean_ttft_ms", "p99_ttft_ms", "p99_itl_ms", WARM)}
    for tag, figures in spent.items():  # the connector's microseconds per engine step, each side's thread
        steps = figures["scheduler_steps"]  # (0: a version before these figures, --connector-path)
        out[tag]["connector_us_per_step"] = {
            "scheduler": round(figures["scheduler_us"] / steps) if steps else None,
            "worker": round(figures["worker_step_us"] / steps) if steps else None}
    lookups, counted = out["consumer"]["lookups"], spent["consumer"]["scheduler_steps"]
    out["consumer"]["scheduler_us_per_lookup"] = (round(spent["consumer"]["scheduler_us"] / lookups)
                                                  if lookups and counted else None)
    out["producer"].update(saves)  # counted until its requests were done (queued saves drain after)
    out["ratios"] = {k: round(out["consumer"][k] / out["cold"][k], 3) if out["cold"][k] else None
                     for k in COLUMNS}
    out["producer_ratios"] = {k: round(out["producer"][k] / out["cold"][k], 3) if out["cold"][k] else None
                              for k in COLUMNS}
    # Which requests' texts part from cold's: the producer restores nothing, so where its text
    # parts too, the engine's batching did it (vLLM CPU is not batch-invariant); a consumer text
    # that parts where the producer's does not is the one to look at.
    out["texts_differ"] = {"consumer": _differ(cold, consumer), "producer": _differ(cold, producer)}
    out["texts_equal"] = not out["texts_differ"]["consumer"]
    out["producer_texts_equal"] = not out["texts_differ"]["producer"]
    out["texts_differ_only_consumer"] = sorted(set(out["texts_differ"]["consumer"])
                                               - set(out["texts_differ"]["producer"]))
    out["goals"] = GOALS
    out["goals_met"] = all(out["ratios"][k] is not None and out["ratios"][k] <= v for k, v in GOALS.items()) \
        and out["consumer"]["failed"] == 0
    return out


def _differ(cold: dict[str, Any], other: dict[str, Any]) -> list[int]:
    """Indexes of the requests whose generated text is not cold's."""
    return [i for i, (a, b) in enumerate(zip(cold["generated_texts"], other["generated_texts"], strict=True))
            if a != b]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="gdn-hybrid")
    p.add_argument("--store", choices=["local", "redis", "mooncake"], default="local")
    p.add_argument("--redis-delay-ms", type=float, default=20.0)
    p.add_argument("--mooncake-delay-ms", type=float, default=20.0,
                   help="added to every call to mooncake_master (its transfers go straight to the holder)")
    p.add_argument("--layers", type=int, default=None,
                   help="repeat the profile's layer pattern to this many layers (a deeper model, whose "
                        "prefill costs more per restored byte, as a real model's does)")
    add_workload_args(p)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (vLLM CPU)")
    p.add_argument("--restore-when", choices=["", "faster", "always"], default="",
                   help="the consumer's restore_when (empty: the connector's default)")
    p.add_argument("--connector-path", default="",
                   help="a checkout's src/ the servers import prefixvault from (another version)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="prefixvault-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    out = run(args, work)
    names = [*FIGURES, "ttft_after_wave1_ms"]
    print(f"{'':10}" + "".join(f"{k:>20}" for k in names))
    for tag in ("cold", "local", "producer", "consumer"):
        print(f"{tag:10}" + "".join(f"{out[tag][k]:>20.2f}" for k in COLUMNS))
    print(f"{'cons/cold':10}" + "".join(f"{out['ratios'][k] or 0:>20.3f}" for k in COLUMNS))
    print(f"{'prod/cold':10}" + "".join(f"{out['producer_ratios'][k] or 0:>20.3f}" for k in COLUMNS))
    c, vs = out["consumer"], out["vs_local"]
    print(f"restored / local-hit TTFT: mean {vs['mean_ttft_ms']}, p99 {vs['p99_ttft_ms']}, "
          f"after the first wave {vs[WARM]}; ITL p99 {vs['p99_itl_ms']}; consumer "
          f"store bytes read / one copy of each object: {c['store_reads_per_copy']}, "
          f"from the hot set: {c['hot_share']}")
    print(f"completed {c['completed']}/{args.prompts}, failed {c['failed']}, "
          f"external hit tokens {c['external_hit_tokens']:.0f}, texts equal {out['texts_equal']}")
    print(f"consumer: {c['lookups']:.0f} lookups, {c['loads']:.0f} loads ({c['loads_synchronous']:.0f} "
          f"synchronous); judged {c['judged']}; misses {c['misses']}")
    print(f"connector's time per engine step (microseconds, scheduler / worker thread): consumer "
          f"{c['connector_us_per_step']}, producer {out['producer']['connector_us_per_step']}; consumer's "
          f"scheduler-side time per lookup {c['scheduler_us_per_lookup']}")
    differ = out["texts_differ"]
    print(f"texts apart from cold: consumer {differ['consumer']}, producer (restores nothing) "
          f"{differ['producer']}; consumer only {out['texts_differ_only_consumer']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
