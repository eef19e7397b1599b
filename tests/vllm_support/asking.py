"""Asking the scheduler side for a hit as vLLM does: again, step after step, while the answer
is undetermined (a lookup still in flight on its thread)."""

from __future__ import annotations

import time
from typing import Any


def ask(side: Any, request: Any, computed: int = 0, timeout: float = 10.0) -> tuple[int | None, bool]:
    deadline = time.monotonic() + timeout
    while True:
        n, load = side.get_num_new_matched_tokens(request, computed)
        if n is not None or time.monotonic() > deadline:
            return n, load
        time.sleep(0.001)
