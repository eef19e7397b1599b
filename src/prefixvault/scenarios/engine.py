"""Run one vLLM engine in its own process and report greedy tokens and logprobs.

Cold, producer and consumer engines of the seed scenario must be separate processes (the
report's protocol), and vLLM needs a ``__main__`` guard, so every engine runs as
``python -m prefixvault.scenarios.engine SPEC.json OUT.json``: a fresh process, or, after
``use_engine_hosts``, a fork of a warm host that imported vLLM once (scenarios.enginehost).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixvault.scenarios.enginehost import EngineHost, HostGone, finish

CONNECTOR = "PrefixVaultConnector"
CONNECTOR_MODULE = "prefixvault.vllm"


@dataclass
class EngineSpec:
    """One engine run: a model, engine arguments, an optional connector, and prompts."""

    model: str
    engine: dict[str, Any]
    prompts: list[list[int]]
    role: str = "cold"  # cold (no connector), kv_producer, kv_consumer, kv_both
    store: str = ""
    extra_config: dict[str, Any] = field(default_factory=dict)
    connector: str = CONNECTOR
    connector_module: str = CONNECTOR_MODULE
    max_tokens: int = 8
    logprobs: int = 5
    sequential: bool = True  # one request at a time (True) or all at once (False)
    salts: list[str] = field(default_factory=list)  # cache_salt per prompt ("" for none)
    ignore_eos: bool = False  # generate max_tokens whatever the model says
    # A conversation: ``prompts`` are its messages, and turn n's prompt is turn n-1's prompt,
    # the token ids it generated, then message n (token ids: no chat template in the way).
    conversation: bool = False


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated token: top-k token id -> logprob
    cached_tokens: int  # prompt tokens vLLM did not compute (local + external hits)
    text: str = ""


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """The connector's config for a scenario's engine: every hit restored (``restore_when:
    always``) unless the spec says otherwise, since a scenario checks what a restore does
    (bench/serving.py measures whether it pays)."""
    if spec.role == "cold":
        return None
    return {
        "kv_connector": spec.connector,
        "kv_connector_module_path": spec.connector_module,
        "kv_role": spec.role,
        "kv_connector_extra_config": {"store": spec.store, "restore_when": "always", **spec.extra_config},
    }


def _run(spec: EngineSpec) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs = dict(spec.engine, model=spec.model)
    ktc = kv_transfer_config(spec)
    if ktc is not None:
        kwargs["kv_transfer_config"] = ktc
        kwargs.setdefault("disable_log_stats", False)  # the connector's counters reach Prometheus
        # Saves still queued when the engine stops are stored first (vLLM's default, 0, kills
        # an engine-core process at once).
        kwargs.setdefault("shutdown_timeout", 30)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    started = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, logprobs=spec.logprobs,
                            ignore_eos=spec.ignore_eos)
    config = llm.llm_engine.vllm_config
    if spec.conversation:
        return {"completions": conversation(llm, spec.prompts, params), "start_s": started,
                "block_size": int(config.cache_config.block_size),
                "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
                "metrics": connector_metrics(llm), "requests_kept": requests_kept(llm)}
    salts = spec.salts or [""] * len(spec.prompts)
    inputs: list[dict[str, Any]] = [
        {"prompt_token_ids": p, **({"cache_salt": s} if s else {})}
        for p, s in zip(spec.prompts, salts, strict=True)
    ]
    batches = [[i] for i in inputs] if spec.sequential else [inputs]
    outs: list[dict[str, Any]] = []
    ttfts: list[float] = []
    for batch in batches:
        t = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        ttfts.append(time.perf_counter() - t)
        outs.extend(asdict(completion_of(r)) for r in results)
    return {
        "completions": outs,
        "start_s": started,
        "generate_s": ttfts,
        "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        "max_num_batched_tokens": int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens),
        "metrics": connector_metrics(llm),
    }


def conversation(llm: Any, messages: list[list[int]], params: Any) -> list[dict[str, Any]]:
    """Each turn's prompt is the previous prompt, its generated ids, then the next message."""
    outs: list[dict[str, Any]] = []
    prompt: list[int] = []
    for message in messages:
        prompt = [*prompt, *(outs[-1]["token_ids"] if outs else []), *message]
        result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        outs.append({**asdict(completion_of(result)), "prompt_tokens": len(prompt)})
    return outs


