"""Mooncake-specific behaviour on a real mooncake_master and mooncake_client (loopback only):
where data lives, config forms, and faults of the master and of the memory holder.

The conformance suite (test_store_conformance.py) covers the Store contract itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_support.freeze import freeze

from prefixvault.scenarios.mooncake import MooncakeCluster, _free_port
from prefixvault.stores import StoreError, open_store

SPAWN = mp.get_context("spawn")
TIMEOUT = 2.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(segment="64MiB", logs=tmp_path / "logs")
    try:
        yield c
    finally:
        c.stop()


def blob(seed: int, n: int = 300_000) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _write_and_exit(uri: str, keys: list[str]) -> None:
    with open_store(uri) as store:
        assert store.put_many([(k, [blob(i)]) for i, k in enumerate(keys)]) == [True] * len(keys)


def test_objects_outlive_the_process_that_wrote_them(cluster: MooncakeCluster) -> None:
    """segment=0 (the default): the writer mounts nothing, the holder keeps its objects."""
    uri = cluster.uri(prefix="outlive/", timeout=str(TIMEOUT))
    p = SPAWN.Process(target=_write_and_exit, args=(uri, ["a", "b"]))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with open_store(uri) as store:
        assert store.get_many(["a", "b"]) == [blob(0), blob(1)]


def test_embedded_segment_leaves_with_its_process(tmp_path: Path) -> None:
    """segment=SIZE: objects live in the writer's own memory and go when it exits; a reader
    then sees a miss, never an error or wrong bytes. This is why segment=0 is the default."""
    c = MooncakeCluster(logs=tmp_path / "logs", holder=False)  # only the writer's own segment
    try:
        uri = c.uri(prefix="embedded/", segment="64MiB", timeout=str(TIMEOUT))
        p = SPAWN.Process(target=_write_and_exit, args=(uri, ["a"]))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        with open_store(c.uri(prefix="embedded/", timeout=str(TIMEOUT))) as store:
            deadline = time.monotonic() + 30  # the master drops a departed client's segment
            while store.exists_many(["a"]) != [False] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert store.exists_many(["a"]) == [False]
            assert store.get_many(["a"]) == [None]
    finally:
        c.stop()


def test_unreachable_master_fails_in_seconds_with_one_line() -> None:
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=rf"master 127.0.0.1:{port} is not reachable") as err:
        open_store(f"mooncake://127.0.0.1:{port}?timeout=1")
    assert time.monotonic() - t0 < 5
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("protocol=udp", "protocol must be tcp or rdma"),
        ("timeout=0", "timeout must be in"),
        ("segment=lots", "bad mooncake store URI"),
        ("colour=blue", "unknown mooncake store parameter"),
    ],
)
def test_bad_uris_are_one_line_errors(query: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(f"mooncake://127.0.0.1:1?{query}")


def test_vllm_style_config_file(cluster: MooncakeCluster, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The JSON file vLLM's Mooncake connectors read works as ?config= and MOONCAKE_CONFIG_PATH."""
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "device_name": "", "master_server_address": cluster.address, "global_segment_size": 0,
        "local_buffer_size": "16MB",
    }))  # fmt: skip
    admin = f"admin=127.0.0.1:{cluster.admin_port}"
    with open_store(f"mooncake://?config={config}&{admin}&prefix=cfg/") as store:
        assert store.put_many([("x", [b"hello"])]) == [True]
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    with open_store(f"mooncake://?{admin}&prefix=cfg/") as store:
        assert store.get_many(["x"]) == [b"hello"]
        assert [k for k, _ in store.scan()] == ["x"]
    config.write_text("{not json")
    with pytest.raises(StoreError, match="cannot read config file"):
        open_store(f"mooncake://?{admin}")


def test_stalled_holder_costs_a_timeout_not_a_hang(cluster: MooncakeCluster) -> None:
    with open_store(cluster.uri(prefix="stall/", timeout=str(TIMEOUT))) as store:
        assert store.put_many([("a", [blob(0)])]) == [True]
        assert cluster.holder is not None
        try:
            freeze(cluster.holder.pid)
            t0 = time.monotonic()
            with pytest.raises(StoreError):
                store.get_many(["a"])
            assert time.monotonic() - t0 < 3 * TIMEOUT + 3
            t0 = time.monotonic()
            with contextlib.suppress(StoreError):
                assert store.put_many([("b", [blob(1)])]) == [False]
            assert time.monotonic() - t0 < 3 * TIMEOUT + 3
            # A client that never met the holder first waits on a handshake, which Mooncake
            # bounds only by a minute: the store's own deadline answers first.
            fresh = open_store(cluster.uri(prefix="stall/", timeout=str(TIMEOUT), buffer="32MiB"))
            try:
                t0 = time.monotonic()
                with pytest.raises(StoreError):
                    fresh.get_many(["a"])
                with pytest.raises(StoreError, match="no new call"):
                    fresh.get_many(["a"])  # the stuck call has not returned: fail at once
                with pytest.raises(StoreError, match="no new call"):
                    fresh.put_many([("c", [blob(2)])])  # nor touch memory it may still use
                assert fresh.staging_buffer(1000) is None
                assert time.monotonic() - t0 < 3 * TIMEOUT + 3
            finally:
                fresh.close()
        finally:
            os.kill(cluster.holder.pid, signal.SIGCONT)


