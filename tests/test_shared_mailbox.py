"""Synchronous loads to a worker in a child process (``vllm/mailbox.py``, ``SharedMailbox``):
vLLM's multiprocessing executor at one rank, vLLM CPU's servers always. Real child processes
and real files; this test's process plays the scheduler's."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_vault import fill, layout

from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.mailbox import Mailboxes, SharedMailbox, _write_all, shared_dir

TOKENS = list(range(64))

#: A worker process: serves the engine id to its parent, then takes what it is told to and
#: prints a digest of every object, by key, until told to stop.
WORKER = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    from prefixvault.vllm.mailbox import Mailboxes
    handoff = Mailboxes.serve(sys.argv[1], "mp", Path(sys.argv[2]))
    print("serving" if handoff is not None else "refused", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "take" and handoff is not None:
            got = handoff.take(args[0], int(args[1]), int(args[2]))
            print("none" if got is None else " ".join(
                f"{k}={hashlib.sha256(bytes(got[k])).hexdigest()[:12]}" for k in sorted(got)), flush=True)
        elif cmd == "stop":
            if handoff is not None:
                handoff.withdraw()
            print("stopped", flush=True)
            break
""")


class Worker:
    def __init__(self, engine_id: str, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, engine_id, str(root)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.first = self.line()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.ask("stop") == "stopped"
        self.proc.wait(10)


def _payloads() -> dict[str, memoryview]:
    """The objects of a load as the scheduler hands them over: whole, as stored, by key."""
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [16, 40])
    loaded = vault.load(vault.needed(vault.hashes(TOKENS[:41])[:5], 40, ranks=[0]), borrow=False, stored=True)
    return {r.key: o for r, o in loaded.objects.items()}


def _digests(objects: dict[str, memoryview]) -> str:
    import hashlib
    return " ".join(f"{k}={hashlib.sha256(bytes(objects[k])).hexdigest()[:12]}" for k in sorted(objects))


def test_a_worker_in_a_child_process_takes_the_bytes_its_scheduler_hands_over(tmp_path: Path) -> None:
    assert Mailboxes.find("engine-a", tmp_path) is None  # no worker yet: loads stay asynchronous
    worker = Worker("engine-a", tmp_path)
    try:
        assert worker.first == "serving"
        mailbox = Mailboxes.find("engine-a", tmp_path)
        assert mailbox is not None and Mailboxes.find("engine-a", tmp_path) is mailbox
        path = shared_dir(os.getpid(), "engine-a", tmp_path)
        assert path.stat().st_mode & 0o777 == 0o700  # this user's alone
        payloads = _payloads()
        token = mailbox.put("req-1", payloads, step=5)
        assert worker.ask(f"take req-1 {token} 5") == _digests(payloads)  # every object, every byte
        assert worker.ask(f"take req-1 {token} 5") == "none"  # once
        assert len(mailbox) == 0
        # another request's token, or a token of another request: not these payloads
        other = mailbox.put("req-2", payloads, step=6)
        assert worker.ask(f"take req-1 {other} 6") == "none"
        assert worker.ask(f"take req-2 {other} 6") == _digests(payloads)
        # what no load of its step took is removed by the next step's take
        stale = mailbox.put("req-3", payloads, step=7)
        later = mailbox.put("req-4", payloads, step=8)
        assert worker.ask(f"take req-4 {later} 8") == _digests(payloads)
        assert len(mailbox) == 0 and worker.ask(f"take req-3 {stale} 8") == "none"
        # ... and what a later step's load will take stays
        mine, theirs = mailbox.put("req-5", payloads, step=9), mailbox.put("req-6", payloads, step=10)
        assert worker.ask(f"take req-5 {mine} 9") == _digests(payloads)
        assert worker.ask(f"take req-6 {theirs} 10") == _digests(payloads)
    finally:
        worker.stop()
    assert Mailboxes.find("engine-a", tmp_path) is None and not path.exists()  # withdrawn: gone