def requests_kept(llm: Any) -> int | None:
    """Requests an in-process engine's scheduler still holds, finished ones whose blocks a
    connector asked it to keep included; None for an engine core in its own process."""
    scheduler = getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
    return None if scheduler is None else len(scheduler.requests)


def completion_of(result: Any) -> Completion:
    """A finished ``vllm.RequestOutput`` as a Completion."""
    c = result.outputs[0]
    lps = [{int(k): float(v.logprob) for k, v in d.items()} for d in (c.logprobs or [])]
    return Completion(list(c.token_ids), lps, int(result.num_cached_tokens or 0), c.text)


def connector_metrics(llm: Any) -> dict[str, float]:
    """prefixvault's Prometheus counters as the engine reports them (empty without stats)."""
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:
        return out
    for m in metrics:
        name = getattr(m, "name", "")
        if name == "vllm:num_preemptions" and hasattr(m, "value"):
            out["preemptions"] = out.get("preemptions", 0.0) + float(m.value)
        if name.startswith("vllm:prefixvault_") and hasattr(m, "value"):
            labels = getattr(m, "labels", {}) or {}
            key = name.removeprefix("vllm:prefixvault_")
            for label in ("lane", "reason"):  # the connector's own labels, in its key order
                if label in labels:
                    key = f"{key}:{labels[label]}"
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


#: Engine hosts started (see scenarios.enginehost), least recently used first; None: every run
#: starts a fresh process. Guarded by _hosts_lock: engines are started from several threads.
_hosts: list[EngineHost] | None = None
_hosts_dir: Path | None = None
_hosts_lock = threading.Lock()
#: Environments whose host could not start: they run fresh processes, without trying again.
_hosts_failed: set[str] = set()
#: Hosts alive at once (each holds its own copy of torch and vLLM); the least recently used
#: one makes way for a new environment.
MAX_HOSTS = 2


def use_engine_hosts(workdir: Path) -> None:
    """From now on, run engines as forks of warm hosts (one per distinct environment)."""
    global _hosts, _hosts_dir
    with _hosts_lock:
        _hosts, _hosts_dir = [], workdir


def stop_engine_hosts() -> None:
    global _hosts
    with _hosts_lock:
        hosts, _hosts = _hosts or [], None
    for host in hosts:
        host.stop()


def _host_for(env: dict[str, str]) -> EngineHost | None:
    """A running host that accepts ``env`` (started if need be), or None."""
    global _hosts
    with _hosts_lock:
        if _hosts is None or _hosts_dir is None:
            return None
        host = next((h for h in _hosts if h.accepts(env)), None)
        if host is not None:
            _hosts.remove(host)
            _hosts.append(host)  # most recently used last
            return host
        key = json.dumps(sorted(env.items()))
        if key in _hosts_failed:
            return None
        try:
            host = EngineHost(env, _hosts_dir)
        except HostGone as e:
            _hosts_failed.add(key)
            print(f"prefixvault: engines run as fresh processes for this environment: {e}", file=sys.stderr)
            return None
        _hosts.append(host)
        old = _hosts[:-MAX_HOSTS]
        _hosts = _hosts[-MAX_HOSTS:]
    for h in old:
        h.stop()  # a run it still serves goes on: its waiter does not need the host
    return host


def _run_in_host(env: dict[str, str], module: str, argv: list[str], log_path: Path, timeout: float
                 ) -> int | None:
    """The run's exit code from a host that accepts ``env``; None where no host can take it."""
    host = _host_for(env)
    if host is None:
        return None
    try:
        return host.run(module, argv, log_path, timeout, env)
    except HostGone:
        with _hosts_lock:
            if _hosts is not None and host in _hosts:
                _hosts.remove(host)
        host.stop()
        return None


