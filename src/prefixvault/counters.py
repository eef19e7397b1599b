"""Numbers several threads add to, read whole: the one base of every counter set.

A subclass is a dataclass of ``int`` fields and ``dict[str, int]`` tallies (by reason).
Invariant: every change goes through ``add`` or ``tally``, under the one lock, and a reader
takes ``snapshot`` (a consistent copy) rather than reading fields while threads count:
``x += 1`` from two threads loses counts, and a dict read while another thread adds a reason
raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class Counters:
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)

    def tally(self, name: str, key: str, n: int = 1) -> None:
        """Count ``n`` under ``key`` (an enum's value, or any string) in the tally ``name``."""
        key = str(key)
        with self._lock:
            counts: dict[str, int] = getattr(self, name)
            counts[key] = counts.get(key, 0) + n

    def snapshot(self) -> dict[str, int]:
        """Every figure at one moment: ``name`` for a number, ``name:key`` for a tally's entry."""
        out: dict[str, int] = {}
        with self._lock:
            for f in fields(self):
                if f.name.startswith("_"):
                    continue
                value = getattr(self, f.name)
                if isinstance(value, dict):
                    out.update({f"{f.name}:{k}": int(v) for k, v in value.items()})
                else:
                    out[f.name] = int(value)
        return out