def test_a_mailbox_file_holds_every_part_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    parts: list[bytes | memoryview] = [rng.randbytes(rng.choice([0, 1, 100, 5000])) for _ in range(2500)]
    parts.append(memoryview(np.arange(30_000, dtype=np.float32)))  # not bytes: cast to bytes
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    _write_all(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == whole
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o600
    writev = os.writev  # short writes, ending inside a buffer, are taken up where they stopped
    monkeypatch.setattr(os, "writev", lambda fd, bufs: writev(fd, [memoryview(bufs[0])[:777]]))
    some = parts[:40] + parts[-1:]
    _write_all(tmp_path / "g", some)
    assert (tmp_path / "g").read_bytes() == b"".join(bytes(memoryview(p).cast("B")) for p in some)


def test_a_damaged_handoff_is_not_taken(tmp_path: Path) -> None:
    worker = Worker("engine-b", tmp_path)
    try:
        mailbox = Mailboxes.find("engine-b", tmp_path)
        assert mailbox is not None
        token = mailbox.put("req", _payloads(), step=1)
        (file,) = [p for p in mailbox.path.iterdir() if p.name.startswith("1-")]
        file.write_bytes(file.read_bytes()[:-3])  # cut short: the worker reads the store instead
        assert worker.ask(f"take req {token} 1") == "none"
        token = mailbox.put("req", _payloads(), step=2)
        (file,) = [p for p in mailbox.path.iterdir() if p.name.startswith("2-")]
        data = bytearray(file.read_bytes())
        data[8:16] = b"\x80\x04K\x05.\x00\x00\x00"  # an index that is not one (a pickled 5)
        file.write_bytes(bytes(data))
        assert worker.ask(f"take req {token} 2") == "none" and len(mailbox) == 0
        token = mailbox.put("req", _payloads(), step=3)
        (file,) = [p for p in mailbox.path.iterdir() if p.name.startswith("3-")]
        file.write_bytes(b"")  # emptied: nothing to map
        assert worker.ask(f"take req {token} 3") == "none" and len(mailbox) == 0
    finally:
        worker.stop()


def test_a_mailbox_index_is_data_never_code(tmp_path: Path) -> None:
    """A planted pickle as the index would have run code in the worker; the index is JSON."""
    import json
    import pickle
    import struct

    worker = Worker("engine-i", tmp_path)
    planted = tmp_path / "planted"
    try:
        mailbox = Mailboxes.find("engine-i", tmp_path)
        assert mailbox is not None
        token = mailbox.put("req", {"k": memoryview(b"abc")}, step=1)
        (file,) = [p for p in mailbox.path.iterdir() if p.name.startswith("1-")]
        index = json.loads(file.read_bytes()[8:-3])
        assert index == [["k", 3]]

        class Plant:
            def __reduce__(self) -> tuple[object, tuple[str]]:
                return (os.system, (f"touch {planted}",))

        code = pickle.dumps(Plant())
        file.write_bytes(struct.pack("<Q", len(code)) + code)
        assert worker.ask(f"take req {token} 1") == "none"
        assert not planted.exists()
    finally:
        worker.stop()


def test_an_engine_id_two_child_workers_serve_is_served_by_neither(tmp_path: Path) -> None:
    first = Worker("engine-c", tmp_path)
    second = Worker("engine-c", tmp_path)
    try:
        assert (first.first, second.first) == ("serving", "refused")
        assert Mailboxes.find("engine-c", tmp_path) is None
    finally:
        first.stop()
        second.stop()
    assert Mailboxes.find("engine-c", tmp_path) is None


def test_a_dead_workers_mailbox_is_not_used_and_a_new_worker_takes_it_over(tmp_path: Path) -> None:
    worker = Worker("engine-d", tmp_path)
    worker.proc.kill()
    worker.proc.wait(10)
    path = shared_dir(os.getpid(), "engine-d", tmp_path)
    assert path.exists() and Mailboxes.find("engine-d", tmp_path) is None
    SharedMailbox(path).put("left", {}, step=1)
    again = Worker("engine-d", tmp_path)
    try:
        assert again.first == "serving" and Mailboxes.find("engine-d", tmp_path) is not None
        assert [p.name for p in path.iterdir()] == ["worker"]  # the dead worker's mail is gone
    finally:
        again.stop()


def test_a_mailbox_whose_worker_is_not_a_child_of_this_process_is_not_used(tmp_path: Path) -> None:
    """A mailbox left by a killed engine whose scheduler's pid was reused, naming a live process
    that is not this one's child: not served."""
    path = shared_dir(os.getpid(), "engine-h", tmp_path)
    path.mkdir(mode=0o700)
    (path / "worker").write_text(str(os.getppid()))
    assert Mailboxes.find("engine-h", tmp_path) is None


def test_a_mailbox_another_user_could_reach_is_never_used(tmp_path: Path) -> None:
    path = shared_dir(os.getpid(), "engine-e", tmp_path)
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    (path / "worker").write_text(str(os.getppid()))  # a live process, not this one
    assert Mailboxes.find("engine-e", tmp_path) is None


@pytest.mark.parametrize("engine_id", ["", "a/b", "x" * 300])
def test_any_engine_id_names_one_directory_under_the_root(tmp_path: Path, engine_id: str) -> None:
    path = shared_dir(123, engine_id, tmp_path)
    assert path.parent == tmp_path and len(path.name) < 80


def test_mailboxes_of_schedulers_that_are_gone_are_removed_when_a_worker_starts(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    left = shared_dir(gone.pid, "engine-f", tmp_path)  # a crashed engine's, files and all
    left.mkdir(mode=0o700)
    SharedMailbox(left).put("req", _payloads(), step=1)
    alive = shared_dir(os.getppid(), "engine-g", tmp_path)  # a live process's: kept
    alive.mkdir(mode=0o700)
    worker = Worker("engine-f", tmp_path)
    try:
        assert worker.first == "serving"
        assert not left.exists() and alive.exists()
    finally:
        worker.stop()


def test_a_mailbox_of_another_pid_namespace_is_never_taken_for_dead(tmp_path: Path) -> None:
    """Containers sharing /dev/shm (``--ipc=host``): a process id of another PID namespace may be
    free in this one while its engine runs; its mailbox is not this worker's to sweep."""
    from prefixvault.vllm.mailbox import pid_namespace

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    ours = shared_dir(gone.pid, "engine-j", tmp_path)
    theirs = tmp_path / ours.name.replace(f"-{pid_namespace()}-", f"-{pid_namespace() + 1}-")
    assert theirs != ours and pid_namespace() != 0
    # (and a process id no system has: not this worker's to judge, never a failed start)
    odd = tmp_path / ours.name.replace(f"-{gone.pid}-", "-99999999999999-")
    for path in (ours, theirs, odd):
        path.mkdir(mode=0o700)
    worker = Worker("engine-j", tmp_path)
    try:
        assert worker.first == "serving"
        assert not ours.exists() and theirs.exists() and odd.exists()  # this namespace's dead one only
    finally:
        worker.stop()
