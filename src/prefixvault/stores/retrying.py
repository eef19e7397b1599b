"""A store that is not reachable yet: every call fails fast until an open succeeds.

While the store is down, the first call after each ``RETRY_INTERVAL`` tries to open it (that
call waits up to the store's own timeout); every other call fails at once.

An engine must start and serve (cold) while its store is down; it picks the store up once
the server is back. Bad configuration is not this: it still fails at start, in one line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prefixvault.stores.base import Buffer, Store, StoreError, StoreStats, StoreUnavailable, redact

#: Seconds between attempts to open the store while it is unavailable.
RETRY_INTERVAL = 5.0


class RetryingStore(Store):
    """Opens the real store on first use after ``RETRY_INTERVAL``; until then raises
    StoreUnavailable, which every caller already treats as a miss or a failed save."""

    def __init__(self, uri: str, opener: Callable[[str], Store], first_error: StoreError,
                 interval: float = RETRY_INTERVAL) -> None:  # fmt: skip
        self.uri = redact(uri)  # what it shows; ``_open_uri`` keeps the password to open with
        self._open_uri = uri
        self._opener = opener
        self._interval = interval
        self._error = first_error
        self._next_try = time.monotonic() + interval
        self._store: Store | None = None
        self._lock = threading.Lock()

    def _real(self) -> Store:
        if self._store is not None:
            return self._store
        # One caller at a time tries to open; the others fail at once instead of waiting.
        if time.monotonic() < self._next_try or not self._lock.acquire(blocking=False):
            raise StoreUnavailable(f"store not open yet: {self._error}")
        try:
            if self._store is None:
                try:
                    self._store = self._opener(self._open_uri)
                except StoreError as exc:  # down again, or now refusing us: try later either way
                    self._error = exc
                    self._next_try = time.monotonic() + self._interval
                    raise StoreUnavailable(f"store not open yet: {exc}") from None
            return self._store
        finally:
            self._lock.release()

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return self._real().put_many(items)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self._real().put_if_absent(key, data)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._real().get_into(keys, buffers)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._real().get_many(keys)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._real().exists_many(keys)

    def touch_many(self, keys: Sequence[str]) -> list[bool]:
        return self._real().touch_many(keys)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._real().delete_many(keys)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self._real().scan(prefix)

    def stats(self) -> StoreStats:
        return self._real().stats()

    def staging_buffer(self, nbytes: int) -> memoryview | None:
        return self._store.staging_buffer(nbytes) if self._store is not None else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
