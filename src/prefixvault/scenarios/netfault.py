"""A TCP proxy on loopback that injects a network fault at an exact protocol point.

Clients connect to the proxy instead of the server. Bytes pass both ways until a client sends
a chunk containing ``trigger`` (say ``b"TOUCH"``, the first command of a lookup); from then
on the proxy either stalls (holds every connection open and forwards nothing, like a network
that stopped delivering) or drops (closes every connection and refuses new ones, like a
server that died). For tests: the server and the client are real, only the wire misbehaves.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque
from typing import Literal

Fault = Literal["stall", "drop"]


def no_delay(*socks: socket.socket) -> None:
    """Forward each chunk as it is handed over (no Nagle): a proxy that held a small chunk for
    the peer's delayed ack would add tens of milliseconds the network it stands for has not."""
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FaultyLink:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target`` until ``trigger`` is seen."""

    def __init__(self, target: int, trigger: bytes, fault: Fault) -> None:
        self.target = target
        self.trigger = trigger
        self.fault = fault
        self.tripped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.tripped.is_set() and self.fault == "drop":
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
                no_delay(client, server)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        tail = b""  # the client's last bytes, so a trigger split across reads is still seen
        try:
            while not self._closed:
                ready, _, _ = select.select([client, server], [], [], 0.1)
                for src in ready:
                    if self.tripped.is_set():
                        if self.fault == "drop":
                            return
                        continue  # stalled: read nothing, forward nothing
                    data = src.recv(1 << 20)
                    if not data:
                        return
                    if src is client:
                        seen = tail + data
                        tail = seen[-len(self.trigger) :]
                        if self.trigger in seen:
                            self._trip()
                            if self.fault == "drop":
                                return
                            continue  # the triggering command never reaches the server
                    peer[src].sendall(data)
                if self.tripped.is_set() and self.fault == "stall":
                    threading.Event().wait(0.1)
        except (OSError, ValueError):  # ValueError: a socket closed under select by close()
            pass
        finally:
            if self.fault == "drop" or self._closed:
                for s in (client, server):
                    with contextlib.suppress(OSError):
                        s.close()

    def _trip(self) -> None:
        self.tripped.set()
        if self.fault == "drop":
            with contextlib.suppress(OSError):
                self._listener.close()
            with self._lock:
                for s in self._conns:
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._conns:
                with contextlib.suppress(OSError):
                    s.close()


class SlowLink:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``, delivering every chunk the client
    sends ``delay`` seconds after it arrived: each request/response round trip costs ``delay``
    more, like a store across a network, while bytes keep flowing at loopback speed (chunks are
    not held one after another, so a large write costs one delay, not one per chunk).
    ``delay`` may be changed while connections are open (a store that stalls): chunks arriving
    from then on are due after the new delay, and none overtakes an earlier one (after a long
    delay drops, new chunks still wait for those stamped before). ``close()`` stops accepting
    and cuts the open connections."""

    def __init__(self, target: int, delay: float) -> None:
        self.target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                no_delay(client, server)
            except OSError:
                if self._closed:
                    return
                continue
            queue: deque[tuple[float, bytes]] = deque()
            ready = threading.Condition()
            threading.Thread(target=self._take, args=(client, queue, ready), daemon=True).start()
            threading.Thread(target=self._deliver, args=(server, client, queue, ready), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _take(self, src: socket.socket, queue: deque[tuple[float, bytes]],
              ready: threading.Condition) -> None:
        """Client to server: stamp each chunk with the time it is due (b"" marks the end)."""
        try:
            while not self._closed:
                data = src.recv(1 << 20)
                with ready:
                    queue.append((time.monotonic() + self.delay, data))
                    ready.notify()
                if not data:
                    return
        except OSError:
            with ready:
                queue.append((0.0, b""))
                ready.notify()

    def _deliver(self, dst: socket.socket, src: socket.socket, queue: deque[tuple[float, bytes]],
                 ready: threading.Condition) -> None:
        ended = False  # the client finished sending: the server's reply still comes back
        try:
            while not self._closed:
                with ready:
                    while not queue:
                        ready.wait(0.1)
                        if self._closed:
                            return
                    due, data = queue.popleft()
                if not data:
                    ended = True
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    threading.Event().wait(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if ended:  # half-close: the server sees the end; its reply still flows back (_pump)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
            else:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Server to client, as it comes."""
        try:
            while not self._closed:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
