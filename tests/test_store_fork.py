"""Fork-safe stores: a child forked while other threads use a store gets a working store or
a clear error, never a deadlock (vLLM forks its workers by default on Linux; issue 31: 32 of
40 forks deadlocked).

Each fork's child does one put and one get and exits with a code that says what happened; the
parent gives it a deadline and kills it past it (a hang is a failure, not a stuck run).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefixvault.stores import local as local_module
from prefixvault.stores.base import Store, StoreError
from prefixvault.stores.local import LocalStore
from prefixvault.stores.memory import MemoryStore

FORKS = 40
CHILD_DEADLINE_S = 20.0
OK, BROKEN, CLEAR_ERROR = 0, 1, 3


def _fork(child: Callable[[], int]) -> int:
    """Fork; run ``child`` there and exit with its code; return that code (or -SIGKILL when
    the child outlived its deadline)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: that is the point
        pid = os.fork()
    if pid == 0:
        code = BROKEN
        try:
            code = child()
        except StoreError:
            code = CLEAR_ERROR
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


@pytest.fixture
def busy() -> Iterator[Callable[[Store], None]]:
    """Start threads that use a store without pause until the test ends."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    stores: list[Store] = []

    def start(store: Store) -> None:
        stores.append(store)

        def work(n: int) -> None:
            big = bytes([n]) * (300 << 10)  # a slab object
            i = 0
            while not stop.is_set():
                key = f"t{n}/k{i % 16}"
                store.put_many([(key, [big if i % 3 else b"small"])])
                store.get_many([key, f"t{n}/k{(i + 7) % 16}"])
                store.exists_many([key])
                if i % 5 == 0:
                    store.delete_many([f"t{n}/k{(i + 3) % 16}"])
                i += 1

        for n in range(3):
            t = threading.Thread(target=work, args=(n,), daemon=True)
            t.start()
            threads.append(t)

    yield start
    stop.set()
    for t in threads:
        t.join(timeout=30)
    for s in stores:
        s.close()


def _use(store: Store) -> int:
    key = f"child/{os.getpid()}"
    data = os.urandom(200 << 10)
    if store.put_many([(key, [data])]) != [True] or store.get_many([key]) != [data]:
        return BROKEN
    return OK


@pytest.mark.parametrize("kind", ["local", "memory", "local behind its breaker"])
def test_forking_while_threads_use_the_store_never_hangs_the_child(
        tmp_path: Path, busy: Callable[[Store], None], kind: str) -> None:
    from prefixvault.stores import open_store_or_retry

    store: Store = (LocalStore(tmp_path / "s", capacity=256 << 20) if kind == "local" else MemoryStore()
                    if kind == "memory" else open_store_or_retry(f"local://{tmp_path / 's'}?capacity=256MiB"))
    busy(store)
    time.sleep(0.2)
    codes = []
    for _ in range(FORKS):
        codes.append(_fork(lambda: _use(store)))
        time.sleep(0.005)
    assert codes == [OK] * FORKS, codes


def test_a_child_forked_while_a_call_would_not_end_gets_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that keeps the store's lock past FORK_WAIT_S (a long wait on another process's
    write): the fork goes ahead, and the child is told to open the store again."""
    monkeypatch.setattr(local_module, "FORK_WAIT_S", 0.2)
    store = LocalStore(tmp_path / "s", capacity=64 << 20)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    held.wait(5)
    try:
        assert _fork(lambda: _use(store)) == CLEAR_ERROR
        assert _fork(lambda: _use(LocalStore(tmp_path / "s"))) == OK  # opened again: works
    finally:
        release.set()
        t.join()
    assert _use(store) == OK  # the parent's store is untouched
    store.close()
