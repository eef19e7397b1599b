"""Stop a process for a fault test, and know it is stopped.

``kill(pid, SIGSTOP)`` returns before every thread of the target has stopped: a thread
running on another core stops only when it next enters the kernel. A test that stops a
store server and at once expects a timeout can race that thread and get an answer (seen
with ``mooncake_client``: one read in 15 served after ``kill`` had returned). ``freeze``
returns only once the kernel reports every thread stopped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _states(pid: int) -> list[str]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # the state follows the command name, which may hold spaces or parentheses
            out.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return out


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until all its threads are stopped (Linux ``/proc``)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(s in "Tt" for s in _states(pid)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s")
        time.sleep(0.001)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)
