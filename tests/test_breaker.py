"""The circuit breaker around a serving engine's store: it opens after repeated failures,
fails calls fast while open, probes, and closes when the store is back; a store down at start
is an open breaker. The state machine with a test clock; then real servers on loopback."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from prefixvault.scenarios.mooncake import MooncakeCluster, _free_port
from prefixvault.scenarios.valkey import Valkey
from prefixvault.stores import StoreError, StoreUnavailable, open_store, open_store_or_retry
from prefixvault.stores.breaker import BreakerOpen, BreakerPolicy, BreakerState, BreakerStore, CircuitBreaker
from prefixvault.stores.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Flaky(MemoryStore):
    """A memory store that can be made unavailable, and counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self.calls += 1
        if self.down:
            raise StoreUnavailable("timed out")
        return super().exists_many(keys)


def test_the_breaker_opens_probes_backs_off_and_closes() -> None:
    clock, inner = Clock(), Flaky()
    store = BreakerStore("memory://x", lambda uri: inner, inner, policy=BreakerPolicy(3, 5.0, 12.0),
                         clock=clock)
    assert store.exists_many(["k"]) == [False]
    inner.down = True
    for _ in range(3):
        with pytest.raises(StoreUnavailable) as e:
            store.exists_many(["k"])
        assert not isinstance(e.value, BreakerOpen)
    assert store.breaker.state is BreakerState.OPEN and store.breaker.opened == 1
    for _ in range(50):  # open: nothing reaches the store
        with pytest.raises(BreakerOpen):
            store.exists_many(["k"])
    assert inner.calls == 4 and store.breaker.refused == 50
    clock.now = 5.0  # the probe goes, fails: open again for twice as long
    with pytest.raises(StoreUnavailable):
        store.exists_many(["k"])
    assert inner.calls == 5 and store.breaker.state is BreakerState.OPEN
    clock.now = 14.9
    with pytest.raises(BreakerOpen):
        store.exists_many(["k"])
    inner.down = False
    clock.now = 15.0
    assert store.exists_many(["k"]) == [False]  # the probe succeeds: closed
    assert store.breaker.state is BreakerState.CLOSED and store.breaker.opened == 1
    inner.down = True  # closed again: it takes 3 failures in a row to open
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            store.exists_many(["k"])
    assert store.breaker.state is BreakerState.CLOSED


def test_only_the_probe_decides_out_of_half_open() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(1, 5.0, 60.0), clock)
    late = b.allow()  # admitted while closed, still running
    assert late is False
    b.failure("down", b.allow())  # another call fails: open
    assert b.state is BreakerState.OPEN
    clock.now = 5.0
    probe = b.allow()
    assert probe is True and b.state is BreakerState.HALF_OPEN
    b.failure("late", late)  # the old call's late answers change nothing
    b.success(late)
    b.neutral(late)
    assert b.state is BreakerState.HALF_OPEN and b.allow() is None  # the probe is still out
    b.success(probe)
    assert b.state is BreakerState.CLOSED


def test_errors_that_are_not_about_availability_change_nothing() -> None:
    clock = Clock()
    store = BreakerStore("memory://x", MemoryStore.named, MemoryStore(), policy=BreakerPolicy(1), clock=clock)
    for _ in range(5):
        with pytest.raises(ValueError):
            store.put_many([("bad key with spaces", [b"x"])])
    assert store.breaker.state is BreakerState.CLOSED


def test_a_store_down_at_start_is_opened_by_a_probe() -> None:
    clock, opened = Clock(), []

    def opener(uri: str) -> MemoryStore:
        if clock.now < 10:
            raise StoreUnavailable("connection refused")
        opened.append(uri)
        return MemoryStore()

    store = BreakerStore("memory://x", opener, first_error=StoreUnavailable("refused"),
                         policy=BreakerPolicy(3, 5.0, 60.0), clock=clock)
    with pytest.raises(BreakerOpen):
        store.exists_many(["k"])
    clock.now = 5.0
    with pytest.raises(StoreUnavailable):  # the probe tries to open: still down
        store.exists_many(["k"])
    clock.now = 15.0
    assert store.exists_many(["k"]) == [False] and opened == ["memory://x"]


def test_down_redis_server_gives_a_store_that_fails_fast() -> None:
    port = _free_port()
    store = open_store_or_retry(f"redis://127.0.0.1:{port}?timeout=1")
    assert isinstance(store, BreakerStore) and store.breaker.state is BreakerState.OPEN
    t0 = time.monotonic()
    for _ in range(100):
        with pytest.raises(StoreUnavailable):
            store.exists_many(["k"])
    assert time.monotonic() - t0 < 1, "a store known to be down must not be dialled on every call"


def test_store_is_picked_up_once_the_server_is_back() -> None:
    cluster = MooncakeCluster(segment="32MiB", holder=False)
    try:
        uri = cluster.uri(prefix="retry/", timeout="1")
        cluster.kill_master()
        with pytest.raises(StoreUnavailable) as first:
            open_store(uri)
        store = BreakerStore(uri, open_store, first_error=first.value, policy=BreakerPolicy(3, 0.2, 0.2))
        with pytest.raises(StoreUnavailable):
            store.put_many([("a", [b"x"])])
        cluster.start_master()
        cluster.start_holder()
        time.sleep(0.3)
        assert store.put_many([("a", [b"x"])]) == [True]
        assert store.get_many(["a"]) == [b"x"]
        store.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "uri",
    ["redis://127.0.0.1:1?colour=blue", "mooncake://127.0.0.1:1?protocol=carrier-pigeon", "nosuch://x"],
)
def test_bad_configuration_still_fails_at_once(uri: str) -> None:
    with pytest.raises(StoreError) as exc:
        open_store_or_retry(uri)
    assert not isinstance(exc.value, StoreUnavailable)


def test_auth_failure_is_configuration_not_an_outage() -> None:
    server = Valkey("--requirepass", "s3cret")
    try:
        with pytest.raises(StoreError, match="authentication") as exc:
            open_store_or_retry(f"redis://:wrong@127.0.0.1:{server.port}/0")
        assert not isinstance(exc.value, StoreUnavailable)
    finally:
        server.stop()
