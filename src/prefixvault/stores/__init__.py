"""Stores behind one contract, opened by URI.

``memory://[name]``                      in-process (tests)
``local:///dev/shm/prefixvault?capacity=8GiB``  embedded, shared by every process on the machine
``local://``                             the default directory (see ``default_local_dir``)
``redis://[[user]:password@]host:port[/db]?prefix=pv:&timeout=5&capacity=8GiB``  Redis/Valkey server
``rediss://...?ssl_ca_certs=ca.pem&ssl_cert_reqs=required``  the same over TLS
``redis+cluster://host:port``            Redis/Valkey cluster (same parameters)
``mooncake://master:50051?protocol=tcp&segment=0``  Mooncake Store (or ?config=FILE / MOONCAKE_CONFIG_PATH)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prefixvault.stores.base import (
    Buffer,
    Store,
    StoreError,
    StoreStats,
    StoreUnavailable,
    check_key,
    redact,
)

__all__ = [
    "Buffer",
    "Store",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "check_key",
    "default_local_dir",
    "open_store",
    "open_store_or_retry",
    "redact",
]

#: Room /dev/shm must have free for the default local store to live there.
SHM_MIN_FREE = 1 << 30


def default_local_dir() -> Path:
    """``/dev/shm/prefixvault`` when tmpfs has room, else the user's cache directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        try:
            if shutil.disk_usage(shm).free >= SHM_MIN_FREE:
                return shm / "prefixvault"
        except OSError:
            pass
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixvault"


#: The schemes a store URI may have.
SCHEMES = ("local", "memory", "redis", "rediss", "redis+cluster", "mooncake")
KNOWN = ("mooncake://host:port, memory://, local:///path, redis://host:port, rediss://host:port, "
         "redis+cluster://host:port")


def check_uri(uri: str) -> str:
    """Check what can be checked without opening anything (for configs and ``--dry-run``):
    StoreError with one line if the URI cannot name a store."""
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises on a malformed port or IPv6 address
    except ValueError as exc:
        raise StoreError(f"bad store URI {redact(uri)!r}: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise StoreError(f"unknown store URI {redact(uri)!r}: expected one of {KNOWN}")
    if parts.scheme == "local" and (parts.netloc or (parts.path and not parts.path.startswith("/"))):
        raise StoreError(f"bad local store URI {redact(uri)!r}: use local:///absolute/path (three slashes)")
    return uri


def open_store(uri: str, *, existing: bool = False, readonly: bool = False) -> Store:
    """Open the store a URI names; StoreError with one clear line if it cannot.

    ``existing``: the store must exist already, and its capacity stays as it is (a
    ``?capacity=`` is not applied): what maintenance commands want. ``readonly`` (implies
    ``existing``): nothing is written, not even recency. Stores with nothing to create or
    resize (Redis, Mooncake) open as usual."""
    try:
        return _open(uri, existing=existing, readonly=readonly)
    except StoreError:
        raise
    except Exception as exc:  # the last net: whatever a client library raises is one line
        detail = " ".join(str(exc).split())[:300]
        with contextlib.suppress(ValueError):
            password = urlsplit(uri).password
            if password:
                detail = detail.replace(password, "***")
        raise StoreError(f"cannot open store {redact(uri)!r}: {type(exc).__name__}: {detail}") from None


def _open(uri: str, *, existing: bool, readonly: bool) -> Store:
    existing = existing or readonly
    parts = urlsplit(check_uri(uri))
    params = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    scheme = parts.scheme
    if scheme == "memory":
        from prefixvault.stores.memory import MemoryStore

        if existing:
            params.pop("capacity", None)
        return MemoryStore.named(parts.netloc + parts.path, **params)
    if scheme == "local":
        from prefixvault.stores.local import LocalStore

        path = Path(parts.path) if parts.path else default_local_dir()
        return LocalStore.from_params(path, params, existing=existing, readonly=readonly)
    if scheme in ("redis", "rediss", "redis+cluster"):
        try:
            from prefixvault.stores.redis import RedisStore
        except ImportError as exc:
            raise StoreError(f"{scheme}:// needs redis-py: pip install 'prefixvault[redis]': {exc}") from None
        return RedisStore.from_uri(uri, params)
    if scheme == "mooncake":
        try:
            from prefixvault.stores.mooncake import MooncakeStore
        except ImportError as exc:
            raise StoreError(f"mooncake:// needs Mooncake: pip install 'prefixvault[mooncake]' (GPU) or "
                             f"'prefixvault[mooncake-cpu]': {exc}"
                             ) from None
        return MooncakeStore.from_uri(uri, params)
    raise AssertionError(f"check_uri let an unknown scheme through: {scheme}")


def open_store_or_retry(uri: str) -> Store:
    """Open a store for a serving engine, behind a circuit breaker (``breaker.py``): bad
    configuration still fails here, but a store that is down at start, or goes down later,
    only costs hits until it is back (calls fail fast; a probe now and then)."""
    from prefixvault.stores.breaker import BreakerStore

    try:
        return BreakerStore(uri, open_store, open_store(uri))
    except StoreUnavailable as exc:
        import logging

        logging.getLogger("vllm.prefixvault").error(
            "prefixvault: store %s is unavailable (%s); serving without it until it is back",
            redact(uri), exc)
        return BreakerStore(uri, open_store, first_error=exc)
