"""A quarantine that sticks, replays refused, and a watcher no tenant can aim (issue 31).

The watcher's cold server is a real HTTP server that answers completions with fixed token
ids; everything else is the real vault on a real store.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from test_vault import BS, TearingStore, layout

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.codec import ObjectKind, content_digest, decode
from prefixvault.denylist import DENY_MAX, DenyList
from prefixvault.samples import VerifySample, pending_samples, write_sample
from prefixvault.stores.base import Store
from prefixvault.stores.local import LocalStore
from prefixvault.stores.memory import MemoryStore
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import ObjectRef, RankAck, Vault
from prefixvault.watch import watch_once

KEY = NamespaceKey.derive(b"tenant-a-secret-0123456789abcdef", "tenantA")
PROMPT = list(range(64))
ASK = [*PROMPT[:50], 999]  # a later prompt sharing 48 tokens: hits 40 when all is well


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else LocalStore(tmp_path / "s", capacity=64 << 20)
    yield s
    s.close()


def wrong(ref: ObjectRef, block_id: int) -> bytes:
    """What a buggy engine computes: the seed bug's zeros (deterministic, so a producer that
    runs again computes the very same bytes)."""
    n = 2 * BS * 4 * 4 if ref.kind is ObjectKind.BLOCK else 64
    return bytes(n)


def right(ref: ObjectRef, block_id: int) -> bytes:
    n = 2 * BS * 4 * 4 if ref.kind is ObjectKind.BLOCK else 64
    return np.full(n // 4, block_id + 0.25, np.float32).tobytes()


def save(vault: Vault, tokens: list[int], boundaries: list[int],
         read: Callable[[ObjectRef, int], bytes] = right) -> list[int]:
    """``fill`` with a chosen payload: the boundaries published."""
    hashes = vault.hashes(tokens)
    n = len(tokens) // BS
    tables = {0: list(range(1, n + 1)), 1: list(range(100, 100 + n))}
    caps = [StateCapture(2, b, 200 + b, 1) for b in boundaries]
    d = plan_saves(vault.layout, len(tokens), tables, caps, step=1)
    acks: list[RankAck] = vault.save(0, hashes, d.publishable, read)
    return sorted(b for b, why in vault.publish(hashes, acks).items() if why is None)


def hit(vault: Vault) -> int:
    return vault.lookup(vault.hashes(ASK), len(ASK))


def state_ref(vault: Vault, tokens: int) -> ObjectRef:
    return next(r for r in vault.needed(vault.hashes(PROMPT), tokens) if r.kind is ObjectKind.STATE)


# -- the cold server -------------------------------------------------------------------------------


class Cold:
    """A real completion server that answers every prompt with ``tokens`` (greedy, with
    logprobs that make any other token lose by a wide margin)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.requests = 0
        cold = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _send(self, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._send({"data": [{"id": "m"}]})

            def do_POST(self) -> None:
                want = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                cold.requests += 1
                toks = cold.tokens[: int(want["max_tokens"])]
                self._send({"choices": [{"text": "", "logprobs": {
                    "tokens": [f"token_id:{t}" for t in toks], "token_logprobs": [0.0] * len(toks),
                    "top_logprobs": [{f"token_id:{t}": 0.0} for t in toks]}}]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cold() -> Iterator[Cold]:
    c = Cold([1, 2, 3, 4])
    yield c
    c.close()


def sample_of(vault: Vault, tokens: int, output: list[int], key: NamespaceKey | None = None) -> VerifySample:
    record = vault.keys.record(vault.hashes(PROMPT)[tokens // BS - 1])
    sample = VerifySample(ASK, tokens, record, output, time.time(), "h:1")
    assert write_sample(vault.store, sample, key)
    return sample


# -- 1. a quarantine that sticks -------------------------------------------------------------------


def test_watch_removes_the_record_and_the_states_at_its_boundary(store: Store, cold: Cold) -> None:
    vault = Vault(store, layout())
    assert save(vault, PROMPT, [16, 40], wrong) == [16, 40]
    refs = vault.needed(vault.hashes(PROMPT), 40)
    states = [r.key for r in refs if r.kind is ObjectKind.STATE]
    blocks = [r.key for r in refs if r.kind is ObjectKind.BLOCK]
    sample_of(vault, 40, [1, 9, 9, 9])  # the restored run parted from cold at token 1
    report = watch_once(store, cold.url)
    assert len(report.quarantined) == 1 and report.refused == 0
    record = vault.keys.record(vault.hashes(PROMPT)[4])
    assert states and store.exists_many([record, *states]) == [False] * (1 + len(states))
    # and the KV blocks of its segment (past the boundary at 16): not listed (other prefixes
    # share them), but gone, so that a producer writes them fresh instead of skipping them
    before = {r.key for r in vault.needed(vault.hashes(ASK), 16) if r.kind is ObjectKind.BLOCK}
    segment = [k for k in blocks if k not in before]
    assert segment and {record, *states, *segment} <= set(report.removed)
    assert not set(report.removed) & before
    assert store.exists_many(segment) == [False] * len(segment)
    assert store.exists_many(sorted(before)) == [True] * len(before)  # the boundary before restores
    assert hit(vault) == 16 and vault.load(vault.needed(vault.hashes(ASK), 16)).ok


def test_a_producer_computing_the_same_wrong_bytes_cannot_publish_them_again(store: Store, cold: Cold) -> None:  # noqa: E501
    vault = Vault(store, layout())
    save(vault, PROMPT, [16, 40], wrong)
    sample_of(vault, 40, [1, 9, 9, 9])
    watch_once(store, cold.url)
    producer = Vault(store, layout())  # a fresh process, the same buggy engine
    assert save(producer, PROMPT, [16, 40], wrong) == [16]
    assert producer.counters.put_denied > 0
    assert hit(Vault(store, layout())) == 16
    # the engine fixed: the right bytes are stored and published again
    assert save(Vault(store, layout()), PROMPT, [16, 40], right) == [16, 40]
    consumer = Vault(store, layout())
    assert hit(consumer) == 40 and consumer.load(consumer.needed(consumer.hashes(ASK), 40)).ok


def test_a_state_left_behind_is_checked_before_the_put_is_skipped(store: Store) -> None:
    """What the old watch left: the record gone, the wrong state still stored. A producer
    that finds it present must not take it as its own."""
    vault = Vault(store, layout())
    save(vault, PROMPT, [16, 40], wrong)
    ref = state_ref(vault, 40)
    blob = store.get_many([ref.key])[0]
    assert blob is not None
    header, payload = decode(blob)
    vault.deny_objects([(ref.key, content_digest(header, payload))])
    store.delete_many([vault.keys.record(vault.hashes(PROMPT)[4])])
    producer = Vault(store, layout())
    assert save(producer, PROMPT, [16, 40], right) == [16, 40]
    assert producer.counters.rejected["denied"] == 1  # found present, read, refused, written again
    consumer = Vault(store, layout())
    assert hit(consumer) == 40
    loaded = consumer.load([state_ref(consumer, 40)])
    assert loaded.ok and bytes(next(iter(loaded.payloads.values()))) == right(ref, 240)


def test_a_present_state_that_does_not_verify_is_written_again(store: Store) -> None:
    vault = Vault(store, layout())
    save(vault, PROMPT, [16, 40])
    ref = state_ref(vault, 40)
    store.put_many([(ref.key, [b"\0" * 300])])  # damage: still present, no longer valid
    store.delete_many([vault.keys.record(vault.hashes(PROMPT)[4])])
    assert save(Vault(store, layout()), PROMPT, [16, 40]) == [16, 40]
    consumer = Vault(store, layout())
    assert hit(consumer) == 40 and consumer.load(consumer.needed(consumer.hashes(ASK), 40)).ok


@pytest.mark.parametrize("junk", [b"", b"x" * 10, b"\0" * 128, "copy of another record"])
def test_bytes_written_at_a_record_key_do_not_bring_a_quarantined_hit_back(store: Store, cold: Cold,
                                                                           junk: bytes | str) -> None:
    vault = Vault(store, layout())
    assert save(vault, PROMPT, [16, 40], wrong) == [16, 40]
    hashes = vault.hashes(PROMPT)
    record = vault.keys.record(hashes[4])
    sample_of(vault, 40, [1, 9, 9, 9])
    assert len(watch_once(store, cold.url).quarantined) == 1
    if isinstance(junk, str):
        other = store.get_many([vault.keys.record(hashes[1])])[0]
        assert other is not None
        junk = other  # valid bytes, for another boundary
    store.put_many([(record, [junk or b"\0"])])
    consumer = Vault(store, layout())
    assert hit(consumer) == 16  # the quarantine took the objects: a record alone restores nothing


def test_junk_at_the_record_key_of_a_sound_boundary_never_loads_wrong_bytes(store: Store) -> None:
    """A record is a marker that every object of its boundary was stored; a lookup reads only
    the records the deny-list names (no round trip of its own), so junk at the record key of a
    boundary whose objects are all sound still finds them, and the load verifies each."""
    vault = Vault(store, layout())
    save(vault, PROMPT, [16, 40])
    record = vault.keys.record(vault.hashes(PROMPT)[4])
    store.put_many([(record, [b"x" * 10])])
    consumer = Vault(store, layout())
    assert hit(consumer) == 40
    loaded = consumer.load(consumer.needed(consumer.hashes(ASK), 40))
    assert loaded.ok
    for ref, payload in loaded.payloads.items():
        assert bytes(payload) == right(ref, 200 + 40 if ref.kind is ObjectKind.STATE else 0) or \
            ref.kind is ObjectKind.BLOCK


# -- 2. replay --------------------------------------------------------------------------------------


def test_a_replayed_sealed_object_and_record_are_refused_after_a_quarantine(store: Store, cold: Cold) -> None:
    owner = Vault(store, layout(), "tenantA", KEY)
    assert save(owner, PROMPT, [16, 40], wrong) == [16, 40]
    hashes = owner.hashes(PROMPT)
    record = owner.keys.record(hashes[4])
    ref = state_ref(owner, 40)
    every = [k for k, _ in store.scan("tenantA/")]
    copied = dict(zip(every, store.get_many(every), strict=True))  # what an attacker can read
    sample_of(owner, 40, [1, 9, 9, 9], KEY)
    report = watch_once(store, cold.url, "tenantA", key=KEY)
    assert len(report.quarantined) == 1 and record in report.removed and ref.key in report.removed
    # a tenant without the secret puts every old byte back under the same keys
    store.put_many([(k, [v]) for k, v in copied.items() if v is not None])
    consumer = Vault(store, layout(), "tenantA", KEY)
    assert consumer.lookup(consumer.hashes(ASK), len(ASK)) == 16
    assert consumer.counters.rejected["record denied"] == 1
    store.put_many([(ref.key, [copied[ref.key] or b""])])
    loaded = consumer.load([ref])
    assert loaded.failed == {ref: "denied"} and store.exists_many([ref.key]) == [False]


def test_the_deny_list_survives_its_deletion_by_a_running_vault(store: Store, cold: Cold) -> None:
    owner = Vault(store, layout(), "tenantA", KEY)
    save(owner, PROMPT, [16, 40], wrong)
    ref = state_ref(owner, 40)
    old = store.get_many([ref.key])[0]
    sample_of(owner, 40, [1, 9, 9, 9], KEY)
    watch_once(store, cold.url, "tenantA", key=KEY)
    consumer = Vault(store, layout(), "tenantA", KEY)
    consumer.refresh_deny(force=True)
    assert len(consumer.deny) > 0
    store.delete_many([consumer.deny_key()])  # the attacker deletes the list, then replays
    store.put_many([(consumer.deny_key(), [b"PVO1" + bytes(200)])])  # or forges one
    assert old is not None
    store.put_many([(ref.key, [old])])
    assert consumer.load([ref]).failed == {ref: "denied"}
    consumer.refresh_deny(force=True)  # the running vault writes what it holds back
    fresh = Vault(store, layout(), "tenantA", KEY)
    fresh.refresh_deny(force=True)
    assert len(fresh.deny) == len(consumer.deny)


def test_a_deny_list_is_bounded_and_expires() -> None:
    deny = DenyList()
    now = time.time()
    for i in range(DENY_MAX + 10):
        deny.add(f"s/0/0/{i:032x}", bytes(16), now + 100 + i)
    deny.add("s/0/0/old", bytes(16), now - 1)
    deny.prune(now)
    assert len(deny) == DENY_MAX and "s/0/0/old" not in deny
    assert f"s/0/0/{0:032x}" not in deny and f"s/0/0/{DENY_MAX + 9:032x}" in deny
    assert not deny.denied("s/0/0/old", bytes(16), now)
    fp = bytes(16)
    assert len(DenyList.decode(deny.encode(fp, KEY), fp, KEY)) == DENY_MAX


# -- 3. a watcher no tenant can aim ------------------------------------------------------------------


def test_a_plain_sample_cannot_aim_a_watcher_at_another_namespace(store: Store, cold: Cold) -> None:
    """Tenant B writes plain samples naming tenant A's sealed record and layout object; a
    watcher over every namespace removes the samples and touches nothing of A's."""
    owner = Vault(store, layout(), "tenantA", KEY)
    save(owner, PROMPT, [16, 40])
    before = sorted(k for k, _ in store.scan("tenantA/"))
    b = Vault(store, layout(), "tenantB")
    save(b, PROMPT, [16])
    targets = [owner.keys.record(owner.hashes(PROMPT)[4]), owner.keys.layout(), "tenantA",
               b.keys.layout(), b.keys.block(0, 0, b.hashes(PROMPT)[0])]
    for i, target in enumerate(targets):
        sample = VerifySample(ASK, 40, target, [1, 9, 9, 9], time.time())
        store.put_many([(f"{b.keys.prefix}v/{i}", [sample.encode()])])
    report = watch_once(store, cold.url)
    assert report.refused == len(targets) and report.quarantined == [] and cold.requests == 0
    assert sorted(k for k, _ in store.scan("tenantA/")) == before
    assert store.exists_many([b.keys.layout(), b.keys.block(0, 0, b.hashes(PROMPT)[0])]) == [True, True]
    assert list(pending_samples(store)) == []


def test_a_plain_sample_inside_a_keyed_namespace_is_a_forgery(store: Store, cold: Cold) -> None:
    owner = Vault(store, layout(), "tenantA", KEY)
    save(owner, PROMPT, [16, 40])
    record = owner.keys.record(owner.hashes(PROMPT)[4])
    store.put_many([(f"{owner.keys.prefix}v/forged", [VerifySample(ASK, 40, record, [9], 1.0).encode()])])
    report = watch_once(store, cold.url)  # a watcher without the secret
    assert report.refused == 1 and store.exists_many([record]) == [True]
    store.put_many([(f"{owner.keys.prefix}v/forged", [VerifySample(ASK, 40, record, [9], 1.0).encode()])])
    report = watch_once(store, cold.url, "tenantA", key=KEY)  # with it: plain is unreadable
    assert report.unreadable == 1 and report.quarantined == [] and store.exists_many([record]) == [True]
    # the owner's own sealed sample is acted on, by the watcher with the secret only
    sample_of(owner, 40, [1, 9, 9, 9], KEY)
    assert watch_once(store, cold.url).quarantined == [] and store.exists_many([record]) == [True]
    assert len(watch_once(store, cold.url, "tenantA", key=KEY).quarantined) == 1
    assert store.exists_many([record]) == [False]


def test_a_torn_read_of_the_deny_list_never_drops_its_entries() -> None:
    """Two vaults list bytes; one's read of the stored list is torn (as a read racing a
    same-size write-back may be on Mooncake): it reads the list once more and keeps what the
    other listed, where replacing the list with its own would drop it."""
    store = TearingStore()
    a, b = Vault(store, layout()), Vault(store, layout())
    a._deny.add([("default/x/s/0/0/" + "a" * 32, b"\x01" * 16)])
    b._deny.add([("default/x/s/0/0/" + "b" * 32, b"\x02" * 16)])  # the stored list holds both
    store.tear.add(a.deny_key())
    a.refresh_deny(force=True)
    assert not store.tear and not any(k.startswith("deny-list") for k in a.counters.rejected)
    fresh = Vault(store, layout())
    fresh.refresh_deny(force=True)
    assert len(fresh.deny) == len(a.deny) == 2
