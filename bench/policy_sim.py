"""Which states to keep: replay request traces through prefixvault's own admission and store.

    PYTHONPATH=src python bench/policy_sim.py [--models all|name,...] [--workloads chat,...]
        [--policies steps,interval:8192,checkpoints,marconi,reuse,oracle:marconi] [--requests 400]
        [--capacities 0.1,0.3,1,3] [--states 0,0.25] [--scale 256] [--chunk 2048] [--outputs [every|last]]
        [--engine-gb 16] [--jobs 2]

No engine runs. For each model (``bench/model_configs/*.json``: real configs' fields, turned
into bytes and FLOPs by ``prefixvault.geometry``), workload (``policy_traces.py``) and store
capacity, every policy replays the same trace:

1. the prompt is looked up with ``Vault.lookup_explained`` in a real ``LocalStore`` (its
   eviction is the store's own code): the hit is what a consumer would restore;
2. the engine is modelled as vLLM 0.32 in align mode schedules a prefill from the hit: chunks
   of ``--chunk`` tokens ending on block boundaries, a stop at the junction with an earlier
   request's tokens still in the engine's own cache (``--engine-gb`` of KV, LRU) and at the
   prompt's last block boundary; with ``--outputs`` (the connector's ``capture_outputs``)
   decode steps that end on a block boundary (``--outputs last``, the connector's
   ``output_boundaries: last``: only the last of them); the sequence end is the last of these
   (without outputs, the prompt's last block boundary, as the connector marks it);
3. ``prefixvault.admission.Admission`` (the connector's own admission code) picks among those
   candidates; ``Vault.save`` + ``Vault.publish`` store them (KV blocks since the hit, one state
   per boundary, a record), exactly as the connector's save thread does.

Object sizes are the model's real sizes divided by ``--scale`` (so a sweep fits in memory);
capacities are fractions of the trace's KV footprint (every distinct block it computes),
divided by the same scale, so every size relation the store sees is the real one. Figures
are reported at real scale. ``--states`` replays every policy also under the local store's
budget for states (``?states=``, a share of the capacity); such runs are named
``policy@states=share`` and are not part of the goals. ``--stores`` replays them also on a
throwaway valkey-server (``maxmemory`` = the capacity above what an empty server uses):
``redis-lru`` (``allkeys-lru``, lookups TOUCH what they hit) and ``redis-ttl`` (the store's
``ttl``, a day, and ``volatile-ttl``: keys used together expire in the order given), with
``:N`` for the server's ``maxmemory-samples`` (its default, 5, otherwise); such runs are
named ``policy[store]``. ``mooncake`` replays them on a throwaway ``mooncake_master`` and
holder whose segment is the capacity: the master's own eviction (approximate LRU at its high
watermark, on a thread of its own, so the replay leaves it 5 ms before each save and restore),
which sees reads, so a hit is loaded as a consumer would load it (with a lease of 1 s).

Per run: token hit rate (restored / prompt tokens), prefill FLOPs saved (share of all prompt
prefill FLOPs), bytes written, and FLOPs saved per byte written. Goals (checked per model,
workload and capacity, last line JSON): ``reuse`` >= ``marconi`` in hit rate and FLOPs saved
(within 0.5 points, the noise of one eviction), >= 2x the FLOPs saved per byte written of
``steps``; on ``unique``, ``reuse`` writes <= 10% of the bytes ``steps`` writes.

``oracle:P`` (e.g. ``oracle:marconi``) is a ceiling, not a policy an engine can run: it knows
the future. It replays ``P`` once, then again storing only the boundaries ``P``'s lookups
restored, each at its first chance (so it restores at least what ``P`` does, with no bytes
for boundaries nobody restores). With ``oracle:marconi`` in the run, the goals name, for each
cell short of 2x, what this clairvoyant admission reaches there, and list the cells where even
it stays below 2x ("out of reach": a ceiling measured, not proved minimal).

What is not modelled: concurrency (requests run one after another in arrival order), hits from
the engine's own prefix cache (every hit comes from the store), and Marconi's own eviction
(FLOP-aware, in its radix tree): ``marconi`` here is Marconi's admission over the local
store's eviction, which every policy shares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from geometry import ModelGeometry, geometry_from_config
from policy_traces import WORKLOADS, Request

from prefixvault.admission import Admission, Kind
from prefixvault.boundary import SavePlan, max_resume_tokens
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, StateFamily, TensorSpec
from prefixvault.stores import Store, open_store
from prefixvault.stores._directory import StateBudget
from prefixvault.stores.local import LocalStore
from prefixvault.vault import Vault

CONFIGS = Path(__file__).resolve().parent / "model_configs"
POLICIES = ("steps", "interval:8192", "checkpoints", "marconi", "reuse", "oracle:marconi")
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
#: Seconds a replay on Mooncake leaves the master between calls (its eviction runs beside them).
MOONCAKE_PACE = 0.005


@dataclass
class Figures:
    model: str
    workload: str
    policy: str
    capacity: float  # fraction of the trace's KV footprint
    capacity_gb: float
    requests: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    bytes_written: float = 0.0
    states_written: int = 0
    state_share: float = 0.0  # the states' share of the store's space at the end
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def flops_saved_share(self) -> float:
        return self.flops_saved / self.flops_total if self.flops_total else 0.0

    @property
    def flops_per_byte(self) -> float:
        return self.flops_saved / self.bytes_written if self.bytes_written else 0.0


def load_models(names: Sequence[str]) -> dict[str, ModelGeometry]:
    out = {}
    for path in sorted(CONFIGS.glob("*.json")):
        if names and path.stem not in names:
            continue
        out[path.stem] = geometry_from_config(json.loads(path.read_text()), path.stem)
    missing = set(names) - set(out)
    if missing:
        known = sorted(p.stem for p in CONFIGS.glob("*.json"))
        raise SystemExit(f"unknown model(s) {sorted(missing)}; known: {known}")
    return out


def scaled_layout(geo: ModelGeometry, scale: int) -> CacheLayout:
    """One attention group and one state group whose objects weigh the model's, / scale."""
    block = max(16, geo.block_bytes() // scale)
    state = max(16, geo.state_bytes // scale)
    return CacheLayout(geo.name, geo.block_size, (
        CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((block,), "uint8")]),
        CacheGroup.uniform(GroupKind.STATE, [TensorSpec((state,), "uint8")], family=StateFamily.GENERIC),
    ))


