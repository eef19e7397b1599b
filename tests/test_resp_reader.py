"""The RESP reader the Redis store's loads use: every split of the byte stream reads the same,
and anything that is not a GET reply stops it (the store then drops the connection)."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.stores._resp import CHUNK, BulkReader, ProtocolError, ReplyError


def _encode(value: bytes | None, resp3: bool = False) -> bytes:
    if value is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _pieces(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    at = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(at) if b > a]


class _Wire:
    """A connected socket pair; the far end sends the pieces (each as its own send) from a
    thread, so a reply larger than the socket buffers still flows."""

    def __init__(self, pieces: Sequence[bytes], close_after: bool = False) -> None:
        self.near, self.far = socket.socketpair()
        self.near.settimeout(5)
        self._thread = threading.Thread(target=self._send, args=(pieces, close_after), daemon=True)
        self._thread.start()

    def _send(self, pieces: Sequence[bytes], close_after: bool) -> None:
        for p in pieces:
            self.far.sendall(p)
        if close_after:
            self.far.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._thread.join(5)
        self.near.close()
        self.far.close()


@pytest.fixture
def wires() -> Iterator[list[_Wire]]:
    made: list[_Wire] = []
    yield made
    for w in made:
        w.close()


class _Scripted:
    """A socket that hands out exactly the given pieces, one per call (however much the
    reader asks for), so every split of the stream is read as it is split: headers, values
    and CRLFs cut anywhere. (The real socket's behaviour is tested below with socket pairs.)"""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = [memoryview(p) for p in pieces]

    def _next(self, limit: int) -> bytes:
        if not self._pieces:
            return b""
        head = self._pieces[0]
        out, rest = head[:limit], head[limit:]
        if rest.nbytes:
            self._pieces[0] = rest
        else:
            self._pieces.pop(0)
        return bytes(out)

    def recv(self, n: int) -> bytes:
        return self._next(n)

    def recv_into(self, buf: memoryview) -> int:
        data = self._next(buf.nbytes)
        buf[: len(data)] = data
        return len(data)


values = st.lists(st.one_of(st.none(), st.binary(max_size=300), st.sampled_from([b"\r\n", b"$5\r\n"])),
                  min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(values=values, cuts=st.lists(st.integers(0, 10_000), max_size=40), slack=st.lists(st.integers(-3, 3)),
       resp3=st.booleans())
def test_any_split_of_the_stream_reads_the_same(values: list[bytes | None], cuts: list[int],
                                                slack: list[int], resp3: bool) -> None:
    stream = b"".join(_encode(v, resp3) for v in values)
    reader = BulkReader(_Scripted(_pieces(stream, cuts)))  # type: ignore[arg-type]
    for i, v in enumerate(values):
        extra = slack[i] if i < len(slack) else 0
        room = max(0, (len(v) if v is not None else 4) + extra)
        buf = bytearray(b"\xee" * room)
        got = reader.read_into(memoryview(buf))
        if v is None:
            assert got is None and buf == bytearray(b"\xee" * room)
            continue
        assert got == len(v)
        if len(v) <= room:  # written at the start, nothing past it
            assert bytes(buf[: len(v)]) == v and buf[len(v) :] == bytearray(b"\xee" * (room - len(v)))
        else:  # too large: read past, nothing written, the next reply still right
            assert buf == bytearray(b"\xee" * room)
    reader.done()


def test_every_single_byte_split_reads_the_same() -> None:
    values: list[bytes | None] = [b"abc", None, b"", b"\r\n$9\r\n", b"x" * 70]
    stream = b"".join(_encode(v) for v in values)
    reader = BulkReader(_Scripted([stream[i : i + 1] for i in range(len(stream))]))  # type: ignore[arg-type]
    for v in values:
        buf = bytearray(80)
        got = reader.read_into(memoryview(buf))
        assert got == (None if v is None else len(v))
        if v is not None:
            assert bytes(buf[: len(v)]) == v
    reader.done()


def test_a_strided_byte_buffer_is_written_in_place() -> None:
    reader = BulkReader(_Scripted([_encode(b"abcd")]))  # type: ignore[arg-type]
    base = bytearray(8)
    assert reader.read_into(memoryview(base)[::2]) == 4
    assert base == bytearray(b"a\x00b\x00c\x00d\x00")


def test_a_non_contiguous_typed_buffer_is_refused() -> None:
    import numpy as np

    reader = BulkReader(_Scripted([_encode(bytes(8))]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        reader.read_into(memoryview(np.zeros((4, 4), np.float32)[:, :1]))


def test_a_large_value_goes_straight_into_its_buffer(wires: list[_Wire]) -> None:
    big = bytes(range(256)) * (4 * CHUNK // 256 + 3)
    wires.append(w := _Wire(_pieces(_encode(big) + _encode(b"tail"), [5, 70_000, 70_001])))
    reader = BulkReader(w.near)
    buf, tail = bytearray(len(big)), bytearray(4)
    assert reader.read_into(memoryview(buf)) == len(big) and bytes(buf) == big
    assert reader.read_into(memoryview(tail)) == 4 and tail == b"tail"
    reader.done()


def test_typed_buffers_are_written_as_bytes(wires: list[_Wire]) -> None:
    import numpy as np

    src = np.arange(10, dtype=np.float32)
    wires.append(w := _Wire([_encode(src.tobytes())]))
    dst = np.zeros(10, dtype=np.float32)
    assert BulkReader(w.near).read_into(memoryview(dst)) == 40
    assert (dst == src).all()


def test_an_error_reply_is_raised_with_its_text(wires: list[_Wire]) -> None:
    wires.append(w := _Wire([b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"]))
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        BulkReader(w.near).read_into(memoryview(bytearray(8)))


@pytest.mark.parametrize("stream", [b"+OK\r\n", b":12\r\n", b"*2\r\n", b"$abc\r\n", b"$3\r\nabcXY",
                                    b">3\r\n$7\r\nmessage\r\n", b"x" * 5000])
def test_what_no_get_answers_is_a_protocol_error(wires: list[_Wire], stream: bytes) -> None:
    wires.append(w := _Wire([stream]))
    with pytest.raises(ProtocolError):
        BulkReader(w.near).read_into(memoryview(bytearray(8)))


@pytest.mark.parametrize("stream", [b"$10\r\nabc", b"$3\r\nabc", b"$3", b""])
def test_a_connection_closed_midway_is_a_protocol_error(wires: list[_Wire], stream: bytes) -> None:
    wires.append(w := _Wire([stream], close_after=True))
    with pytest.raises(ProtocolError, match="closed"):
        BulkReader(w.near).read_into(memoryview(bytearray(10)))


def test_bytes_after_the_last_reply_are_refused(wires: list[_Wire]) -> None:
    wires.append(w := _Wire([_encode(b"ab") + b"$1\r\n"]))
    reader = BulkReader(w.near)
    assert reader.read_into(memoryview(bytearray(2))) == 2
    with pytest.raises(ProtocolError, match="after the last reply"):
        reader.done()


def test_a_silent_server_times_out(wires: list[_Wire]) -> None:
    wires.append(w := _Wire([b"$4\r\nab"]))
    w.near.settimeout(0.2)
    with pytest.raises(TimeoutError):
        BulkReader(w.near).read_into(memoryview(bytearray(4)))