def test_killed_holder_gives_errors_then_misses(cluster: MooncakeCluster) -> None:
    with open_store(cluster.uri(prefix="killed/", timeout=str(TIMEOUT))) as store:
        assert store.put_many([("a", [blob(0)])]) == [True]
        cluster.kill_holder()
        t0 = time.monotonic()
        try:
            got = store.get_many(["a"])
            assert got == [None]  # the master already forgot the segment
        except StoreError:
            pass  # the transfer to the dead holder failed
        assert time.monotonic() - t0 < 3 * TIMEOUT + 3
        assert store.put_many([("b", [blob(1)])]) == [False]  # no memory mounted anywhere


def test_master_down_then_restarted(cluster: MooncakeCluster) -> None:
    """Down: every call fails within the timeout. Restarted: the same store object works
    again once the holder has re-mounted, and the old objects are gone (the master kept
    them only in memory)."""
    with open_store(cluster.uri(prefix="restart/", timeout=str(TIMEOUT))) as store:
        assert store.put_many([("a", [blob(0)])]) == [True]
        cluster.kill_master()
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            store.exists_many(["a"])
        with pytest.raises(StoreError):
            store.get_many(["a"])
        with contextlib.suppress(StoreError):  # refused, or failed: never stored, never a hang
            assert store.put_many([("b", [blob(1)])]) == [False]
        assert time.monotonic() - t0 < 10 * TIMEOUT
        cluster.start_master()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if store.put_many([("b", [blob(1)])]) == [True]:
                    break
            except StoreError:
                pass
            time.sleep(0.2)
        assert store.get_many(["a", "b"]) == [None, blob(1)]


def test_object_evicted_under_a_record_gives_a_shorter_hit(cluster: MooncakeCluster) -> None:
    """A record whose objects are gone yields a shorter hit (or none), never a wrong one."""
    from test_vault import fill, layout

    from prefixvault.vault import Vault

    with open_store(cluster.uri(prefix="evict/", timeout=str(TIMEOUT))) as store:
        vault = Vault(store, layout())
        tokens = list(range(64))
        assert fill(vault, tokens, [16, 40]) == [16, 40]
        hashes = vault.hashes(tokens)
        assert vault.lookup(hashes, len(tokens)) == 40
        state_40 = [r.key for r in vault.needed(hashes, 40) if r.kind.name == "STATE"]
        assert store.delete_many(state_40) == 1  # as the master's eviction would
        assert vault.lookup(hashes, len(tokens)) == 16
        assert vault.load(vault.needed(hashes, 16)).ok


def _count_calls(client: Any) -> list[str]:
    """Record the name of every Mooncake API call ``client`` makes from now on."""
    real, calls = client.call, []

    def counting(what: str, nbytes: int, fn: object, *args: object, **kwargs: object) -> object:
        calls.append(getattr(fn, "__name__", str(fn)))
        return real(what, nbytes, fn, *args, **kwargs)

    client.call = counting
    return calls


def test_a_batch_of_conditional_puts_takes_three_calls(cluster: MooncakeCluster) -> None:
    """Records published together cost three calls to Mooncake, not three per record: one put
    session reserves every key (a key already there is refused), one ranged put, one end."""
    with open_store(cluster.uri(prefix="ifabsent/", timeout=str(TIMEOUT))) as store:
        assert store.put_if_absent("k0", b"old")
        client = store._api()  # type: ignore[attr-defined]
        real, calls = client.call, _count_calls(client)
        items = [(f"k{i}", blob(i, 1000 + i)) for i in range(6)]
        assert store.put_if_absent_many(items) == [False] + [True] * 5
        assert calls == ["batch_put_session_start", "batch_put_from_multi_buffer_ranges",
                         "batch_put_session_end"], calls
        client.call = real
        assert store.get_many([k for k, _ in items]) == [b"old"] + [d for _, d in items[1:]]


class _Slowed:
    """Mooncake's API with every call ``delay`` seconds slower (a master across a network),
    each call's name and thread recorded (``calls``), and when it ran (``spans``)."""

    def __init__(self, api: Any, delay: float) -> None:
        self._api, self._delay = api, delay
        self.calls: list[tuple[str, str]] = []
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._api, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            start = time.monotonic()
            time.sleep(self._delay)
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.setdefault(name, []).append((start, time.monotonic()))

        return call


