"""An engine's store that is down at start: calls fail fast, the store is picked up once it is
back; bad configuration still fails at once. Real servers on loopback."""

from __future__ import annotations

import time

import pytest

from prefixvault.stores import StoreError, StoreUnavailable, open_store, open_store_or_retry
from prefixvault.stores.retrying import RetryingStore
from prefixvault.testing.mooncake import MooncakeCluster, _free_port
from prefixvault.testing.valkey import Valkey


def test_down_redis_server_gives_a_store_that_fails_fast() -> None:
    port = _free_port()
    store = open_store_or_retry(f"redis://127.0.0.1:{port}?timeout=1")
    assert isinstance(store, RetryingStore)
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
        store = RetryingStore(uri, open_store, first.value, interval=0.2)
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
