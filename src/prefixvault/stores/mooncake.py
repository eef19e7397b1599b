"""A store on Mooncake Store: ``mooncake_master`` plus the clients that hold its memory.

Objects move between this process and the segments that hold them through the transfer
engine (TCP here, RDMA where the hardware has it), always from or into memory registered
with the engine. This store owns two registered regions: one it copies ordinary memory
through, and one it lends through ``staging_buffer``; objects a caller builds in lent memory
are put, and objects got into it arrive, with no copy on this side (the vault does both).

Where data lives. Mooncake keeps objects in the segments that clients mount. An engine that
mounts a segment (``segment=4GiB``, Mooncake's "embedded" mode) takes its objects with it
when it exits. The default is ``segment=0`` ("standalone-store" in vLLM's words): engines
mount nothing and the objects live in a separate, long-lived ``mooncake_client`` process
that mounts the memory, so a consumer finds what a producer left after the producer is gone.

``mooncake://MASTER_HOST:PORT?protocol=tcp&segment=0&timeout=5``
``mooncake://?config=/path/mooncake.json`` or bare ``mooncake://`` with ``MOONCAKE_CONFIG_PATH``
set (the JSON file vLLM's Mooncake connectors read).

Behaviour that differs from the local store:
- objects are at least one byte (Mooncake refuses empty objects; put reports False);
- ``delete_many`` removes past Mooncake's read lease (``force``): a reader racing a delete
  may get bytes that fail the codec's checksum, which the vault counts as a miss;
- an overwrite of unchanged size is written in place (Mooncake's upsert reuses the replica),
  so a read racing it may return parts of both versions; the vault verifies every object and
  reads a failed one once more before it removes anything (``loading.Loader._wrong_again``);
- a master restart forgets every object (unless the master runs with HA/snapshots);
- eviction is the master's (approximate LRU at a high watermark), not exact LRU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from prefixvault.guard import Guard
from prefixvault.lane import Failure, Lane
from prefixvault.stores.base import (
    Buffer,
    Store,
    StoreError,
    StoreStats,
    StoreUnavailable,
    check_distinct,
    check_key,
    redact,
)
from prefixvault.units import parse_size

log = logging.getLogger("prefixvault.stores.mooncake")
#: Calls into Mooncake queued at most on a lane (one runs at a time; past it a call fails at once).
_CALLS = 1024

DEFAULT_MASTER_PORT = 50051
DEFAULT_ADMIN_PORT = 9003  # mooncake_master --metrics_port: its HTTP admin and metrics server
DEFAULT_TIMEOUT = 5.0
#: A timeout beyond this is a typo (``inf`` would make a stalled master hang the engine).
MAX_TIMEOUT_S = 3600.0
DEFAULT_PREFIX = "pv/"
DEFAULT_STAGING = 128 << 20
DEFAULT_LOCAL_BUFFER = 16 << 20
#: Staging offsets are aligned to this many bytes.
ALIGN = 64
#: Keys per admin request while scanning.
SCAN_CHUNK = 200
#: A lookup's reads of unknown size (``touch_and_get``: tail indexes, 1.6 KiB when full) go into
#: this much staging memory each with no size asked first, so they are one call, not one per key
#: and one more. A larger object costs a size query and a read more (and Mooncake logs that the
#: buffer was too small).
GUESSED_READ = 4 << 10

# Mooncake's error codes (mooncake-store types.h) that this store tells apart.
#: What a get into a buffer smaller than the object answers (Mooncake's INVALID_PARAMS).
INVALID_PARAMS = -600
#: No complete replica right now (another client is replacing the object): not readable.
REPLICA_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705

_PARAMS = ("protocol", "device", "segment", "buffer", "staging", "host", "metadata", "admin",
           "timeout", "capacity", "prefix", "config")  # fmt: skip


@dataclass(frozen=True)
class ClientConfig:
    """What one Mooncake client is set up with; equal configs share one client per process."""

    master: str
    local_hostname: str
    metadata_server: str
    protocol: str
    device: str
    segment: int
    local_buffer: int
    timeout: float


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _advertised_host(master_host: str, master_port: int) -> str:
    """The address peers reach this client at: loopback for a loopback master, else
    ``VLLM_HOST_IP`` if set, else the address this machine uses to reach the master."""
    if _is_loopback(master_host):
        return "127.0.0.1"
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_host, master_port))
        return str(s.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


def _split_hostport(text: str, default_port: int, what: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        host, port = text, str(default_port)
    if not port.isdigit() or not host:
        raise StoreError(f"bad mooncake {what} address {text[:100]!r}: expected host:port")
    return host.strip("[]"), int(port)


def _check_reachable(host: str, port: int, timeout: float, what: str) -> None:
    """Fail in seconds: Mooncake's own setup retries an unreachable master for minutes."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise StoreUnavailable(
            f"mooncake store: {what} {host}:{port} is not reachable ({exc.strerror or exc}); "
            "start mooncake_master or fix the address"
        ) from None


