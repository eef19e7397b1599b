"""Nothing of ours raises into the engine.

Every connector entry point an engine calls runs inside ``Guard.call``: an error of prefixvault
(a bug, a store that misbehaves, an input we did not expect) becomes the entry point's safe
answer — a miss, a skipped save, a failed load that vLLM recomputes — counted by entry
point, and logged once per entry point and error type (with its traceback), never an
exception into the engine, which would kill it. The lanes count their own bugs here too.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("vllm.prefixvault")


class Guard:
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()  # entry point -> errors turned into safe answers
        self._logged: set[tuple[str, str]] = set()
        # Invariant: both change only under this lock (the engine's thread and every lane count here).
        self._lock = threading.Lock()

    def failed(self, where: str, exc: BaseException) -> None:
        key = (where, type(exc).__name__)
        with self._lock:
            self.errors[where] += 1
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.error("prefixvault: %s failed (%s: %s); the request is served without the store "
                      "(logged once per error type)", where, type(exc).__name__, exc, exc_info=exc)

    def call(self, where: str, fn: Callable[[], T], safe: Callable[[], T]) -> T:
        """``fn()``, or ``safe()`` if it raises."""
        try:
            return fn()
        except Exception as exc:
            self.failed(where, exc)
            return safe()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.errors.values())
