"""The slow link the benchmarks and stall tests put in front of a store: it adds latency to
every round trip and nothing else (bytes still flow at loopback speed)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from prefixvault.scenarios.netfault import SlowLink
from prefixvault.scenarios.valkey import Valkey


@pytest.fixture
def server() -> Iterator[Valkey]:
    valkey = Valkey()
    yield valkey
    valkey.stop()


def test_each_round_trip_costs_the_delay_and_bandwidth_is_not_capped(server: Valkey) -> None:
    link = SlowLink(server.port, 0.05)
    try:
        client = redis.Redis(host="127.0.0.1", port=link.port, socket_timeout=10)
        client.ping()  # connected (the handshake's round trips are not timed)
        start = time.monotonic()
        for _ in range(3):
            client.ping()
        assert time.monotonic() - start >= 3 * 0.05
        big = bytes(range(256)) * (32 << 12)  # 32 MiB: 32 reads of 1 MiB at least on the way in
        start = time.monotonic()
        assert client.set("big", big)
        took = time.monotonic() - start
        # One round trip's delay, not one per chunk (which would be >= 32 x 0.05 s).
        assert 0.05 <= took < 1.0, took
        assert client.get("big") == big
        link.delay = 0.3  # a stall that starts while the connection is open
        start = time.monotonic()
        client.ping()
        assert time.monotonic() - start >= 0.3
        link.delay = 0.0
        start = time.monotonic()
        client.ping()
        assert time.monotonic() - start < 0.2
        client.close()
    finally:
        link.close()


def test_a_client_that_half_closes_still_gets_the_whole_reply() -> None:
    """A client that sends its request, then shuts its sending side, reads the reply to the end
    (a server that answers only once it has read everything)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        got = b""
        while chunk := conn.recv(1 << 16):
            got += chunk
        conn.sendall(got[::-1] * 1000)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    link = SlowLink(listener.getsockname()[1], 0.05)
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=10) as c:
            c.sendall(b"hello")
            c.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := c.recv(1 << 16):
                reply += chunk
        assert reply == b"olleh" * 1000
    finally:
        link.close()
        listener.close()


def test_a_pipeline_sent_in_pieces_is_not_held_for_a_delayed_ack(server: Valkey) -> None:
    """A request written in several pieces (a pipeline of many commands) reaches the server as
    soon as it is due: the link holds no piece back for the previous one's ack (Nagle against
    a delayed ack would add ~40 ms to a round trip the network it stands for does not have)."""
    link = SlowLink(server.port, 0.02)
    try:
        client = redis.Redis(host="127.0.0.1", port=link.port, socket_timeout=10)
        client.ping()
        took = []
        for _ in range(15):
            pipe = client.pipeline(transaction=False)
            for i in range(600):
                pipe.exists(f"key-{i:05d}")
            start = time.monotonic()
            pipe.execute()
            took.append(time.monotonic() - start)
        assert sorted(took)[len(took) // 2] < 0.02 + 0.015, took  # the delay, and not 40 ms more
        client.close()
    finally:
        link.close()
