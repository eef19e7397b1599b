"""The engine host (scenarios.enginehost): a run forked from it ends as ``python -m`` would.

The host here preloads nothing and runs a small probe module, so these tests take seconds; the
engine tests run every vLLM engine through a host that preloads vLLM.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefixvault.scenarios.enginehost import PER_RUN, EngineHost, HostGone

PROBE = '''
import atexit, os, signal, sys, time

mode, marker = sys.argv[1], sys.argv[2]
def bye():
    after = " after its thread" if os.path.exists(marker + ".thread") else ""
    time.sleep(0.3)  # the run is not over, nor reported over, before this ends
    open(marker, "w").write("atexit ran" + after)
atexit.register(bye)
print("mode", mode, "name", __name__, "test", os.environ.get("PYTEST_CURRENT_TEST", "-"), flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
print("cwd", os.getcwd(), flush=True)
def link(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        return ""
sockets = [fd for fd in os.listdir("/proc/self/fd") if link(fd).startswith("socket:")]
print("sockets", len(sockets), flush=True)
if mode == "sleep":
    import subprocess
    child = subprocess.Popen(["sleep", "60"])
    print("child", child.pid, flush=True)
    time.sleep(60)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "thread":  # the main module returns while a non-daemon thread still works
    import threading
    def late():
        time.sleep(0.3)
        open(marker + ".thread", "w").write("done")
    threading.Thread(target=late).start()
    from concurrent.futures import ThreadPoolExecutor
    ThreadPoolExecutor(1).submit(int)  # its idle worker ends only when the interpreter says so
    sys.stdout.write("an unflushed tail")
'''


@pytest.fixture
def host(tmp_path: Path) -> Iterator[EngineHost]:
    (tmp_path / "hostprobe.py").write_text(PROBE)
    h = EngineHost({**os.environ, "PYTHONPATH": str(tmp_path)}, tmp_path / "hosts", preload=())
    try:
        yield h
    finally:
        h.stop()


def _run(host: EngineHost, tmp: Path, mode: str, timeout: float = 30, **env: str) -> tuple[int, str, bool]:
    log, marker = tmp / f"{mode}.log", tmp / f"{mode}.marker"
    rc = host.run("hostprobe", [mode, str(marker)], log, timeout, {**host.env, **env})
    return rc, log.read_text(), marker.exists()


def test_a_run_exits_with_its_code_after_its_atexit_handlers(host: EngineHost, tmp_path: Path) -> None:
    assert _run(host, tmp_path, "ok")[0] == 0
    rc, log, marker = _run(host, tmp_path, "exit3")
    assert rc == 3 and marker, log
    assert "mode exit3 name __main__" in log


def test_a_run_joins_its_threads_then_runs_atexit_and_flushes(host: EngineHost, tmp_path: Path) -> None:
    """As an interpreter ends: non-daemon threads first, then atexit handlers, output flushed."""
    rc, log, _ = _run(host, tmp_path, "thread")
    assert rc == 0 and log.endswith("an unflushed tail"), log
    assert (tmp_path / "thread.marker").read_text() == "atexit ran after its thread"


def test_an_exception_is_exit_code_1_with_its_traceback_in_the_log(host: EngineHost, tmp_path: Path) -> None:
    rc, log, marker = _run(host, tmp_path, "raise")
    assert rc == 1 and "ValueError: boom" in log and marker


def test_a_run_killed_by_a_signal_reports_it(host: EngineHost, tmp_path: Path) -> None:
    rc, _, marker = _run(host, tmp_path, "kill")
    assert rc == -9 and not marker


def test_a_run_past_its_timeout_is_killed_with_what_it_started(host: EngineHost, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(host, tmp_path, "sleep", timeout=3)
    assert time.monotonic() - t0 < 15
    child = int((tmp_path / "sleep.log").read_text().split("child ")[1].split()[0])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)
    assert _run(host, tmp_path, "ok")[0] == 0  # the host goes on


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_run_has_the_callers_directory_and_none_of_the_hosts_sockets(
    host: EngineHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    _, log, _ = _run(host, tmp_path, "ok")
    assert f"cwd {here}" in log and "sockets 0" in log, log


def test_runs_at_once_each_complete(host: EngineHost, tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda m: _run(host, tmp_path, m)[0], ["ok", "exit3", "raise", "kill"]))
    assert codes == [0, 3, 1, -9]


def test_a_host_serves_only_its_own_environment(host: EngineHost, tmp_path: Path) -> None:
    assert host.accepts(host.env) and host.accepts(host.env_after)
    assert not host.accepts({**host.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "maybe"})
    assert not host.accepts({k: v for k, v in host.env.items() if k != "PYTHONPATH"})
    assert "PYTEST_CURRENT_TEST" in PER_RUN and host.accepts({**host.env, "PYTEST_CURRENT_TEST": "other"})
    _, log, _ = _run(host, tmp_path, "ok", PYTEST_CURRENT_TEST="this one")
    assert "test this one" in log  # a per-run variable reaches the run


def test_a_stopped_host_refuses_runs(host: EngineHost, tmp_path: Path) -> None:
    host.stop()
    with pytest.raises(HostGone):
        _run(host, tmp_path, "ok")