def _set_timeouts(timeout: float) -> None:
    """Bound Mooncake's RPCs and TCP transfers by our timeout (unless the user set them)."""
    ms, sec = str(max(1, int(timeout * 1000))), str(max(1, round(timeout)))
    for name, value in (("MC_RPC_TIMEOUT_MS", ms), ("MC_RPC_CONNECT_TIMEOUT_MS", ms),
                        ("MC_TCP_PROGRESS_TIMEOUT_SEC", sec), ("MC_TCP_STATUS_TIMEOUT_SEC", sec),
                        ("MC_STORE_CLIENT_SETUP_RETRIES", "1")):  # fmt: skip
        os.environ.setdefault(name, value)


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One call into Mooncake, run on a deadline lane; its caller waits on ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


class _Deadline:
    """Runs calls into Mooncake on one lane (``prefixvault.lane``) and stops waiting after a
    deadline. A client has two: one for every call, one for existence checks made beside a read.

    Mooncake bounds most waits by the timeouts set above, but not all (a handshake with a
    stalled peer waits a minute per object). A call that overruns is left to finish on its
    own; until it does, every new call fails at once instead of queueing behind it, so at
    most one call per lane is ever stuck and no caller waits longer than its deadline. Nothing else
    touches the registered regions meanwhile, so a late transfer cannot land in memory in use.
    """

    def __init__(self, name: str) -> None:
        self._lane: Lane[_Call] = Lane(name, self._run, self._refuse, capacity=_CALLS, guard=Guard())
        self._lock = threading.Lock()  # callers of one lane may be several threads
        self._stuck: concurrent.futures.Future[Any] | None = None  # under _lock
        self._stuck_what = ""

    @staticmethod
    def _run(calls: list[_Call]) -> None:
        for call in calls:
            if not call.future.set_running_or_notify_cancel():
                continue
            try:
                call.future.set_result(call.fn())
            except BaseException as exc:  # handed to the waiting caller; the lane goes on
                call.future.set_exception(exc)

    @staticmethod
    def _refuse(calls: list[_Call], reason: Failure, error: BaseException | None) -> None:
        for call in calls:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                call.future.set_exception(StoreUnavailable(f"mooncake call not run ({reason.value})"))

    def run(self, what: str, seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.finish(what, self.start(what, fn, *args, **kwargs), time.monotonic() + seconds, seconds)

    def start(self, what: str, fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; its answer is ``finish``'s."""
        with self._lock:
            if self._stuck is not None:
                if not self._stuck.done():
                    raise StoreUnavailable(f"{self._stuck_what} has not returned; no new call until it does")
                self._stuck = None
        call = _Call(fn=lambda: fn(*args, **kwargs), future=concurrent.futures.Future())
        refused = self._lane.put(call)
        if refused is not None:
            raise StoreUnavailable(f"{what}: not run ({refused.value})")
        return call.future

    def finish(self, what: str, future: concurrent.futures.Future[Any], deadline: float,
               budget: float) -> Any:
        """The answer of a call ``start`` queued, waiting until ``deadline`` (monotonic) at most:
        ``budget`` seconds after it was queued."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._stuck, self._stuck_what = future, what
            raise StoreUnavailable(f"{what} timed out after {budget:.1f} s") from None

    @property
    def stuck(self) -> bool:
        with self._lock:
            return self._stuck is not None and not self._stuck.done()

    @property
    def stuck_what(self) -> str:
        return self._stuck_what

    def close(self, timeout: float = 0.0) -> bool:
        """Stop taking calls; whether none is still running after ``timeout`` seconds."""
        return self._lane.close(timeout)


class _Client:
    """One set-up Mooncake client and its registered regions, shared in a process."""

    def __init__(self, config: ClientConfig, staging: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        _set_timeouts(config.timeout)
        self.config = config
        self.deadline = _Deadline("mooncake")
        #: Calls that touch no registered memory (existence checks) run here beside ``deadline``'s,
        #: so a lookup's check and its reads take one round trip of wall time, not two.
        self.checks = _Deadline("mooncake-checks")
        self.api: Any = MooncakeDistributedStore()
        rc = self.call("setup", 0, self.api.setup, config.local_hostname, config.metadata_server,
                       config.segment, config.local_buffer, config.protocol, config.device, config.master)
        if rc != 0:
            raise StoreUnavailable(f"mooncake store {config.master}: client setup failed (code {rc})")
        self.lock = threading.Lock()
        self.users = 0
        #: keys whose put session this client may still hold: their revoke could not be sent
        #: (a call was stuck) or failed. The client refuses a new session on such a key, so
        #: each conditional put revokes them first. Under ``lock``.
        self.unrevoked: set[str] = set()
        #: where this store copies objects it was handed in ordinary memory
        self.arena = _Region(self, "staging")
        #: what ``staging_buffer`` lends to callers, who fill it (or read it) in place
        self.lent = _Region(self, "lent")
        self.arena.grow(staging)

    def call(self, what: str, nbytes: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` within three timeouts (Mooncake's own bounds fire first; a reconnect
        may take two), plus one timeout per GiB it moves."""
        seconds = self.config.timeout * (3 + nbytes / (1 << 30))
        return self.deadline.run(f"mooncake store {self.config.master}: {what}", seconds, fn, *args, **kwargs)

    def check_beside(self, what: str, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """Start ``fn(*args)``, a call that touches no registered memory, on the checks lane;
        its answer is the returned function's (within ``call``'s bounds from now)."""
        what = f"mooncake store {self.config.master}: {what}"
        budget = 3 * self.config.timeout
        deadline = time.monotonic() + budget
        future = self.checks.start(what, fn, *args)
        return lambda: self.checks.finish(what, future, deadline, budget)

    def close(self) -> None:
        # A check still running (one whose caller failed first) ends within its deadline.
        checks_idle = self.checks.close(3 * self.config.timeout)
        if self.deadline.stuck or not checks_idle:
            # The stuck call may still write into our regions, or use the client: keep them
            # alive for the life of the process rather than free memory under it.
            _RETIRED.append(self)
            return
        with contextlib.suppress(Exception):
            self.arena.release()
            self.lent.release()
            self.call("close", 0, self.api.close)
        self.deadline.close()


#: Clients closed while a call was stuck inside Mooncake; never freed.
_RETIRED: list[_Client] = []


class _Region:
    """Memory registered with the transfer engine, grown on demand, pages touched once."""

    def __init__(self, client: _Client, name: str) -> None:
        self.client = client
        self.name = name
        self.mem = np.empty(0, np.uint8)

    @property
    def base(self) -> int:
        return int(self.mem.ctypes.data)

    def holds(self, ptr: int, nbytes: int) -> bool:
        return nbytes > 0 and self.mem.nbytes > 0 and self.base <= ptr <= self.base + self.mem.nbytes - nbytes

    def grow(self, nbytes: int) -> None:
        if nbytes <= self.mem.nbytes:
            return
        self.release()
        mem = np.ones(nbytes, np.uint8)  # touch every page now, not during a transfer
        c = self.client
        rc = c.call("register", 0, c.api.register_buffer, mem.ctypes.data, mem.nbytes)
        if rc != 0:
            raise StoreError(f"mooncake store {c.config.master}: cannot register {nbytes} bytes "
                             f"of {self.name} memory (code {rc})")
        self.mem = mem

    def release(self) -> None:
        if self.mem.nbytes:
            self.client.call("unregister", 0, self.client.api.unregister_buffer, self.base)
            self.mem = np.empty(0, np.uint8)


_clients: dict[ClientConfig, _Client] = {}
_clients_lock = threading.Lock()


def _acquire(config: ClientConfig, staging: int) -> _Client:
    with _clients_lock:
        client = _clients.get(config)
        if client is None:
            client = _clients[config] = _Client(config, staging)
        with client.lock:
            client.arena.grow(staging)
        client.users += 1
        return client


def _release(client: _Client) -> None:
    with _clients_lock:
        client.users -= 1
        if client.users == 0 and _clients.get(client.config) is client:
            del _clients[client.config]
            client.close()


def _bytes(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _chunks(sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """Indices grouped so that each group's aligned sizes fit ``limit`` (an oversize item alone)."""
    group: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if group and used + _aligned(n) > limit:
            yield group
            group, used = [], 0
        group.append(i)
        used += _aligned(n)
    if group:
        yield group


class MooncakeStore(Store):
    """Objects under ``prefix + key`` in a Mooncake Store cluster."""

    remote = True
    pipelines = True  # (``touch_and_get``: the check and the reads at once)

    def __init__(self, client: _Client, *, uri: str, admin: str, prefix: str, capacity: int | None,
                 timeout: float) -> None:  # fmt: skip
        self.uri = uri
        self.where = client.config.master
        self.admin = admin
        self.prefix = prefix
        self.capacity = capacity
        self.timeout = timeout
        self._client: _Client | None = client

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def from_uri(cls, uri: str, params: dict[str, str]) -> MooncakeStore:
        parts = urlsplit(uri)
        params = dict(params)
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise StoreError(f"unknown mooncake store parameter(s): {', '.join(unknown)}")
        file_config = cls._file_config(parts.netloc, params.pop("config", None))
        settings = {**file_config, **params}
        try:
            master_text = parts.netloc or str(settings.get("master_server_address", ""))
            if not master_text:
                raise StoreError("mooncake store: no master address: use mooncake://HOST:PORT, "
                                 "?config=FILE or MOONCAKE_CONFIG_PATH")
            host, port = _split_hostport(master_text, DEFAULT_MASTER_PORT, "master")
            timeout = float(settings.get("timeout", DEFAULT_TIMEOUT))
            if not 0 < timeout < MAX_TIMEOUT_S:
                raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT_S:.0f}) seconds")
            segment = parse_size(str(settings.get("segment", settings.get("global_segment_size", 0))))
            local_buffer = parse_size(str(settings.get("buffer", settings.get("local_buffer_size",
                                                                              DEFAULT_LOCAL_BUFFER))))
            staging = parse_size(str(settings.get("staging", DEFAULT_STAGING)))
            cap = settings.get("capacity")
            capacity = parse_size(str(cap)) if cap else None
        except ValueError as exc:
            raise StoreError(f"bad mooncake store URI {redact(uri)!r}: {exc}") from None
        protocol = str(settings.get("protocol", "tcp"))
        if protocol not in ("tcp", "rdma"):
            raise StoreError(f"bad mooncake store URI {redact(uri)!r}: protocol must be tcp or rdma, "
                             f"got {protocol[:100]!r}")
        admin_host, admin_port = _split_hostport(
            str(settings.get("admin", f"{host}:{DEFAULT_ADMIN_PORT}")), DEFAULT_ADMIN_PORT, "admin")
        _check_reachable(host, port, timeout, "master")
        config = ClientConfig(
            master=f"{host}:{port}",
            local_hostname=str(settings.get("host", settings.get("local_hostname", "")))
            or _advertised_host(host, port),
            metadata_server=str(settings.get("metadata", settings.get("metadata_server", "P2PHANDSHAKE"))),
            protocol=protocol,
            device=str(settings.get("device", settings.get("device_name", ""))),
            segment=segment,
            local_buffer=local_buffer,
            timeout=timeout,
        )
        try:
            client = _acquire(config, staging)
        except ImportError as exc:
            raise StoreError(f"mooncake:// needs Mooncake: pip install 'prefixvault[mooncake]' (GPU) or "
                             f"'prefixvault[mooncake-cpu]': {exc}"
                             ) from None
        prefix = str(settings.get("prefix", DEFAULT_PREFIX))
        store = cls(client, uri=uri, admin=f"{admin_host}:{admin_port}", prefix=prefix,
                    capacity=capacity, timeout=timeout)  # fmt: skip
        if segment == 0 and store._master_capacity() == 0:
            log.warning("mooncake store %s: no memory is mounted yet; puts fail until a mooncake_client "
                        "(or an engine with segment=SIZE) mounts some", config.master)
        return store

    @staticmethod
    def _file_config(netloc: str, path: str | None) -> dict[str, Any]:
        """vLLM's Mooncake JSON config: from ``?config=`` or, for a bare URI, MOONCAKE_CONFIG_PATH."""
        if path is None and not netloc:
            path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path:
            return {}
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"mooncake store: cannot read config file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise StoreError(f"mooncake store: config file {path} must hold a JSON object")
        return data

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _usable(client: _Client) -> None:
        """Refuse before touching registered memory that a stuck call may still be using."""
        if client.deadline.stuck:
            raise StoreUnavailable(f"mooncake store {client.config.master}: {client.deadline.stuck_what} "
                                   "has not returned; no new call until it does")

    def _api(self) -> _Client:
        if self._client is None:
            raise StoreError(f"mooncake store {self.where}: closed")
        return self._client

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _fits(self, size: int) -> bool:
        return size > 0 and (self.capacity is None or size <= self.capacity)

    def _fail(self, doing: str, code: int) -> StoreError:
        return StoreError(f"mooncake store {self.where}: {doing} failed (code {code})")

    def _admin_get(self, path: str) -> bytes:
        try:
            with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=self.timeout) as resp:
                body: bytes = resp.read()
                return body
        except (OSError, urllib.error.URLError) as exc:
            raise StoreError(f"mooncake store {self.where}: master admin http://{self.admin}: {exc}"
                             ) from None

    def _metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self._admin_get("/metrics").decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def _master_capacity(self) -> int:
        with contextlib.suppress(StoreError):
            return int(self._metrics().get("master_total_capacity_bytes", 0))
        return -1

    # -- Store ---------------------------------------------------------------------------

    def staging_buffer(self, nbytes: int) -> memoryview | None:
        """Registered memory lent to the caller: objects it builds there are put, and objects
        got into it arrive, with no copy on this side. Valid until the next call that lends."""
        client = self._api()
        with client.lock:
            if client.deadline.stuck:  # a late transfer may still land in lent memory
                return None
            try:
                if nbytes > client.lent.mem.nbytes:
                    client.lent.grow(max(nbytes, 2 * client.lent.mem.nbytes))
            except (StoreError, MemoryError) as exc:  # ordinary memory will do, one copy dearer
                log.warning("mooncake store %s: cannot lend %d bytes: %s", self.where, nbytes, exc)
                return None
            return client.lent.mem.data[:nbytes]

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        names = [self._key(k) for k, _ in items]
        sizes = [sum(memoryview(p).nbytes for p in parts) for _, parts in items]
        out = [False] * len(items)
        last = {name: i for i, name in enumerate(names)}  # a key twice in a batch: the last one wins
        todo = [i for i, n in enumerate(sizes) if self._fits(n) and last[names[i]] == i]
        client = self._api()
        with client.lock:
            self._usable(client)
            where = {i: self._in_place(client, items[i][1], sizes[i]) for i in todo}
            direct = {i: ptr for i, ptr in where.items() if ptr is not None}
            copied = [i for i in todo if i not in direct]
            groups = list(_chunks([sizes[i] for i in copied], client.arena.mem.nbytes)) or [[]]
            for n, group in enumerate(groups):
                idx = [copied[g] for g in group]
                client.arena.grow(sum(_aligned(sizes[i]) for i in idx))
                ptrs, off = [], 0
                for i in idx:
                    pos = off
                    for part in items[i][1]:
                        view = np.frombuffer(part, np.uint8) if memoryview(part).nbytes else None
                        if view is not None:
                            client.arena.mem[pos : pos + view.nbytes] = view
                            pos += view.nbytes
                    ptrs.append(client.arena.base + off)
                    off += _aligned(sizes[i])
                if n == 0:  # objects already in registered memory go with the first batch
                    idx, ptrs = [*direct, *idx], [*direct.values(), *ptrs]
                if not idx:
                    continue
                codes = client.call("put", sum(sizes[i] for i in idx), client.api.batch_upsert_from,
                                    [names[i] for i in idx], ptrs, [sizes[i] for i in idx])
                for i, code in zip(idx, codes, strict=True):
                    out[i] = code == 0
        for i, name in enumerate(names):
            out[i] = out[last[name]]
        return out

    @staticmethod
    def _in_place(client: _Client, parts: Sequence[Buffer], size: int) -> int | None:
        """Where an object lies whole in lent memory (its parts back to back), else None."""
        start = end = None
        for part in parts:
            n = memoryview(part).nbytes
            if not n:
                continue
            ptr = int(np.frombuffer(part, np.uint8).ctypes.data)
            if end is not None and ptr != end:
                return None
            start = ptr if start is None else start
            end = ptr + n
        return start if start is not None and client.lent.holds(start, size) else None

    @staticmethod
    def _revoke(client: _Client, names: Sequence[str]) -> None:
        """End this client's put sessions on ``names`` (under ``client.lock``); a revoke that
        cannot be sent now is sent before the next conditional put. The client refuses to
        revoke another's session, so revoking more than this call reserved is safe."""
        if not names:
            return
        try:
            client.call("put", 0, client.api.batch_put_session_revoke, list(names))
        except StoreError:
            client.unrevoked.update(names)
        else:
            client.unrevoked.difference_update(names)

    def _revoke_leftovers(self, client: _Client) -> None:
        if client.unrevoked:
            self._revoke(client, sorted(client.unrevoked))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        name = self._key(key)
        view = np.frombuffer(data, np.uint8) if memoryview(data).nbytes else np.empty(0, np.uint8)
        if not self._fits(view.nbytes):
            return False
        client = self._api()
        with client.lock:
            # A put session reserves the key at the master: of racing callers one gets it,
            # the others hear OBJECT_ALREADY_EXISTS; the object is readable only after end.
            self._usable(client)
            self._revoke_leftovers(client)
            ended = -1
            try:
                (code,) = client.call("put", 0, client.api.batch_put_session_start, [name], [view.nbytes])
            except BaseException:
                self._revoke(client, [name])  # whether it reserved the key is unknown
                raise
            if code != 0:
                return False
            try:
                client.arena.grow(view.nbytes)
                client.arena.mem[: view.nbytes] = view
                (written,) = client.call("put", view.nbytes, client.api.batch_put_from_multi_buffer_ranges,
                                         [name], [[client.arena.base]], [[view.nbytes]], [[0]])
                if written >= 0:
                    (ended,) = client.call("put", 0, client.api.batch_put_session_end, [name])
            finally:
                if ended != 0:  # never leave the key reserved by a session nobody will end
                    self._revoke(client, [name])
            return ended == 0

    def put_if_absent_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """``put_if_absent`` for a batch: one put session reserves every key (one winner per key
        among racing callers), ranged puts write the reserved ones from the arena (one per
        arena's worth, so the arena never grows past its size for a batch), one end makes them
        readable; a key reserved and not ended is revoked (``_revoke``), every key asked for if
        the start raised."""
        check_distinct([k for k, _ in items])
        out = [False] * len(items)
        names = [self._key(k) for k, _ in items]
        views = [np.frombuffer(d, np.uint8) if memoryview(d).nbytes else np.empty(0, np.uint8)
                 for _, d in items]
        want = [i for i, v in enumerate(views) if self._fits(v.nbytes)]
        if not want:
            return out
        client = self._api()
        with client.lock:
            self._usable(client)
            self._revoke_leftovers(client)
            won: list[int] = []
            ended: dict[int, int] = {}
            try:
                try:
                    codes = client.call("put", 0, client.api.batch_put_session_start,
                                        [names[i] for i in want], [views[i].nbytes for i in want])
                    won = [i for i, code in zip(want, codes, strict=True) if code == 0]
                except BaseException:
                    won = want  # which keys it reserved is unknown: revoke them all
                    raise
                done: list[int] = []
                for group in _chunks([views[i].nbytes for i in won], client.arena.mem.nbytes):
                    idx = [won[g] for g in group]
                    offsets, total = [], 0
                    for i in idx:  # each object starts aligned, as put_many places them
                        offsets.append(total)
                        total += _aligned(views[i].nbytes)
                    client.arena.grow(total)  # past the arena's size only for one object alone
                    for i, off in zip(idx, offsets, strict=True):
                        client.arena.mem[off : off + views[i].nbytes] = views[i]
                    written = client.call("put", total, client.api.batch_put_from_multi_buffer_ranges,
                                          [names[i] for i in idx], [[client.arena.base + o] for o in offsets],
                                          [[views[i].nbytes] for i in idx], [[0] for _ in idx])
                    done += [i for i, w in zip(idx, written, strict=True) if w >= 0]
                if done:
                    ends = client.call("put", 0, client.api.batch_put_session_end, [names[i] for i in done])
                    ended = dict(zip(done, ends, strict=True))
            finally:  # never leave a key reserved by a session nobody will end
                self._revoke(client, [names[i] for i in won if ended.get(i, -1) != 0])
            for i in won:
                out[i] = ended.get(i, -1) == 0
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        names = [self._key(k) for k in keys]
        out: list[int | None] = [None] * len(keys)
        if len(set(names)) < len(names):  # Mooncake mishandles a key twice in one batch
            # Fetch each key once, into the largest of its buffers, then copy to the others
            # that can hold it; a buffer too small gets the size and no bytes, as promised.
            largest: dict[str, int] = {}
            for i, name in enumerate(names):
                if name not in largest or buffers[i].nbytes > buffers[largest[name]].nbytes:
                    largest[name] = i
            once = sorted(largest.values())
            got = dict(zip(once, self.get_into([keys[i] for i in once], [buffers[i] for i in once]),
                           strict=True))  # fmt: skip
            for i, name in enumerate(names):
                j = largest[name]
                size = out[i] = got[j]
                if i != j and size is not None and size <= min(buffers[i].nbytes, buffers[j].nbytes):
                    _bytes(buffers[i])[:size] = _bytes(buffers[j])[:size]
            return out
        client = self._api()
        with client.lock:
            self._usable(client)
            direct: list[tuple[int, int]] = []
            staged: list[tuple[int, int]] = []
            for i, buf in enumerate(buffers):
                ptr = int(np.frombuffer(_bytes(buf), np.uint8).ctypes.data) if buf.nbytes else 0
                (direct if client.lent.holds(ptr, buf.nbytes) else staged).append((i, ptr))
            if direct:
                self._get_direct(client, names, buffers, direct, out)
            for group in _chunks([buffers[i].nbytes for i, _ in staged], client.arena.mem.nbytes):
                self._get_staged(client, names, buffers, [staged[g][0] for g in group], out)
        return out

    def _get_direct(self, client: _Client, names: list[str], buffers: Sequence[memoryview],
                    direct: list[tuple[int, int]], out: list[int | None]) -> None:  # fmt: skip
        sizes = [buffers[i].nbytes for i, _ in direct]
        codes = client.call("get", sum(sizes), client.api.batch_get_into, [names[i] for i, _ in direct],
                            [p for _, p in direct], sizes)
        for (i, _), code in zip(direct, codes, strict=True):
            out[i] = self._size_of(client, names[i], code, buffers[i].nbytes)

    def _get_staged(self, client: _Client, names: list[str], buffers: Sequence[memoryview],
                    idx: list[int], out: list[int | None]) -> None:  # fmt: skip
        room = [max(1, buffers[i].nbytes) for i in idx]
        for i, (o, size) in zip(idx, self._into_arena(client, [names[i] for i in idx], room), strict=True):
            out[i] = size
            if size is not None and 0 < size <= buffers[i].nbytes:
                _bytes(buffers[i])[:size] = client.arena.mem.data[o : o + size]

    def _into_arena(self, client: _Client, names: Sequence[str],
                    room: Sequence[int]) -> list[tuple[int, int | None]]:
        """One ``batch_get_into`` of each object into ``room[i]`` bytes of the staging arena
        (grown to hold them all; caller holds ``client.lock``): per object, its offset there and
        its size (``_size_of``: None where missing, larger than its room where it did not fit)."""
        client.arena.grow(sum(_aligned(n) for n in room))
        offs, off = [], 0
        for n in room:
            offs.append(off)
            off += _aligned(n)
        codes = client.call("get", sum(room), client.api.batch_get_into, list(names),
                            [client.arena.base + o for o in offs], list(room))
        return [(o, self._size_of(client, name, code, n))
                for name, o, code, n in zip(names, offs, codes, room, strict=True)]

    def _size_of(self, client: _Client, name: str, code: int, buffer_size: int) -> int | None:
        if code >= 0:
            return int(code)
        if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
            return None
        if code == INVALID_PARAMS:  # too big for the caller's buffer: say how big
            size = int(client.call("get", 0, client.api.get_size, name))
            # Only a size the buffer cannot hold is an answer: anything else means the object
            # changed in between, and nothing was copied.
            return size if size > buffer_size else None
        raise self._fail(f"get {name}", code)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        names = [self._key(k) for k in keys]
        client = self._api()
        with client.lock:
            sizes = [int(client.call("get", 0, client.api.get_size, n)) for n in names]
        for n, s in zip(names, sizes, strict=True):
            if s < 0 and s not in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
                raise self._fail(f"get {n}", s)
        bufs = [memoryview(bytearray(max(s, 0))) for s in sizes]
        want = [i for i, s in enumerate(sizes) if s > 0]
        got = self.get_into([keys[i] for i in want], [bufs[i] for i in want])
        out: list[bytes | None] = [None] * len(keys)
        for i, size in zip(want, got, strict=True):
            if size is not None and size == bufs[i].nbytes:
                out[i] = bytes(bufs[i])
        return out

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        """One round trip of wall time: the existence check of the keys not read (a use:
        Mooncake grants a lease) runs on the checks lane while ``reads`` are read, each into its
        size in ``sizes`` or, unknown, ``GUESSED_READ`` bytes; a read answers whether its key
        exists (an object not readable right now, or changed between two reads, counts as
        missing: a miss). Mooncake has no call that checks some keys and reads others, and
        checking by reading would move every object checked (a lookup's probes are KV blocks).
        Where the checks lane is stuck, the check runs before the reads instead."""
        expected: dict[str, int] = {}
        for k, n in zip(reads, sizes if sizes is not None else [0] * len(reads), strict=True):
            expected[k] = max(expected.get(k, 0), n)
        wanted = list(expected)
        checked = [k for k in dict.fromkeys(keys) if k not in expected]
        client = self._api()
        self._usable(client)
        started: Callable[[], Any] | None = None
        found_now: list[bool] = []
        if checked and not client.checks.stuck:
            names = [self._key(k) for k in checked]
            started = client.check_beside("exists", client.api.batch_is_exist, names)
        elif checked:
            found_now = self.exists_many(checked)
        try:
            got = dict(zip(wanted, self._read_sized(wanted, list(expected.values())), strict=True))
        except BaseException:
            if started is not None:
                with contextlib.suppress(Exception):  # (its deadline marks it stuck if it overran)
                    started()
            raise
        if started is not None:
            found_now = self._exists(started())
        found = {**dict(zip(checked, found_now, strict=True)), **{k: b is not None for k, b in got.items()}}
        return [found[k] for k in keys], [got.get(k) for k in reads]

    def _read_sized(self, keys: Sequence[str], expected: Sequence[int]) -> list[bytes | None]:
        """Each object read into its ``expected`` size of staging memory (0: ``GUESSED_READ``)
        and copied out, in one call per arena's worth; one larger than that is read again at the
        size the first read answered (None if it changed meanwhile), as is every object by
        ``get_into`` with buffers of its own."""
        if not keys:
            return []
        names = [self._key(k) for k in keys]
        room = [n if n > 0 else GUESSED_READ for n in expected]
        out: list[bytes | None] = [None] * len(keys)
        larger: list[tuple[int, int]] = []
        client = self._api()
        with client.lock:
            self._usable(client)
            for group in _chunks(room, client.arena.mem.nbytes):
                placed = self._into_arena(client, [names[i] for i in group], [room[i] for i in group])
                for i, (o, size) in zip(group, placed, strict=True):
                    if size is not None and size > room[i]:
                        larger.append((i, size))
                    elif size is not None:
                        out[i] = bytes(client.arena.mem.data[o : o + size])
        if larger:
            again = [memoryview(bytearray(size)) for _, size in larger]
            for (i, size), buf, got in zip(larger, again, self.get_into([keys[i] for i, _ in larger], again),
                                           strict=True):
                out[i] = bytes(buf) if got == size else None
        return out

    def _exists(self, codes: Sequence[int]) -> list[bool]:
        """``batch_is_exist``'s answer, per key (an error code fails the whole check)."""
        if any(c < 0 for c in codes):
            raise self._fail("exists", min(codes))
        return [c == 1 for c in codes]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        names = [self._key(k) for k in keys]
        if not names:
            return []
        client = self._api()
        with client.lock:
            codes = client.call("exists", 0, client.api.batch_is_exist, names)
        return self._exists(codes)

    def delete_many(self, keys: Sequence[str]) -> int:
        names = sorted({self._key(k) for k in keys})
        if not names:
            return 0
        client = self._api()
        with client.lock:
            codes = client.call("delete", 0, client.api.batch_remove, names, force=True)
        return sum(1 for c in codes if c == 0)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        start = self.prefix + prefix
        names = sorted(n for n in self._admin_get("/get_all_keys").decode().split() if n.startswith(start))
        return self._sizes(names)

    def _sizes(self, names: list[str]) -> Iterator[tuple[str, int]]:
        cut = len(self.prefix)
        for at in range(0, len(names), SCAN_CHUNK):
            chunk = names[at : at + SCAN_CHUNK]
            query = urllib.parse.quote(",".join(chunk), safe=",")
            try:
                data = json.loads(self._admin_get(f"/batch_query_keys?keys={query}"))["data"]
            except (ValueError, KeyError, TypeError) as exc:
                raise StoreError(f"mooncake store {self.where}: bad admin answer: {exc}") from None
            for name in chunk:
                entry = data.get(name) or {}
                values = entry.get("values") or []
                if entry.get("ok") and values:
                    yield name[cut:], int(values[0]["size_"])

    def stats(self) -> StoreStats:
        objects = size = 0
        for _, n in self.scan():
            objects += 1
            size += n
        metrics = self._metrics()
        mounted = int(metrics.get("master_total_capacity_bytes", 0))
        capacity = self.capacity if self.capacity is not None else mounted
        return StoreStats(objects, size, capacity or None, int(metrics.get("master_evicted_key_count", 0)))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _release(client)
