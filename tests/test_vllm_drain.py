"""A producer server stopped by SIGTERM stores the saves it still had queued.

Saves are stored by a save thread after the step; an operator stopping the server right after
a request (a rolling restart) must not lose them. Real server (`prefixvault serve`, vLLM's engine
core in its own process, as operators run it), real Valkey behind a loopback link that adds
0.25 s to every round trip, so the saves are still queued when SIGTERM arrives; and one whose
store stopped answering stops within its deadlines all the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.netfault import SlowLink
from prefixvault.scenarios.servers import free_port, server_env, wait_ready
from prefixvault.scenarios.valkey import Valkey
from prefixvault.serve import engine_flags, kv_transfer_config, serve_command

pytestmark = pytest.mark.slow
PROFILE = "shortconv-hybrid"


def _flags(model: Path) -> list[str]:
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = 512
    return [*engine_flags(engine), "--served-model-name", "tiny"]


@contextmanager
def _running(cmd: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The server started and answering; killed on the way out if it is still there."""
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], env=server_env(),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", log, time.monotonic() + 300)
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _complete(port: int, prompt: list[int]) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def test_sigterm_stores_the_queued_saves_first(tmp_path: Path) -> None:
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    valkey = Valkey()
    link = SlowLink(valkey.port, 0.25)
    port = free_port()
    cmd = [sys.executable, "-m", "prefixvault.cli", "serve", str(model), "--store",
           f"redis://127.0.0.1:{link.port}/0?timeout=10", "--role", "kv_producer", "--", *_flags(model)]
    log = tmp_path / "server.log"
    try:
        with _running(cmd, port, log) as proc:
            _complete(port, [(7 * i) % 500 + 3 for i in range(400)])
            proc.send_signal(signal.SIGTERM)  # at once: the saves are still on their way
            proc.wait(timeout=120)
        text = log.read_text(errors="replace")
        assert "queued saves before shutting down" in text, text[-3000:]
        assert "not stored at shutdown" not in text
        import redis

        keys = redis.Redis(host="127.0.0.1", port=valkey.port).keys("*/r/*")
        assert keys, "no record reached the store: the queued saves were lost\n" + text[-3000:]
    finally:
        link.close()
        valkey.stop()


def test_sigterm_with_a_stalled_store_abandons_within_its_deadline_and_leaves_the_store_open(
        tmp_path: Path) -> None:
    """Issue 32: a server stopped with saves queued on a store that stopped answering neither
    hangs nor closes the store under the put still running: the save lane gives up after
    ``save_drain_timeout`` (what was queued is counted as dropped), the load and lookup lanes
    after theirs, and the store is left open for the call in flight."""
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    valkey = Valkey()
    link = SlowLink(valkey.port, 0.0)
    port = free_port()
    ktc = kv_transfer_config(f"redis://127.0.0.1:{link.port}/0?timeout=60", "kv_both", "default", "steps")
    ktc["kv_connector_extra_config"]["save_drain_timeout"] = 3
    cmd = serve_command(str(model), "unused", "kv_both", extra=_flags(model))
    cmd[cmd.index("--kv-transfer-config") + 1] = json.dumps(ktc)
    log = tmp_path / "server.log"
    try:
        with _running(cmd, port, log) as proc:
            link.delay = 120.0  # every round trip from now on: the store has stopped answering
            _complete(port, [(11 * i) % 500 + 3 for i in range(600)])  # a lookup timeout, then computed
            time.sleep(1.0)  # its saves are in the save lane's put, or queued behind it
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)
            stopped = time.monotonic() - t0
        text = log.read_text(errors="replace")
        assert stopped < 40, f"shutdown took {stopped:.0f} s\n" + text[-3000:]
        assert "saves not stored at shutdown" in text, text[-3000:]
        assert "the store is left open" in text, text[-3000:]
    finally:
        link.close()
        valkey.stop()
