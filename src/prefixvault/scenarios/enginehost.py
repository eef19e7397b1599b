"""A warm process that forks engine runs: vLLM and torch imported once, not once per engine.

Importing vLLM takes 6-8 s of an engine run's 10-15 s on two cores, and a test session starts
over a hundred engines. A host imports them once, with the environment of the runs it serves,
and forks one process per run. Each run is still its own process (the report's protocol: cold,
producer and consumer never share an engine) and ends the way ``python -m MODULE`` ends: its
threads joined, its atexit handlers run, its output flushed; only the imports come from the
host, and only the interpreter's teardown of them is skipped (``finish``).

Invariant: a host serves only runs whose environment equals, variable by variable, the one it
imported under or the one its imports left (they set a few, e.g. ``TORCHINDUCTOR_CACHE_DIR``):
nothing read from the environment at import time can differ from a fresh process's
(``EngineHost.accepts``).

Runs forked from one host share what a process draws once at start: the ``str`` hash seed,
for one. Nothing prefixvault keys or stores depends on it; ``prefixvault repro`` (its test
included) and the OpenAI-server tests still start every engine as a fresh process.

Protocol, one Unix-socket connection per run: the client sends one JSON line (module, argv,
log path, the run's ``PER_RUN`` variables); the host forks a waiter, which forks the run, sends
``{"pid": N}``, waits for the run to exit, and sends ``{"rc": N}`` (negative: killed by
signal -N).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

#: Variables that differ from run to run and that nothing reads at import: a run gets its own
#: values of these (pytest names the current test in one).
PER_RUN = ("PYTEST_CURRENT_TEST",)
#: What the host imports before it forks: the bulk of an engine run's start.
PRELOAD = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core",
           "vllm.v1.engine.llm_engine", "prefixvault.vllm")


class HostGone(RuntimeError):
    """The host could not take the run; the caller starts a fresh process instead."""


class EngineHost:
    """One host process, started with ``env``; ``run`` forks a run in it."""

    def __init__(self, env: Mapping[str, str], workdir: Path, preload: Sequence[str] = PRELOAD,
                 start_timeout: float = 300) -> None:
        self.env = dict(env)
        workdir.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="host-", dir=workdir)
        self.socket_path = os.path.join(self._dir, "s")
        self.log = Path(self._dir) / "host.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.socket_path, *preload],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while not os.path.exists(self.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise HostGone(f"engine host did not start; log {self.log}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        changed: dict[str, str | None] = json.loads(Path(self.socket_path + ".env").read_text())
        after = {**self.env, **changed}
        self.env_after = {k: v for k, v in after.items() if v is not None}

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a run with ``env`` would import what this host imported."""
        return all(env.get(k) in (self.env.get(k), self.env_after.get(k))
                   for k in {*env, *self.env, *self.env_after} - set(PER_RUN))

    def run(self, module: str, argv: list[str], log_path: Path, timeout: float, env: Mapping[str, str]
            ) -> int:
        """Run ``python -m module *argv`` as a fork of the host, in this process's working
        directory, output to ``log_path``; its exit code (negative: the signal that killed it).
        After ``timeout``, or when the caller is interrupted, the run and everything it started
        are killed before this returns. ``env`` must be one the host ``accepts``."""
        if self.proc.poll() is not None:
            raise HostGone(f"engine host exited with {self.proc.returncode}")
        request = {"module": module, "argv": argv, "log": str(log_path), "cwd": os.getcwd(),
                   "env": {k: env.get(k) for k in PER_RUN}}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lines = _Lines(conn)
        try:
            try:
                conn.connect(self.socket_path)
                conn.sendall(json.dumps(request).encode() + b"\n")
                first = lines.read(60)
            except (OSError, EOFError) as e:  # nothing was forked: a fresh process may run instead
                raise HostGone(f"engine host did not take the run: {e!r}") from e
            if first is None:
                raise RuntimeError(f"engine host took the run but named no process in 60 s; log {log_path}")
            pid = int(json.loads(first)["pid"])
            try:
                last = lines.read(timeout)
                if last is None:
                    raise subprocess.TimeoutExpired(f"{module} {argv}", timeout)
            except BaseException:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # the run leads its own process group
                with contextlib.suppress(Exception):
                    lines.read(30)  # its waiter reports once it is gone
                raise
            return int(json.loads(last)["rc"])
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path + ".env")


class _Lines:
    """Lines from ``conn``, one at a time: the host may send the run's pid and its exit code
    together (a run that ends at once), so what one read brings past a line is kept."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def read(self, timeout: float) -> bytes | None:
        """One line within ``timeout`` s (None past it); EOFError if the connection closes first."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.conn.settimeout(left)
            try:
                chunk = self.conn.recv(4096)
            except TimeoutError:
                return None
            if not chunk:
                raise EOFError("connection closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"


# --------------------------------------------------------------------------- host side


def _run_forked(listener: socket.socket, conn: socket.socket, request: dict[str, Any]) -> None:
    """In the fork that becomes the run: ``python -m MODULE`` from here on, exiting as it does."""
    listener.close()
    conn.close()
    os.setsid()  # the client's kill reaches this run and whatever it starts, not the host
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code: int = 0
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(request["cwd"])
        for name, value in request["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finish(code)


def finish(code: int) -> NoReturn:
    """End the run as a fresh interpreter ends, up to the part nobody can observe: join its
    non-daemon threads, run its atexit handlers (vLLM's shutdown, which stores queued saves,
    among them), flush its output; then leave without tearing down the modules (3 s of freeing
    torch's and vLLM's objects per run on two cores, which the kernel frees at once)."""
    # What the interpreter calls first on exit: threading's own exit hooks (which stop idle
    # executor workers), then a join of every non-daemon thread.
    getattr(threading, "_shutdown")()  # noqa: B009 (private: no public name does the same)
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _wait_for_run(listener: socket.socket, conn: socket.socket, request: dict[str, Any]) -> None:
    """In the waiter: fork the run, report its pid, wait, report its exit code, then leave."""
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        _run_forked(listener, conn, request)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
    finally:
        os._exit(0)


def serve(socket_path: str, preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a waiter per connection until terminated."""
    import importlib

    parent = os.getppid()
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # What the imports made lives as long as every run: no run's collections walk it again
    # (vLLM collects several times per engine start and shutdown).
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = socket_path + ".tmp"
    listener.bind(tmp)
    listener.listen(16)
    listener.settimeout(1.0)
    # What the imports changed, and only that: the environment itself may hold secrets.
    changed = {k: os.environ.get(k) for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)}
    Path(socket_path + ".env").write_text(json.dumps(changed))
    sys.stdout.flush()  # nothing buffered here may reach a run's log
    sys.stderr.flush()
    os.rename(tmp, socket_path)  # the path appears only once the host accepts
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # whoever started the host is gone: so is the host
                return
            continue
        try:
            request = json.loads(conn.makefile("rb").readline())
        except (OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            _wait_for_run(listener, conn, request)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
