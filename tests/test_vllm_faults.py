"""Faults around real vLLM engines: bad bytes, a producer killed mid-save, concurrent consumers.

Whatever happens, every consumer request completes with output identical to cold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from vllm_support.seedlib import IN_PROCESS, SUPPORT, Seed, SeedRuns, run, run_with_metrics, spec

from prefixvault.codec import HEADER_SIZE, _parse, decode, encode
from prefixvault.inventory import audit
from prefixvault.layout import CacheLayout
from prefixvault.scenarios.engine import Completion, identical
from prefixvault.stores import open_store
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seed(seed_runs: SeedRuns) -> Seed:
    return seed_runs.seed("gdn-hybrid")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cold(seed: Seed, seed_runs: SeedRuns) -> list[Completion]:
    return seed_runs.cold(seed, [c.tokens for c in seed.cases])


def test_corrupt_state_object_is_rejected_and_the_request_recomputes(
    seed: Seed, cold: list[Completion], workdir: Path
) -> None:
    store_uri = f"local://{workdir}/corrupt?capacity=1GiB"
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store_uri), workdir)
    store = open_store(store_uri)
    states = [k for k, _ in store.scan() if "/s/" in k]
    assert states
    for key in states:  # flip one payload byte of every stored state
        blob = bytearray(store.get_many([key])[0] or b"")
        blob[HEADER_SIZE + 7] ^= 0x10
        assert store.put_many([(key, [bytes(blob)])]) == [True]
    case = seed.cases[1]  # would restore 1536
    got = run(seed, spec(seed, "kv_consumer", [case.tokens], [""], store_uri), workdir)
    assert identical(cold[1], got[0])
    remaining = {k for k, _ in store.scan() if "/s/" in k}
    assert len(remaining) < len(states), "the rejected state object was not removed"


def test_producer_killed_mid_save_leaves_no_partial_record(
    seed: Seed, cold: list[Completion], workdir: Path
) -> None:
    store_uri = f"local://{workdir}/killed?capacity=1GiB"
    store = open_store(store_uri)
    producer = spec(seed, "kv_producer", [seed.producer] * 6, [f"run-{i}" for i in range(6)], store_uri)
    spec_path = workdir / "killed-spec.json"
    spec_path.write_text(json.dumps(asdict(producer)))
    env = {**os.environ, **IN_PROCESS, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": SUPPORT}
    proc = subprocess.Popen([sys.executable, "-m", "prefixvault.scenarios.engine", str(spec_path),
                             str(workdir / "killed-out.json")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:  # kill it as soon as it has published something, while it is still saving more
        while time.monotonic() < deadline and proc.poll() is None:
            if any("/r/" in k for k, _ in store.scan()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the producer finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    report = audit(store)
    assert report.records >= 1
    assert not report.findings, report.findings
    case = seed.cases[1]
    got = run(seed, spec(seed, "kv_consumer", [case.tokens], ["run-0"], store_uri), workdir)
    assert identical(cold[1], got[0])


@pytest.fixture(scope="module")
def shared(seed: Seed, workdir: Path) -> str:
    """A store the producer filled, shared by the tests below (they only read it)."""
    store_uri = f"local://{workdir}/shared?capacity=1GiB"
    run(seed, spec(seed, "kv_producer", [seed.producer], [""], store_uri), workdir)
    return store_uri


@pytest.mark.parametrize(("fault", "in_step"), [("handed", True), ("removed", False), ("state", False)])
def test_a_fault_between_lookup_and_load_costs_a_hit_never_a_byte_or_the_engine(
        fault: str, in_step: bool, seed: Seed, cold: list[Completion], workdir: Path, shared: str) -> None:
    """Between a restore's lookup and its load (``tampering_connector``): the bytes handed to the
    worker for a synchronous load changed after the hand-over (each refused by the worker's
    verification, read from the store: restored in the step all the same), or every object of
    an asynchronous load removed from the store (the load fails, vLLM recomputes: a miss), or
    only the state at its boundary (the load fails; looked up again no deeper than that state,
    the request restores the producer's boundary before it). The engine serves on, and the
    output is cold's, token for token and logprob for logprob (cold's steps end at every
    boundary the producer published)."""
    store_uri = shared if fault == "handed" else f"local://{workdir}/{fault}?capacity=1GiB"
    if fault != "handed":
        run(seed, spec(seed, "kv_producer", [seed.producer], [""], store_uri), workdir)
    case = seed.cases[1]
    got, metrics = run_with_metrics(
        seed, spec(seed, "kv_consumer", [case.tokens], [""], store_uri, connector="TamperingConnector",
                   connector_module="tampering_connector", extra_config={"restore_in_step": in_step}),
        workdir / f"tamper-{fault}", env={"PREFIXVAULT_TAMPER": fault})
    assert identical(cold[1], got[0]), f"{fault}: differs from cold"
    rejected = sum(v for k, v in metrics.items() if k.startswith("rejected:"))
    if fault == "handed":
        assert got[0].cached_tokens == case.expected_hit > 0, metrics
        assert metrics.get("loads_in_step", 0) >= 1 and metrics.get("loads_in_step_read", 0) >= 1, metrics
        assert rejected >= 1 and metrics.get("load_failures", 0) == 0, metrics
    elif fault == "removed":
        assert metrics.get("load_failures:missing", 0) >= 1, metrics
        assert got[0].cached_tokens < case.expected_hit, metrics
    else:
        assert metrics.get("load_failures:missing", 0) == 1, metrics
        assert 0 < got[0].cached_tokens < case.expected_hit, metrics


@pytest.mark.parametrize("fault", ["shm_full", "mailbox_gone"])
def test_losing_the_in_step_path_costs_one_step_never_a_byte_or_the_engine(
        fault: str, seed: Seed, cold: list[Completion], workdir: Path, shared: str) -> None:
    """With vLLM's multiprocessing executor (as its CPU servers run), a synchronous load's bytes
    go to the worker through shared memory: when shared memory cannot take them (full), or the
    worker's mailbox directory is removed under a running engine, the restore loads one step
    later instead. The engine serves on, restores the whole hit, the output is cold's, and the
    loss is counted (``in_step_lost{reason}``)."""
    case = seed.cases[1]
    engine_spec = spec(seed, "kv_consumer", [case.tokens], [""], shared, connector="TamperingConnector",
                       connector_module="tampering_connector", extra_config={"restore_in_step": True})
    engine_spec = replace(engine_spec, engine={**engine_spec.engine, "distributed_executor_backend": "mp"})
    got, metrics = run_with_metrics(seed, engine_spec, workdir / f"lost-{fault}",
                                    env={"PREFIXVAULT_TAMPER": fault})
    assert identical(cold[1], got[0]), f"{fault}: differs from cold"
    assert got[0].cached_tokens == case.expected_hit > 0, metrics
    reason = "handover_failed" if fault == "shm_full" else "mailbox_gone"
    assert metrics.get(f"in_step_lost:{reason}", 0) >= 1, metrics
    assert metrics.get("loads_in_step", 0) == 0 and metrics.get("load_failures", 0) == 0, metrics


def test_two_consumer_engines_at_once(seed: Seed, cold: list[Completion], workdir: Path, shared: str) -> None:
    store_uri = shared
    picks = [0, 1]

    def consume(i: int) -> tuple[Completion, dict[str, float]]:
        case = seed.cases[i]
        got, metrics = run_with_metrics(seed, spec(seed, "kv_consumer", [case.tokens], [""], store_uri),
                                        workdir / f"c{i}")
        return got[0], metrics

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(consume, picks))
    for i, (got, _) in zip(picks, results, strict=True):
        assert got.cached_tokens == seed.cases[i].expected_hit > 0
        assert identical(cold[i], got)
    # crosses-no-state restores 1024, not 1280: the metric says a state was what was missing
    assert seed.cases[0].name == "crosses-no-state"
    assert results[0][1].get("lookup_misses:no_state") == 1, results[0][1]


def test_a_lone_surrogate_cache_salt_is_served_and_the_engine_keeps_going(
    seed: Seed, cold: list[Completion], workdir: Path, shared: str
) -> None:
    """A cache salt vLLM accepts (a lone surrogate is valid JSON) but no UTF-8 encoder does:
    the request is a miss, computed cold, and the engine goes on to restore the next one."""
    prompts = [seed.cases[0].tokens, seed.cases[1].tokens]
    got = run(seed, spec(seed, "kv_consumer", prompts, ["\ud800", ""], shared), workdir / "surrogate")
    assert got[0].cached_tokens == 0 and identical(cold[0], got[0])
    assert got[1].cached_tokens == seed.cases[1].expected_hit > 0 and identical(cold[1], got[1])


def test_keyed_namespace_rejects_forged_states_and_cannot_be_probed(
    seed: Seed, cold: list[Completion], workdir: Path
) -> None:
    """Tenant A serves with a namespace secret; an attacker with full access to the store but
    not the secret replaces every state with a zero state under a valid plain header and
    checksum (the seed bug's bytes, written on purpose). A's consumer rejects them all,
    recomputes, and gives cold's output; the attacker cannot even tell what A cached. The
    secret appears in no log line, metric or stats output."""
    secret = "tenant-a-" + os.urandom(16).hex()
    env = {"PV_TEST_NS_SECRET": secret}
    extra = {"namespace": "tenantA", "namespace_secret_env": "PV_TEST_NS_SECRET"}
    store_uri = f"local://{workdir}/keyed?capacity=1GiB"
    _, prod_metrics = run_with_metrics(
        seed, spec(seed, "kv_producer", [seed.producer], [""], store_uri, extra_config=extra), workdir, env)
    store = open_store(store_uri)

    # The attacker knows the layout (no secret: anyone can serve the same model; here it is read
    # with A's key, a stand-in), though the stored one is ciphertext; the keys of a prompt it
    # cannot compute.
    (layout_key,) = [k for k, _ in store.scan("tenantA/") if k.rsplit("/", 1)[1].startswith("layout.")]
    stored_layout = store.get_many([layout_key])[0] or b""
    a_key = NamespaceKey.derive(secret.encode(), "tenantA")
    layout = CacheLayout.from_json(json.loads(bytes(decode(stored_layout, key=a_key)[1])))
    assert layout.model and layout.model.encode() not in stored_layout  # (plain JSON would name it)
    case = seed.cases[1]
    for key in (None, NamespaceKey.derive(b"a guessed secret, not tenant A's", "tenantA")):
        probe = Vault(store, layout, "tenantA", key)
        assert probe.lookup(probe.hashes(case.tokens), len(case.tokens)) == 0
    states = [k for k, _ in store.scan("tenantA/") if "/s/" in k]
    assert states
    for key in states:
        blob = store.get_many([key])[0] or b""
        header = _parse(memoryview(blob))  # unverified: the attacker has no key
        zeros = bytes(header.length)
        forged = b"".join(bytes(p) for p in encode(header, zeros))
        assert decode(forged, header)  # a valid plain object for exactly this key
        assert store.put_many([(key, [forged])]) == [True]

    got, metrics = run_with_metrics(
        seed, spec(seed, "kv_consumer", [case.tokens], [""], store_uri, extra_config=extra),
        workdir / "keyed-consumer", env)
    assert identical(cold[1], got[0])
    assert metrics.get("rejected:unsealed", 0) >= 1, metrics
    assert len({k for k, _ in store.scan("tenantA/") if "/s/" in k}) < len(states)
    logs = "".join(p.read_text(errors="replace") for p in workdir.rglob("*.log"))
    assert "tenantA" in logs and "keyed: secret from $PV_TEST_NS_SECRET" in logs
    assert secret not in logs
    assert not any(secret in name for name in {**prod_metrics, **metrics})
    from typer.testing import CliRunner

    from prefixvault.cli import app

    for args in (["stats", "--store", store_uri], ["audit", "--store", store_uri]):
        out = CliRunner().invoke(app, args)
        assert secret not in out.output


def test_bad_configurations_are_named_at_start_and_the_engine_still_serves(
    seed: Seed, cold: list[Completion], workdir: Path
) -> None:
    """A hybrid engine without prefix caching, a producer role and a capture interval longer
    than any prompt: each is one warning line at start saying what to change, and requests
    are still served exactly (cold)."""
    engine = {**seed.engine, "enable_prefix_caching": False}
    engine.pop("mamba_cache_mode", None)
    where = workdir / "preflight"
    case = seed.cases[0]
    s = spec(seed, "kv_producer", [case.tokens], [""], f"local://{workdir}/preflight-store?capacity=1GiB",
             extra_config={"capture": "interval:1000000"})
    s.engine = engine
    got = run(seed, s, where)
    assert identical(cold[0], got[0])
    log = "".join(p.read_text(errors="replace") for p in where.rglob("*.log"))
    warned = [line for line in log.splitlines() if "WARNING" in line and "prefixvault:" in line]
    for fix in ("--enable-prefix-caching", "never restores", "use a shorter interval"):
        assert sum(fix in line for line in warned) == 1, (fix, warned)


def test_explain_agrees_with_the_engines_hit(seed: Seed, workdir: Path, shared: str) -> None:
    """On the store the seed producer filled, ``prefixvault explain`` gives every case the hit a
    consumer engine restores (checked against engines above), and names why the longer
    boundaries do not restore."""
    from typer.testing import CliRunner

    from prefixvault.cli import app

    for i, case in enumerate(seed.cases):
        ids = workdir / f"explain-{i}.json"
        ids.write_text(json.dumps(case.tokens))
        res = CliRunner().invoke(app, ["explain", "--store", shared, "--model", seed.model,
                                       "--token-ids", str(ids), "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["restorable"] == case.expected_hit, (case.name, out["restorable"])
        (report,) = out["layouts"]
        assert report["weights_match"] is True
        if case.name == "crosses-no-state":  # 1280 is shared, but no producer step ended there
            status = {b["tokens"]: b["status"] for b in report["boundaries"]}
            assert status[1280].startswith("KV blocks are stored but no exact state"), status