def test_a_lookups_check_and_reads_take_one_round_trip(cluster: MooncakeCluster) -> None:
    """A lookup's first round trip (records checked, tail indexes read) is two calls to Mooncake
    at once, whatever the number of indexes: the check of the keys not read on a lane of its own
    beside one read of the others, with no size asked first (it was a check, a size query per
    index found and a read, one after another). A read larger than the guess is still whole, at
    a size query and a read more; with the checks lane stuck, the check runs on the main lane."""
    from prefixvault.stores.mooncake import GUESSED_READ

    with open_store(cluster.uri(prefix="tg/", timeout=str(TIMEOUT))) as store:
        indexes = [(f"t{i}", blob(i, 2000 + i)) for i in range(4)]
        large = blob(9, GUESSED_READ + 1)
        assert store.put_many([(k, [d]) for k, d in [*indexes, ("rec", b"r"), ("big", large)]]) == [True] * 6
        client = store._api()  # type: ignore[attr-defined]
        real = client.api
        client.api = slowed = _Slowed(real, 0.5)
        try:
            keys = ["rec", "gone", *[k for k, _ in indexes], "t-none"]
            found, read = store.touch_and_get(keys, None, [k for k, _ in indexes] + ["t-none"])
            assert found == [True, False, True, True, True, True, False]
            assert read == [d for _, d in indexes] + [None]
            assert sorted(slowed.calls) == [("batch_get_into", "prefixvault-mooncake"),
                                            ("batch_is_exist", "prefixvault-mooncake-checks")], slowed.calls
            (check,), (get,) = slowed.spans["batch_is_exist"], slowed.spans["batch_get_into"]
            assert max(check[0], get[0]) < min(check[1], get[1]), "the check and the read one after the other"
            slowed.calls.clear()
            found, read = store.touch_and_get(["big", "t0", "rec"], None, ["big", "t0"])
            assert found == [True, True, True] and read == [large, indexes[0][1]]
            assert sorted(n for n, _ in slowed.calls) == ["batch_get_into", "batch_get_into",
                                                          "batch_is_exist", "get_size"], slowed.calls
            # A check stuck on its lane: the next checks run on the main lane, before the read.
            client.checks._stuck, client.checks._stuck_what = concurrent.futures.Future(), "a check"
            slowed.calls.clear()
            found, read = store.touch_and_get(["rec", "gone", "t1"], None, ["t1"])
            assert found == [True, False, True] and read == [indexes[1][1]]
            assert slowed.calls == [("batch_is_exist", "prefixvault-mooncake"),
                                    ("batch_get_into", "prefixvault-mooncake")], slowed.calls
        finally:
            client.checks._stuck = None
            client.api = real


def test_a_batch_larger_than_the_arena_is_written_an_arena_at_a_time(cluster: MooncakeCluster) -> None:
    """Conditional puts of more bytes than the staging arena holds: ranged puts of an arena's
    worth each, one end for all, and the arena keeps its size."""
    with open_store(cluster.uri(prefix="arena/", timeout=str(TIMEOUT), staging="1MiB")) as store:
        client = store._api()  # type: ignore[attr-defined]
        size = client.arena.mem.nbytes
        real, calls = client.call, _count_calls(client)
        items = [(f"k{i}", blob(i, 400_000)) for i in range(5)]  # two fit the arena at a time
        assert store.put_if_absent_many(items) == [True] * 5
        client.call = real
        assert calls == ["batch_put_session_start", *["batch_put_from_multi_buffer_ranges"] * 3,
                         "batch_put_session_end"], calls
        assert client.arena.mem.nbytes == size == 1 << 20
        assert store.get_many([k for k, _ in items]) == [d for _, d in items]


