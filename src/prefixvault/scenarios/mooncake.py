"""A throwaway Mooncake Store on loopback: ``mooncake_master`` plus one ``mooncake_client``
that mounts the memory (so objects outlive the engines that wrote them).

For tests and benchmarks; both binaries come with the mooncake-transfer-engine wheel.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from prefixvault.units import parse_size

_RUNNING: list[MooncakeCluster] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _binary(name: str) -> str:
    import mooncake

    return str(Path(mooncake.__file__).parent / name)


def _wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.01)
    return False


class MooncakeCluster:
    """Master and holder processes on 127.0.0.1 with ports picked at start."""

    def __init__(self, segment: str = "512MiB", logs: Path | None = None,
                 master_flags: Sequence[str] = (), holder: bool = True) -> None:  # fmt: skip
        self.segment = parse_size(segment)
        self.logs = logs
        self.master_flags = tuple(master_flags)
        self.rpc_port = _free_port()
        self.admin_port = _free_port()
        self.holder_port = _free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        _RUNNING.append(self)
        try:
            self.start_master()
            if holder:
                self.start_holder()
        except BaseException:  # a master without its holder is no cluster: leave nothing running
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def uri(self, **params: str) -> str:
        params = {"admin": f"127.0.0.1:{self.admin_port}", **params}
        return f"mooncake://{self.address}?" + "&".join(f"{k}={v}" for k, v in params.items())

    def _log(self, name: str) -> int | IO[bytes]:
        if self.logs is None:
            return subprocess.DEVNULL
        self.logs.mkdir(parents=True, exist_ok=True)
        return (self.logs / f"{name}.log").open("ab")

    def start_master(self) -> None:
        cmd = [_binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               f"--metrics_port={self.admin_port}", "--metrics_host=127.0.0.1",
               "--enable_metric_reporting=false", *self.master_flags]  # fmt: skip
        out = self._log("master")
        self.master = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        if not _wait_port(self.rpc_port, self.master, time.monotonic() + 20):
            raise RuntimeError(f"mooncake_master did not start: {cmd}")

    def start_holder(self) -> None:
        cmd = [_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.holder_port}",
               f"--master_server_address={self.address}", "--metadata_server=P2PHANDSHAKE",
               f"--global_segment_size={self.segment}", "--protocol=tcp"]  # fmt: skip
        out = self._log("holder")
        self.holder = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
        deadline = time.monotonic() + 30
        while self.holder.poll() is None and time.monotonic() < deadline:
            if self.capacity() > 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_client did not mount its segment: {cmd}")

    def capacity(self) -> int:
        """Bytes of mounted memory the master knows of (0 while none, or unreachable)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("master_total_capacity_bytes "):
                        return int(float(line.split()[1]))
        except OSError:
            pass
        return 0

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        if proc is not None:
            proc.wait()

    def kill_master(self) -> None:
        self._kill(self.master)

    def kill_holder(self) -> None:
        self._kill(self.holder)

    def stop(self) -> None:
        self._kill(self.holder)
        self._kill(self.master)
        if self in _RUNNING:
            _RUNNING.remove(self)


@atexit.register
def _stop_all() -> None:
    while _RUNNING:
        _RUNNING.pop().stop()
