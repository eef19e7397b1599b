"""Read a pipeline of Redis ``GET`` replies straight from the socket into caller buffers.

Why not redis-py's parser: it reads 64 KiB at a time and takes the GIL for each piece (feed,
parse, a bytes object per value, then our copy of it). A load of a few MiB on the worker's load
thread then holds the GIL in hundreds of short bursts, and the engine thread, which gives the
GIL up around every kernel of a forward, waits behind them (``bench/load_beside_steps.py``, 2
cores: a 0.7 ms step's p99 beside 4.5 MiB loads went from 3.4 ms to 2.1 ms with this reader).
Here each value's bytes go by ``recv_into`` into their destination, in as few calls as the
socket allows, with no copy.

The protocol handled is RESP2/RESP3 bulk strings (``$<n>\\r\\n<bytes>\\r\\n``), nulls (``$-1``,
``_``) and error replies (``-...``), which is everything ``GET`` answers. Anything else (a
RESP3 push message too: the store's connections speak RESP2, which has none), and any error
midway, leaves the stream at an unknown point: the caller must drop the connection.
"""

from __future__ import annotations

import socket

#: Bytes read at a time for reply headers (a payload goes straight to its buffer).
CHUNK = 1 << 16
#: A reply header line longer than this is not a reply to GET.
MAX_LINE = 1 << 12


class ReplyError(Exception):
    """The server answered one command with an error (``-ERR ...``, ``-WRONGTYPE ...``)."""


class ProtocolError(Exception):
    """Bytes that are not a reply to GET, or the server closed the connection midway."""


class BulkReader:
    """Replies, one after another, from one connection's socket; ``pending`` holds bytes read
    past the reply being handled.

    Invariant: ``pending`` starts at a reply boundary or inside the header of the next reply;
    every payload byte that reached ``pending`` is consumed before the socket is read again."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()

    def _fill(self) -> None:
        chunk = self._sock.recv(CHUNK)
        if not chunk:
            raise ProtocolError("the server closed the connection")
        self._pending += chunk

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > MAX_LINE:
                raise ProtocolError("reply header too long")
            self._fill()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def read_into(self, buf: memoryview) -> int | None:
        """The next reply: None for a missing key, else the value's size. A value that fits
        ``buf`` is written at its start; a larger one is read and thrown away (the caller
        sees its size), as ``Store.get_into`` promises."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        if kind == b"_" or (kind == b"$" and rest == b"-1"):
            return None
        if kind != b"$" or not rest.isdigit():
            raise ProtocolError(f"not a bulk string reply: {line[:40]!r}")
        size = int(rest)
        if size > buf.nbytes:
            self._skip(size)
        elif buf.contiguous:
            self._read_value((buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B"))[:size])
        elif buf.ndim == 1 and buf.format == "B":  # strided: recv_into writes contiguous memory only
            tmp = bytearray(size)
            self._read_value(memoryview(tmp))
            buf[:size] = tmp
        else:
            raise ValueError("a buffer must be contiguous, or one-dimensional bytes")
        return size

    def _read_value(self, target: memoryview) -> None:
        """A value's bytes (and its CRLF) into ``target``, which is exactly as long."""
        have = min(len(self._pending), target.nbytes)
        target[:have] = self._pending[:have]
        del self._pending[:have]
        got = have
        while got < target.nbytes:
            n = self._sock.recv_into(target[got:])
            if not n:
                raise ProtocolError("the server closed the connection")
            got += n
        self._crlf()

    def _skip(self, size: int) -> None:
        """A value too large for its buffer: read and dropped, its CRLF too."""
        have = min(len(self._pending), size)
        del self._pending[:have]
        left = size - have
        while left:
            n = len(self._sock.recv(min(left, CHUNK)))
            if not n:
                raise ProtocolError("the server closed the connection")
            left -= n
        self._crlf()

    def _crlf(self) -> None:
        while len(self._pending) < 2:
            self._fill()
        if self._pending[:2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        del self._pending[:2]

    def done(self) -> None:
        """After the last reply: nothing may be left over (else the stream is not ours)."""
        if self._pending:
            raise ProtocolError(f"{len(self._pending)} bytes after the last reply")