def candidates(prompt: int, seq: int, hit: int, junction: int, bs: int, chunk: int, outputs: str
               ) -> dict[int, Kind]:
    """The boundaries where the engine leaves an exact state for this request (see module doc)."""
    out: dict[int, Kind] = {}
    end_ckpt = max_resume_tokens(prompt, bs)  # vLLM's prefill checkpoint: last block before the end
    if end_ckpt > hit:
        out[end_ckpt] = Kind.PROMPT_END | Kind.STEP_END | Kind.CHECKPOINT
    if hit < junction <= end_ckpt:
        out[junction] = out.get(junction, Kind(0)) | Kind.JUNCTION | Kind.STEP_END | Kind.CHECKPOINT
    pos = hit
    while pos < prompt:
        end = min(pos + chunk, prompt)
        for stop in (junction, end_ckpt):
            if pos < stop < end:
                end = stop
        if end < prompt:
            end = max(end // bs * bs, pos + bs)
        if end % bs == 0 and end <= prompt:
            out[end] = out.get(end, Kind(0)) | Kind.STEP_END
        pos = end
    if outputs:  # decode feeds output tokens up to the last but one: states at [prompt+1, seq-1]
        ends = range((prompt // bs + 1) * bs, seq, bs)
        for b in ends[-1:] if outputs == "last" else ends:
            out[b] = out.get(b, Kind(0)) | Kind.OUTPUT
    if out:
        last = max(out)
        out[last] |= Kind.SEQUENCE_END
    return out


@contextlib.contextmanager
def open_sim_store(kind: str, nbytes: int, states: float) -> Iterator[Store]:
    """The store a replay runs on: ``local``, or a throwaway valkey-server (``redis-lru``,
    ``redis-ttl``) whose ``maxmemory`` leaves ``nbytes`` above what it uses empty."""
    if kind == "local":
        with tempfile.TemporaryDirectory(prefix="pv-policy-", dir=SHM) as tmp:
            local = LocalStore(tmp, capacity=nbytes, states=StateBudget(share=states) if states else None)
            try:
                yield local
            finally:
                local.close()
        return
    if kind == "mooncake":
        from prefixvault.scenarios.mooncake import MooncakeCluster

        # A lease protects what a load reads until the load is done (a shorter one fails the
        # read); the replay runs a trace's minutes in seconds, so it lasts 1 s, not 10 s.
        cluster = MooncakeCluster(segment=str(nbytes), master_flags=["--default_kv_lease_ttl=1000"])
        try:
            store = open_store(cluster.uri(timeout="10", prefix="sim/"))
            try:
                yield store
            finally:
                store.close()
        finally:
            cluster.stop()
        return
    import redis

    from prefixvault.scenarios.valkey import Valkey

    name, _, samples = kind.partition(":")
    server = Valkey("--maxmemory-policy", "volatile-ttl" if name == "redis-ttl" else "allkeys-lru",
                    "--maxmemory-samples", samples or "5")
    try:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        empty = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", empty + nbytes)
        store = open_store(server.url(**({"ttl": "86400"} if name == "redis-ttl" else {})))
        try:
            yield store
        finally:
            store.close()
    finally:
        server.stop()


def replay(geo: ModelGeometry, trace: Sequence[Request], policy: str, capacity: float, footprint: int,
           scale: int, chunk: int, outputs: str, workload: str, engine_gb: float,
           states: float = 0.0, store_kind: str = "local") -> Figures:
    """One policy over the trace. ``oracle:P`` knows the future: it first replays ``P``, then
    replays again storing only the boundaries that ``P``'s lookups restored (see module doc)."""
    oracle: set[bytes] | None = None
    if policy.startswith("oracle:"):
        oracle = set()
        _replay(geo, trace, policy.removeprefix("oracle:"), capacity, footprint, scale, chunk, outputs,
                workload, engine_gb, states, store_kind, restored=oracle)
    return _replay(geo, trace, policy, capacity, footprint, scale, chunk, outputs, workload, engine_gb,
                   states, store_kind, oracle=oracle)


def _replay(geo: ModelGeometry, trace: Sequence[Request], policy: str, capacity: float, footprint: int,
            scale: int, chunk: int, outputs: str, workload: str, engine_gb: float,
            states: float = 0.0, store_kind: str = "local", *, restored: set[bytes] | None = None,
            oracle: set[bytes] | None = None) -> Figures:
    """``restored`` collects the boundaries lookups restore; with ``oracle``, only the boundaries
    in it are stored."""
    layout = scaled_layout(geo, scale)
    bs = geo.block_size
    admission = Admission.parse(policy.removeprefix("oracle:"))
    name = f"{policy}@states={states:g}" if states else policy
    if store_kind != "local":
        name += f"[{store_kind}]"
    fig = Figures(geo.name, workload, name, capacity, capacity * footprint / 1e9, len(trace))
    t0 = time.monotonic()
    with open_sim_store(store_kind, max(1 << 20, int(capacity * footprint / scale)), states) as store:
        vault = Vault(store, layout)
        payload = {gi: memoryview(bytes(g.nbytes(0))) for gi, g in enumerate(layout.groups)}
        # The engine's own prefix cache, where vLLM finds junctions: LRU over blocks, as many
        # as ``engine_gb`` of KV holds.
        seen: OrderedDict[bytes, None] = OrderedDict()
        engine_blocks = max(1, int(engine_gb * 1e9 / geo.block_bytes()))
        for req in trace:
            prompt, seq = len(req.prompt), len(req.prompt) + len(req.output)
            computed = req.prompt + req.output[:-1]
            hashes = vault.hashes(computed)
            found = vault.lookup_explained(hashes[: prompt // bs], prompt)
            hit = found.hit
            if hit and store_kind == "mooncake":  # its eviction sees reads: load as a consumer does
                time.sleep(MOONCAKE_PACE)
                if not vault.load(vault.needed(hashes, hit)).ok:  # evicted since the lookup
                    hit = 0
            if hit:
                admission.restored(hashes[hit // bs - 1])
                if restored is not None:
                    restored.add(hashes[hit // bs - 1])
            fig.prompt_tokens += prompt
            fig.hit_tokens += hit
            fig.flops_total += geo.prefill_flops(prompt)
            fig.flops_saved += geo.prefill_flops(hit)
            shared = 0
            while shared < prompt // bs and hashes[shared] in seen:
                seen.move_to_end(hashes[shared])
                shared += 1
            junction = min(shared * bs, max_resume_tokens(prompt, bs))
            admission.arrived(bool(hit or junction))
            last, plans = hit, []
            for b, kinds in sorted(candidates(prompt, seq, hit, junction, bs, chunk, outputs).items()):
                if (admission.admits(kinds, b, last) if oracle is None else hashes[b // bs - 1] in oracle):
                    blocks = tuple((0, i, 1) for i in range(last // bs, b // bs))
                    plans.append((SavePlan(b, blocks, ((1, 1),)), kinds))
                    last = b
            if plans:
                if store_kind == "mooncake":
                    time.sleep(MOONCAKE_PACE)  # the master evicts on a thread of its own
                acks = vault.save(0, hashes, [p for p, _ in plans], lambda ref, _b: payload[ref.group])
                done = vault.publish(hashes, acks, parent=hit)
                for plan, kinds in plans:
                    if done.get(plan.tokens, True) is None:
                        admission.admitted(hashes[plan.tokens // bs - 1], kinds)
                        fig.states_written += 1
            for h in hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > engine_blocks:
                seen.popitem(last=False)
        fig.bytes_written = vault.counters.put_bytes * scale
        if isinstance(store, LocalStore):
            space = store.usage()
            fig.state_share = (store.stats().state_bytes or 0) / max(1, space.slab_bytes + space.inline_bytes)
    fig.seconds = time.monotonic() - t0
    return fig


def kv_footprint(geo: ModelGeometry, trace: Sequence[Request]) -> int:
    """Bytes of every distinct KV block the trace computes (prefix-shared blocks once)."""
    bs = geo.block_size
    seen: set[int] = set()
    for req in trace:
        seq, h = req.prompt + req.output[:-1], 0
        for i in range(len(seq) // bs):
            h = hash((h, seq[i * bs : (i + 1) * bs]))  # a chain, as block hashes are
            seen.add(h)
    return len(seen) * geo.block_bytes()


def _job(args: tuple[ModelGeometry, str, list[str], float, int, int, int, str, int, float, list[float],
                     list[str]]) -> list[Figures]:
    geo, workload, policies, capacity, n, scale, chunk, outputs, seed, engine_gb, shares, kinds = args
    trace = WORKLOADS[workload](n, seed)
    footprint = kv_footprint(geo, trace)
    return [replay(geo, trace, p, capacity, footprint, scale, chunk, outputs, workload, engine_gb,
                   share, kind)
            for kind in kinds for p in policies for share in (shares if kind == "local" else [0.0])]


def goals(figs: list[Figures]) -> dict[str, object]:
    by: dict[tuple[str, str, float], dict[str, Figures]] = {}
    for f in figs:
        by.setdefault((f.model, f.workload, f.capacity), {})[f.policy] = f
    failures = []
    ratios = []
    out_of_reach: list[str] = []
    for (model, workload, cap), row in sorted(by.items()):
        ours, marconi, steps = row.get("reuse"), row.get("marconi"), row.get("steps")
        where = f"{model}/{workload}/{cap:g}"
        if ours and marconi:
            if ours.hit_rate < marconi.hit_rate - 0.005:
                failures.append(f"{where}: hit rate {ours.hit_rate:.3f} < marconi {marconi.hit_rate:.3f}")
            if ours.flops_saved_share < marconi.flops_saved_share - 0.005:
                failures.append(f"{where}: FLOPs saved {ours.flops_saved_share:.3f} < marconi "
                                f"{marconi.flops_saved_share:.3f}")
        if ours and steps:
            if workload == "unique":
                share = ours.bytes_written / steps.bytes_written if steps.bytes_written else 0.0
                ratios.append(("unique_bytes_vs_steps", where, share))
                if share > 0.10:
                    failures.append(f"{where}: writes {share:.1%} of steps' bytes (goal <= 10%)")
            elif steps.flops_per_byte > 0:
                r = ours.flops_per_byte / steps.flops_per_byte
                ratios.append(("flops_per_byte_vs_steps", where, r))
                ceiling = row.get("oracle:marconi")
                c = (ceiling.flops_per_byte / steps.flops_per_byte) if ceiling and ceiling.bytes_written \
                    else None
                if r < 2.0:
                    cut = "" if c is None else f"; oracle:marconi reaches {c:.2f}x"
                    failures.append(f"{where}: FLOPs saved per byte {r:.2f}x steps (goal >= 2x{cut})")
                    if c is not None and c < 2.0:
                        out_of_reach.append(where)
    fpb = [r for k, _, r in ratios if k == "flops_per_byte_vs_steps"]
    uniq = [r for k, _, r in ratios if k == "unique_bytes_vs_steps"]
    return {"goals_met": not failures, "failures": failures,
            "min_flops_per_byte_vs_steps": round(min(fpb), 3) if fpb else None,
            "max_unique_bytes_vs_steps": round(max(uniq), 4) if uniq else None,
            "flops_per_byte_cells": len(fpb), "flops_per_byte_met": sum(r >= 2.0 for r in fpb),
            # cells where even oracle:marconi (clairvoyant: stores only what marconi restored) is below 2x
            "flops_per_byte_out_of_reach": out_of_reach}


def print_table(figs: list[Figures]) -> None:
    last = None
    for f in sorted(figs, key=lambda f: (f.model, f.workload, f.capacity)):
        head = (f.model, f.workload)
        if head != last:
            print(f"\n## {f.model} / {f.workload}  ({f.requests} requests)")
            print(f"{'capacity':>14} {'policy':>22} {'hit rate':>9} {'FLOPs saved':>12} {'written GB':>11} "
                  f"{'states':>7} {'PFLOP/GB':>9} {'state %':>8}")
            last = head
        print(f"{f.capacity:5g} ={f.capacity_gb:6.1f}GB {f.policy:>22} {f.hit_rate:9.3f} "
              f"{f.flops_saved_share:12.3f} {f.bytes_written / 1e9:11.2f} {f.states_written:7d} "
              f"{f.flops_per_byte / 1e6:9.2f} {f.state_share:8.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="all")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--capacities", default="0.1,0.3,1,3", help="fractions of the trace's KV footprint")
    ap.add_argument("--scale", type=int, default=256, help="object sizes are real sizes / scale")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="prefill tokens per step: max_num_batched_tokens (vLLM 0.32's API-server default "
                    "on GPUs under 70 GiB and A100s; 8192 on H100-class, 16384 on the largest)")
    ap.add_argument("--outputs", nargs="?", const="every", default="", choices=["every", "last"],
                    help="boundaries over generated tokens too (the connector's capture_outputs): "
                    "every one, or only the last before the request finishes")
    ap.add_argument("--engine-gb", type=float, default=16.0,
                    help="KV the engine's own prefix cache holds (where vLLM finds junctions)")
    ap.add_argument("--states", default="0",
                    help="budgets for states to replay under, as shares of the capacity (0: none)")
    ap.add_argument("--stores", default="local",
                    help="stores to replay on: local, redis-lru[:N], redis-ttl[:N] (a throwaway "
                    "valkey-server; N: its maxmemory-samples), mooncake (a throwaway master and holder)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    models = load_models([] if args.models == "all" else args.models.split(","))
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {sorted(WORKLOADS)}")
    policies = args.policies.split(",")
    for p in policies:
        Admission.parse(p.removeprefix("oracle:"))
    caps = [float(c) for c in args.capacities.split(",")]
    shares = [float(x) for x in args.states.split(",")]
    if any(not 0.0 <= x <= 1.0 for x in shares):
        raise SystemExit("--states: shares of the capacity between 0 and 1")
    kinds = args.stores.split(",")
    for kind in kinds:
        name, _, samples = kind.partition(":")
        if kind != "mooncake" and (name not in ("local", "redis-lru", "redis-ttl")
                                   or (samples and not samples.isdigit())):
            raise SystemExit(f"--stores: local, redis-lru[:samples], redis-ttl[:samples] or mooncake, "
                             f"not {kind!r}")
    jobs = [(geo, w, policies, c, args.requests, args.scale, args.chunk, args.outputs, args.seed,
             args.engine_gb, shares, kinds) for geo in models.values() for w in workloads for c in caps]
    t0 = time.monotonic()
    figs: list[Figures] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done in pool.map(_job, jobs):
            figs.extend(done)
    print_table(figs)
    for name, geo in models.items():
        print(f"# {name}: block {geo.block_size} tokens = {geo.block_bytes() / 2**20:.1f} MiB of KV, "
              f"state {geo.state_bytes / 2**20:.1f} MiB "
              f"(= {geo.state_tokens_equivalent():.0f} tokens of KV), "
              f"{geo.active_params / 1e9:.2f}B active parameters")
    summary = goals(figs)
    summary.update(seconds=round(time.monotonic() - t0, 1), requests=args.requests, scale=args.scale,
                   states=shares,
                   chunk=args.chunk, outputs=args.outputs, engine_gb=args.engine_gb,
                   runs=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(f).items()}
                         | {"hit_rate": round(f.hit_rate, 4),
                            "flops_saved_share": round(f.flops_saved_share, 4)}
                         for f in figs])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