def test_a_session_start_that_raises_revokes_only_this_clients_keys(cluster: MooncakeCluster) -> None:
    """The reply of a session start is lost after the master reserved the keys: they are
    revoked, so a retry stores them; a key another client reserved is not revoked by it (the
    master checks the owner), and that client's put completes."""
    uri = cluster.uri(prefix="lost/", timeout=str(TIMEOUT))
    other = cluster.uri(prefix="lost/", timeout=str(TIMEOUT + 1))  # another config: another client
    with open_store(uri) as store, open_store(other) as rival:
        client, rival_client = store._api(), rival._api()  # type: ignore[attr-defined]
        assert client is not rival_client
        theirs = rival._key("shared")  # type: ignore[attr-defined]
        assert rival_client.api.batch_put_session_start([theirs], [1000]) == [0]
        real = client.call

        def losing(what: str, nbytes: int, fn: object, *args: object, **kwargs: object) -> object:
            result = real(what, nbytes, fn, *args, **kwargs)
            if getattr(fn, "__name__", "") == "batch_put_session_start":
                raise StoreError("reply lost")
            return result

        client.call = losing
        items = [("a", blob(1, 1000)), ("b", blob(2, 1000)), ("shared", blob(3, 1000))]
        with pytest.raises(StoreError, match="reply lost"):
            store.put_if_absent_many(items)
        client.call = real
        assert store.put_if_absent_many(items[:2]) == [True, True]
        # The rival's session survived the revoke: it writes and ends its own bytes.
        mine = np.frombuffer(blob(4, 1000), np.uint8)
        rival_client.arena.mem[:1000] = mine
        assert rival_client.api.batch_put_from_multi_buffer_ranges(
            [theirs], [[rival_client.arena.base]], [[1000]], [[0]]) == [1000]
        assert rival_client.api.batch_put_session_end([theirs]) == [0]
        assert store.get_many(["a", "b", "shared"]) == [items[0][1], items[1][1], mine.tobytes()]


def test_a_revoke_that_cannot_be_sent_is_sent_before_the_next_put(cluster: MooncakeCluster) -> None:
    """A call stuck past its deadline refuses the revoke that should follow a lost reply; the
    client still holds those sessions and would refuse the keys for good (the vault would take
    the refusal for a record already there). The next conditional put revokes them first."""
    with open_store(cluster.uri(prefix="leftover/", timeout=str(TIMEOUT))) as store:
        client = store._api()  # type: ignore[attr-defined]
        real = client.call

        def stuck(what: str, nbytes: int, fn: object, *args: object, **kwargs: object) -> object:
            name = getattr(fn, "__name__", "")
            if name == "batch_put_session_revoke":
                raise StoreError("a call is stuck; no new call until it does")
            result = real(what, nbytes, fn, *args, **kwargs)
            if name == "batch_put_session_start":
                raise StoreError("timed out")  # after the master reserved the keys
            return result

        items = [("a", blob(1, 1000)), ("b", blob(2, 1000))]
        client.call = stuck
        with pytest.raises(StoreError, match="timed out"):
            store.put_if_absent_many(items)
        with pytest.raises(StoreError, match="timed out"):
            store.put_if_absent("c", blob(3, 1000))
        client.call = real
        assert len(client.unrevoked) == 3
        assert client.api.batch_put_session_start([store._key("a")], [1000]) != [0]  # type: ignore[attr-defined]
        assert store.put_if_absent_many(items) == [True, True]
        assert store.put_if_absent("c", blob(3, 1000))
        assert not client.unrevoked
        assert store.get_many(["a", "b", "c"]) == [blob(1, 1000), blob(2, 1000), blob(3, 1000)]


def test_a_lookup_reads_its_hits_objects_in_its_first_round_trip(cluster: MooncakeCluster) -> None:
    """Over Mooncake, as over Redis, a lookup that reads its hit's objects ahead (a synchronous
    load's) reads them in its first round trip, beside the check, each into its own size (none
    asked, none refused as too large): the load then needs no call to the master."""
    from test_prefetch import TOKENS, _ask
    from test_vault import fill, layout

    from prefixvault.guard import Guard
    from prefixvault.vault import Vault
    from prefixvault.vllm.in_step import ReadAheadBudget
    from prefixvault.vllm.lookups import Lookups

    with open_store(cluster.uri(prefix="ahead/", timeout=str(TIMEOUT))) as store:
        vault = Vault(store, layout())
        fill(vault, TOKENS, [16, 40])
        vault.refresh_deny()
        client = store._api()  # type: ignore[attr-defined]
        real = client.api
        client.api = slowed = _Slowed(real, 0.0)
        lookups = Lookups(vault, Guard(), budget=ReadAheadBudget(1 << 20))
        try:
            _, found, ahead = lookups.submit(**_ask(16), read_from=16).result(5)  # type: ignore[arg-type]
            calls = list(slowed.calls)
            assert found is not None and found.hit == 40 and ahead is not None
            keys = {r.key for r in ahead.objects}
            ahead.release()
        finally:
            lookups.close(5)
            client.api = real
    assert keys == {r.key for r in vault.needed(vault.hashes(TOKENS[:41])[:5], 40, ranks=[0], since=16)}
    assert [n for n, lane in calls if lane.endswith("-checks")] == ["batch_is_exist"], calls
    assert [n for n, lane in calls if not lane.endswith("-checks")][:1] == ["batch_get_into"], calls
    assert "get_size" not in [n for n, _ in calls], calls
    assert [n for n, _ in calls].count("batch_get_into") == 1, calls