def run_engine(
    spec: EngineSpec, workdir: Path, env: Mapping[str, str] | None = None, timeout: float = 900,
    module: str = "prefixvault.scenarios.engine", extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh process; raise RuntimeError with the log tail if it fails.

    ``module`` is the runner (``python -m MODULE SPEC.json OUT.json``); ``extra`` adds
    fields of its own to the spec file.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = f"{spec.role}-{time.monotonic_ns()}"
    spec_path, out_path, log_path = (workdir / f"{stamp}.{s}" for s in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps({**asdict(spec), **(extra or {})}))
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    rc = _run_in_host(full_env, module, [str(spec_path), str(out_path)], log_path, timeout)
    if rc is None:
        with open(log_path, "w") as log:
            rc = subprocess.run(
                [sys.executable, "-m", module, str(spec_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                timeout=timeout,
                check=False,
            ).returncode
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else "(no log)"
        cause = last_error(tail)
        raise RuntimeError(f"engine ({spec.role}) exited with {rc}{': ' + cause if cause else ''}; "
                           f"log {log_path}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = str(log_path)
    return result


def completions(result: Mapping[str, Any]) -> list[Completion]:
    return [
        Completion(
            c["token_ids"],
            [{int(k): v for k, v in d.items()} for d in c["logprobs"]],
            c["cached_tokens"],
            c.get("text", ""),
        )
        for c in result["completions"]
    ]


def max_logprob_diff(a: Completion, b: Completion) -> float:
    """Largest |Δlogprob| over the top-k tokens both runs report at each step."""
    worst = 0.0
    for x, y in zip(a.logprobs, b.logprobs, strict=False):
        for tok in x.keys() & y.keys():
            worst = max(worst, abs(x[tok] - y[tok]))
    return worst


@dataclass(frozen=True)
class Divergence:
    """Where two greedy completions of one prompt part, and how close ``a`` was to ``b``'s pick."""

    at: int  # first generated position whose ids differ (the common length if none does)
    drift: float  # largest |Δlogprob| over the top-k tokens both report, up to and including ``at``
    margin: float | None  # at ``at``: a's logprob of its pick minus a's of b's (inf: unranked or
    #                       one completion ends there); None where they do not part


def divergence(a: Completion, b: Completion) -> Divergence:
    """How ``b`` departs from ``a``. Both distributions at ``at`` follow the same ids, so ``drift``
    counts it too. A last-bit difference shows as a small drift and, where the ids part, a small
    margin (a near tie in ``a``). A wrong state need not show larger on a random test model
    (tests/test_vllm_concurrency.py says how much)."""
    at = common_prefix(a.token_ids, b.token_ids)
    seen = min(at + 1, len(a.logprobs), len(b.logprobs))
    drift = max_logprob_diff(Completion([], a.logprobs[:seen], 0), Completion([], b.logprobs[:seen], 0))
    if len(a.token_ids) == len(b.token_ids) == at:
        return Divergence(at, drift, None)
    margin = math.inf
    if at < min(len(a.token_ids), len(b.token_ids)) and at < len(a.logprobs):
        mine, theirs = a.logprobs[at].get(a.token_ids[at]), a.logprobs[at].get(b.token_ids[at])
        if mine is not None and theirs is not None:
            margin = mine - theirs
    return Divergence(at, drift, margin)


def last_error(log: str) -> str:
    """The last exception line of an engine's log (``ValueError: ...``, vLLM's rank prefix
    dropped), or "": what a user reads first when an engine does not start."""
    for line in reversed(log.splitlines()):
        text = line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line
        head = text.split(":", 1)[0].strip()
        named = bool(head) and all(part.isidentifier() for part in head.split("."))
        if ":" in text and named and head.endswith(("Error", "Exception")):
            return text.strip()[:300]
    return ""


def identical(a: Completion, b: Completion) -> bool:
    """Same token ids and the same top-k logprobs, bit for bit."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main(argv: Sequence[str]) -> None:
    spec = EngineSpec(**json.loads(Path(argv[0]).read_text()))
    result = _run(spec)
    Path(argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
    finish(0)  # a fresh process too: its output is written, its teardown would only cost time
