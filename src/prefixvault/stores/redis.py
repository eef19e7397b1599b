"""A store on a Redis or Valkey server (or cluster), through redis-py with hiredis.

Each object is one string value written by a single SET, so readers see it whole or not at
all. Every batch call is one pipelined round trip. Loads (``get_into``) on one server read the
GET replies off a pooled connection's socket straight into their buffers (``_resp.py``: the
load thread then holds the engine's GIL far less); a cluster goes through redis-py's parser.
The server, not this store, bounds memory: under ``maxmemory`` with an LRU policy it evicts
(approximately LRU, server-wide), and with ``noeviction`` a full server refuses writes, which
put_many reports as False.

With ``ttl`` every object expires after that long without use, and keys put or touched
together get expiry times in the order given, one millisecond apart (the first the latest).
The times are absolute (``PXAT``/``PEXPIREAT``) on the server's clock, as this client reads it
at open (``TIME``) and follows it with its own since: a relative TTL would start when the
server reaches each command, and a pipeline of megabyte values takes longer than a millisecond
per key; the client's clock alone could lie behind the server's by more than the ttl, and a
time in the past deletes a key. Under ``maxmemory-policy volatile-ttl`` the
server evicts the sampled key nearest to expiry first, so a chain goes from its tail, as the
local store evicts. ``ttl`` needs Redis 7.0 or Valkey (``PEXPIREAT ... NX|GT``) and a writable
server; both are checked at open.

``redis://[[user]:password@]host:port[/db]?prefix=pv:&timeout=5&capacity=8GiB&ttl=86400``
``rediss://...&ssl_ca_certs=/path/ca.pem&ssl_cert_reqs=required``  (TLS)
``redis+cluster://host:port``                                      (Redis Cluster)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixvault.stores._resp import BulkReader, ProtocolError, ReplyError
from prefixvault.stores.base import (
    Buffer,
    Store,
    StoreError,
    StoreStats,
    StoreUnavailable,
    check_distinct,
    check_key,
    copy_into,
    redact,
)
from prefixvault.units import parse_size

log = logging.getLogger("prefixvault.stores.redis")

SCHEMES = ("redis", "rediss", "redis+cluster")
DEFAULT_PREFIX = "pv:"
DEFAULT_TIMEOUT = 5.0
#: A timeout beyond this is a typo (``inf`` would make a stalled server hang the engine).
MAX_TIMEOUT_S = 3600.0
DEFAULT_PORT = 6379
#: Keys used together expire this many milliseconds apart, in the order given (``ttl``); a
#: batch's offsets never take more than half the ttl.
RANK_TICK_MS = 1
#: The longest ``ttl`` (seconds): ten years; longer is a typo.
MAX_TTL_S = 10 * 365 * 86400
#: Keys per SCAN step and per STRLEN pipeline while scanning.
SCAN_CHUNK = 1000

_SSL_PARAMS = ("ssl_ca_certs", "ssl_cert_reqs")


def _glob_escape(text: str) -> str:
    """Escape SCAN MATCH metacharacters so a prefix matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _is_tls_error(exc: BaseException) -> bool:
    """Whether the server's certificate did not verify (configuration, not an outage; a
    connection cut mid-handshake while a server restarts is not this)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _one_value(parts: Sequence[Buffer]) -> bytes | memoryview:
    """An object's parts as one SET value: a single part as it is (redis-py sends a buffer
    without copying it), several joined."""
    if len(parts) == 1:
        part = parts[0]
        return part if isinstance(part, bytes) else memoryview(part).cast("B")
    return b"".join(parts)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class RedisStore(Store):
    """Objects as plain string values under ``prefix + key`` on one server or cluster."""

    remote = True
    pipelines = True

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        *,
        uri: str,
        where: str,
        prefix: str = DEFAULT_PREFIX,
        capacity: int | None = None,
        ttl: float | None = None,
    ) -> None:
        self.uri = uri
        self.where = where
        self.prefix = prefix
        self.capacity = capacity
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._clock_offset_ms = 0  # the server's clock minus this client's (``ttl``)
        self._client = client
        self._prefix_bytes = prefix.encode()
        with self._errors("cannot reach server"):
            client.ping()  # fail here, in seconds, rather than on the first put
        if self._ttl_ms is not None:
            with self._errors("read the server's clock"):
                answer = self._client.time()
            if isinstance(answer, dict):  # a cluster may answer per node: any node's clock
                answer = next(iter(answer.values()))
            seconds, micros = answer
            self._clock_offset_ms = int(seconds) * 1000 + int(micros) // 1000 - int(time.time() * 1000)
            self._check_ttl_support()
        self._check_eviction()

    def _check_ttl_support(self) -> None:
        """``ttl`` renews with ``PEXPIREAT ... NX`` and ``... GT`` (Redis 7.0, Valkey) and needs
        a writable server (a replica refuses them): refuse at open, in one line, rather than
        fail every lookup later."""
        probe = self._key("ttl-probe")  # never holds anything: the commands change nothing
        try:
            with self._errors("check ttl"):
                at = self._expires_at(self._now_ms(), 0)
                pipe = self._pipeline()
                pipe.pexpireat(probe, at, nx=True)
                pipe.pexpireat(probe, at, gt=True)
                pipe.execute()
        except StoreUnavailable:
            raise
        except StoreError as exc:
            raise StoreError(f"redis store {self.where}: ttl needs a writable Redis 7.0+ or Valkey server "
                             f"(PEXPIREAT ... NX/GT): {exc}") from None

    def _check_eviction(self) -> None:
        """One warning line where the server's eviction policy and ``ttl`` work against each
        other (nothing to say where the server hides its CONFIG, as managed services do; a
        cluster is asked through one node)."""
        try:
            conf = self._client.config_get("maxmemory*")
        except Exception:  # advisory only: no permission, no CONFIG, a timeout
            return
        nodes = self._per_node(conf)
        policies = {str(c.get("maxmemory-policy", "")) for c in nodes} - {""}
        bounded = any(int(c.get("maxmemory", 0) or 0) for c in nodes)
        if not bounded or not policies:
            return
        shown = ", ".join(sorted(policies))
        if self._ttl_ms is None and all(p.startswith("volatile-") for p in policies):
            log.warning("redis store %s: maxmemory-policy %s evicts only keys with an expiry and this "
                        "store sets none, so a full server refuses every put: add ttl=SECONDS to the "
                        "store URI, or use allkeys-lru", self.where, shown)
        elif self._ttl_ms is not None and policies != {"volatile-ttl"}:
            log.warning("redis store %s: ttl is set but maxmemory-policy is %s, so the server does not "
                        "evict in the order ttl gives (a chain from its tail); use volatile-ttl",
                        self.where, shown)

    @classmethod
    def from_uri(cls, uri: str, params: dict[str, str] | None = None) -> RedisStore:
        """Open the server a ``redis://``, ``rediss://`` or ``redis+cluster://`` URI names."""
        shown = redact(uri)  # messages never carry the password
        parts = urlsplit(uri)
        if params is None:
            params = {k: v for k, v in (p.split("=", 1) for p in parts.query.split("&") if "=" in p)}
        params = dict(params)
        scheme = parts.scheme
        if scheme not in SCHEMES:
            raise StoreError(f"bad redis store URI {shown!r}: scheme must be one of {', '.join(SCHEMES)}")
        prefix = params.pop("prefix", DEFAULT_PREFIX)
        try:
            timeout = float(params.pop("timeout", DEFAULT_TIMEOUT))
            cap = params.pop("capacity", None)
            capacity = parse_size(cap) if cap else None
            ttl_text = params.pop("ttl", None)
            ttl = float(ttl_text) if ttl_text else None
        except ValueError as exc:
            raise StoreError(f"bad redis store URI {shown!r}: {exc}") from None
        if not 0 < timeout < MAX_TIMEOUT_S:
            raise StoreError(f"bad redis store URI {shown!r}: timeout must be in (0, {MAX_TIMEOUT_S:.0f}) s")
        if ttl is not None and not 1 <= ttl <= MAX_TTL_S:
            raise StoreError(f"bad redis store URI {shown!r}: ttl must be in [1, {MAX_TTL_S}] seconds")
        tls = {k: params.pop(k) for k in _SSL_PARAMS if k in params}
        if params:
            raise StoreError(f"unknown redis store parameter(s): {', '.join(sorted(params))}")
        if tls and scheme != "rediss":
            raise StoreError(f"bad redis store URI {shown!r}: {', '.join(tls)} need rediss://")
        host, port, where = cls._address(shown, parts)
        kwargs: dict[str, Any] = {
            "host": host,
            "port": port,
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password is not None else None,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # No retries: a dead or hung server must surface within one timeout. A pooled
            # connection the server closed is still replaced when it is checked out.
            "retry": Retry(NoBackoff(), 0),
        }
        if scheme == "rediss":
            kwargs.update(ssl=True, **tls)
        client: redis.Redis | redis.cluster.RedisCluster
        try:
            if scheme == "redis+cluster":
                if parts.path.strip("/"):
                    raise StoreError(f"bad redis store URI {shown!r}: a cluster has only database 0")
                client = redis.cluster.RedisCluster(**kwargs)
            else:
                db = parts.path.strip("/") or "0"
                if not db.isdigit():
                    raise StoreError(f"bad redis store URI {shown!r}: database must be a number, got {db!r}")
                # RESP2, as redis-py before 8 spoke by default: loads read GET replies off the
                # socket themselves (``_get_direct``), and only RESP3 connections carry pushed
                # messages (maintenance notifications) between replies.
                client = redis.Redis(db=int(db), protocol=2, **kwargs)
        except redis.AuthenticationError as exc:  # the cluster client connects while it is built
            raise StoreError(f"redis store {where}: authentication failed: {_one_line(exc)}") from None
        except redis.exceptions.RedisClusterException as exc:  # no node answered, or not a cluster
            raise StoreUnavailable(f"redis store {where}: no cluster answers: {_one_line(exc)}") from None
        except redis.RedisError as exc:
            if _is_tls_error(exc):
                raise StoreError(f"redis store {where}: TLS handshake failed: {_one_line(exc)}") from None
            raise StoreUnavailable(f"redis store {where}: cannot reach server: {_one_line(exc)}") from None
        safe_uri = parts._replace(netloc=f"{where}").geturl() if parts.password else uri
        try:
            return cls(client, uri=safe_uri, where=where, prefix=prefix, capacity=capacity, ttl=ttl)
        except UnicodeError as exc:  # a host name no resolver accepts
            raise StoreError(f"bad redis store URI {shown!r}: host {where}: {exc}") from None

    @staticmethod
    def _address(shown: str, parts: SplitResult) -> tuple[str, int, str]:
        try:
            host = parts.hostname or "127.0.0.1"
            port = parts.port if parts.port is not None else DEFAULT_PORT
            if not 0 < port < 65536:
                raise ValueError(f"port must be 1..65535, got {port}")
        except ValueError as exc:
            raise StoreError(f"bad redis store URI {shown!r}: {exc}") from None
        shown = f"[{host}]" if ":" in host else host
        return host, port, f"{shown}:{port}"

    # -- internals ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn redis-py's errors into one-line StoreErrors naming the server."""
        try:
            yield
        except redis.AuthenticationError as exc:
            raise StoreError(f"redis store {self.where}: authentication failed: {_one_line(exc)}") from None
        except redis.TimeoutError as exc:
            raise StoreUnavailable(f"redis store {self.where}: {doing}: timed out ({_one_line(exc)})"
                                   ) from None
        except redis.ConnectionError as exc:
            if _is_tls_error(exc):  # wrong CA or certificate: configuration, not an outage
                raise StoreError(f"redis store {self.where}: TLS handshake failed: {_one_line(exc)}"
                                 ) from None
            raise StoreUnavailable(f"redis store {self.where}: {doing}: {_one_line(exc)}") from None
        except redis.RedisError as exc:
            raise StoreError(f"redis store {self.where}: {doing}: {_one_line(exc)}") from None

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _pipeline(self) -> Any:
        return self._client.pipeline(transaction=False)

    def _fits(self, size: int) -> bool:
        return self.capacity is None or size <= self.capacity

    def _each(self, doing: str, command: str, keys: Sequence[str]) -> list[Any]:
        """One pipelined round trip of ``command`` on every key (works across cluster slots)."""
        names = [self._key(k) for k in keys]
        if not names:
            return []
        with self._errors(doing):
            pipe = self._pipeline()
            for name in names:
                getattr(pipe, command)(name)
            return list(pipe.execute())

    def _get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._each("get", "get", keys)

    def _now_ms(self) -> int:
        """The server's clock now (``ttl``), as read at open and followed since."""
        return int(time.time() * 1000) + self._clock_offset_ms

    def _expires_at(self, now_ms: int, rank: int) -> int:
        """When the ``rank``-th of the keys used together at ``now_ms`` expires (with ``ttl``)."""
        assert self._ttl_ms is not None
        return now_ms + self._ttl_ms - min(rank * RANK_TICK_MS, self._ttl_ms // 2)

    # -- Store -------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        prepared = [(self._key(key), _one_value(parts)) for key, parts in items]
        send = [(name, data) for name, data in prepared if self._fits(len(data))]
        done: dict[int, bool] = {}
        if send:
            with self._errors("put"):
                pipe = self._pipeline()
                now = self._now_ms()
                for rank, (name, data) in enumerate(send):
                    at = None if self._ttl_ms is None else self._expires_at(now, rank)
                    pipe.set(name, data, pxat=at)
                # A per-item server error (OOM under maxmemory noeviction) is a refusal.
                results = pipe.execute(raise_on_error=False)
            it = iter(results)
            for i, (_, data) in enumerate(prepared):
                if self._fits(len(data)):
                    done[i] = next(it) is True
        return [done.get(i, False) for i in range(len(prepared))]

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        name = self._key(key)
        blob = bytes(data)
        if not self._fits(len(blob)):
            return False
        with self._errors("put"):
            try:
                at = None if self._ttl_ms is None else self._expires_at(self._now_ms(), 0)
                return self._client.set(name, blob, nx=True, pxat=at) is True
            except redis.ResponseError:  # OOM and the like: not stored
                return False

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        check_distinct([k for k, _ in items])
        prepared = [(self._key(key), bytes(data)) for key, data in items]
        send = [i for i, (_, blob) in enumerate(prepared) if self._fits(len(blob))]
        done = [False] * len(prepared)
        if send:
            with self._errors("put"):
                pipe = self._pipeline()
                at = None if self._ttl_ms is None else self._expires_at(self._now_ms(), 0)
                for i in send:
                    name, blob = prepared[i]
                    pipe.set(name, blob, nx=True, pxat=at)
                results = pipe.execute(raise_on_error=False)  # a per-item error (OOM) is a refusal
            for i, result in zip(send, results, strict=True):
                done[i] = result is True
        return done

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        if isinstance(self._client, redis.Redis):
            return self._get_direct(self._client.connection_pool, [self._key(k) for k in keys], buffers)
        out: list[int | None] = []
        for data, buf in zip(self._get(keys), buffers, strict=True):
            if data is None:
                out.append(None)
                continue
            out.append(copy_into(data, buf))
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._get(keys)

    def _get_direct(self, pool: Any, names: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """One pipelined round trip of GETs on one server, each value read from the socket
        into its buffer (``_resp``: redis-py's parser would hold the GIL in 64 KiB bursts
        while the engine's thread waits). A connection left mid-reply is closed, never pooled."""
        with self._errors("get"):
            conn = _checkout(pool)
            clean = False
            try:
                conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
                sock = conn._sock
                if sock is None:  # closed by another thread meanwhile (close())
                    raise redis.ConnectionError("connection closed")
                reader = BulkReader(sock)
                out = [reader.read_into(buf) for buf in buffers]
                reader.done()
                clean = True
                return out
            except ReplyError as exc:  # the error class redis-py gives it (LOADING: unavailable)
                raise conn._parser.parse_error(str(exc)) from None
            except ProtocolError as exc:
                raise redis.ConnectionError(str(exc)) from None
            except TimeoutError as exc:
                raise redis.TimeoutError(str(exc) or "read timed out") from None
            except OSError as exc:
                raise redis.ConnectionError(str(exc)) from None
            finally:
                if not clean:
                    conn.disconnect()
                pool.release(conn)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._each("exists", "exists", keys)]

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        names = [self._key(k) for k in keys]
        if not names:
            return []
        with self._errors("exists"):
            pipe = self._pipeline()
            replies = self._queue_touches(pipe, names, touch)
            return replies(iter(pipe.execute()))

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        # One pipeline: the touches, then the GETs (a GET counts for LRU/LFU as a use).
        names = [self._key(k) for k in keys]
        read_names = [self._key(k) for k in reads]
        if not read_names:
            return self.touch_many(keys, touch), []
        with self._errors("exists"):
            pipe = self._pipeline()
            replies = self._queue_touches(pipe, names, touch)
            for name in read_names:
                pipe.get(name)
            answers = iter(pipe.execute())
            found = replies(answers)
            return found, list(answers)

    def _queue_touches(self, pipe: Any, names: Sequence[str],
                       touch: Sequence[bool] | None) -> Callable[[Iterator[Any]], list[bool]]:
        """Queue on ``pipe`` what ``touch_many`` sends; the function returned reads its replies.

        EXISTS leaves a key's LRU/LFU clock alone; TOUCH answers the same and updates it. (Redis
        evicts by sampling: keys touched together keep no order among themselves, unless
        ``ttl`` orders them by expiry.) With ``ttl``: EXISTS, and for the marked keys
        PEXPIREAT ... NX (a key without expiry, written before ``ttl`` was set, gets one) then
        ... GT: a use only ever extends a key's life (a key given twice keeps its first rank),
        and counts for LRU/LFU as TOUCH does."""
        marks = touch if touch is not None else [True] * len(names)
        if len(marks) != len(names):
            raise ValueError(f"{len(names)} keys but {len(marks)} touch marks")
        if self._ttl_ms is None:
            for name, t in zip(names, marks, strict=True):
                (pipe.touch if t else pipe.exists)(name)
            return lambda replies: [bool(next(replies)) for _ in marks]
        now = self._now_ms()
        rank = 0
        for name, t in zip(names, marks, strict=True):
            pipe.exists(name)
            if t:
                at = self._expires_at(now, rank)
                pipe.pexpireat(name, at, nx=True)
                pipe.pexpireat(name, at, gt=True)
                rank += 1

        def read(replies: Iterator[Any]) -> list[bool]:
            out: list[bool] = []
            for t in marks:
                out.append(bool(next(replies)))
                if t:
                    next(replies)
                    next(replies)
            return out

        return read

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(int(n) for n in self._each("delete", "delete", keys))

    def _sizes(self, names: list[bytes]) -> Iterator[tuple[str, int]]:
        """(key without prefix, size) of the names that still exist, one round trip per chunk."""
        cut = len(self._prefix_bytes)
        for start in range(0, len(names), SCAN_CHUNK):
            chunk = names[start : start + SCAN_CHUNK]
            with self._errors("scan"):
                pipe = self._pipeline()
                for name in chunk:
                    pipe.exists(name)
                    pipe.strlen(name)
                res = pipe.execute()
            for i, name in enumerate(chunk):
                if res[2 * i]:  # STRLEN of a key deleted since SCAN is 0: skip it
                    yield name[cut:].decode(), int(res[2 * i + 1])

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        match = _glob_escape(self.prefix + prefix) + "*"
        with self._errors("scan"):
            names = sorted(set(self._client.scan_iter(match=match, count=SCAN_CHUNK)))
        return self._sizes(names)

    def stats(self) -> StoreStats:
        objects = size = 0
        for _, n in self.scan():
            objects += 1
            size += n
        with self._errors("stats"):
            evictions = sum(int(s.get("evicted_keys", 0)) for s in self._per_node(self._client.info("stats")))
            capacity = self.capacity if self.capacity is not None else self._maxmemory()
        return StoreStats(objects, size, capacity, evictions)

    @staticmethod
    def _per_node(info: Any) -> list[dict[str, Any]]:
        """INFO from one server is a dict; from a cluster, a dict of them by node."""
        if isinstance(info, dict) and info and all(isinstance(v, dict) for v in info.values()):
            return list(info.values())
        return [info] if isinstance(info, dict) else []

    def _maxmemory(self) -> int | None:
        """The server's maxmemory (summed over a cluster's nodes); None if unset or hidden."""
        try:
            conf = self._client.config_get("maxmemory")
        except redis.ResponseError:  # CONFIG disabled, as on many managed services
            return None
        total = sum(int(c.get("maxmemory", 0)) for c in self._per_node(conf))
        return total or None

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._client.close()


def _checkout(pool: Any) -> Any:
    """A connected connection from the pool (redis-py before 5.3 wants a command name, later
    versions warn about one)."""
    return pool.get_connection("GET") if _POOL_WANTS_NAME else pool.get_connection()


_POOL_PARAMS = inspect.signature(redis.ConnectionPool.get_connection).parameters
_POOL_WANTS_NAME = "command_name" in _POOL_PARAMS and \
    _POOL_PARAMS["command_name"].default is inspect.Parameter.empty
