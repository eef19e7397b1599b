"""Stop a process for a fault test, and know it is stopped.

``kill(pid, SIGSTOP)`` returns before every thread of the target has stopped: a thread
running on another core stops only when it next enters the kernel. A test that stops a
store server and at once expects a timeout can race that thread and get an answer (seen
with ``mooncake_client``: one read in 15 served after ``kill`` had returned). ``freeze``
returns only once the kernel reports every thread stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _states(pid: int) -> list[str]:
    out: list[str] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # the process is gone
        return out
    for task in tasks:
        try:  # the state follows the command name, which may hold spaces or parentheses
            out.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return out


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until all its threads are stopped (Linux ``/proc``). A process
    that exits (or never stops) is resumed and reported, never left half stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    try:
        while True:
            live = [s for s in _states(pid) if s not in "ZXx"]  # a dead thread never stops
            if not live:
                raise ProcessLookupError(f"process {pid} exited instead of stopping")
            if all(s in "Tt" for s in live):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} did not stop within {timeout:g} s")
            time.sleep(0.001)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            thaw(pid)
        raise


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)
