"""Human byte sizes: ``8GiB``, ``512MB``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
#: Larger than any machine's memory or disk: a size beyond it is a typo.
MAX_SIZE = 1 << 60


def parse_size(text: str) -> int:
    """Parse a byte size; raise ValueError with the accepted forms if it is not one."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text[:100]!r} (examples: 1048576, 512MiB, 8GiB, 2GB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not value <= MAX_SIZE:  # also inf
        raise ValueError(f"size {text[:100]!r} is larger than 1 EiB")
    return int(value)


def format_size(n: float) -> str:
    """Format bytes with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
