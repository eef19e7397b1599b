"""A producer server stopped by SIGTERM stores the saves it still had queued.

Saves are stored by a save thread after the step; an operator stopping the server right after
a request (a rolling restart) must not lose them. Real server (`prefixvault serve`, vLLM's engine
core in its own process, as operators run it), real Valkey behind a loopback link that adds
0.25 s to every round trip, so the saves are still queued when SIGTERM arrives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prefixvault.serve import engine_flags
from prefixvault.testing.models import build_model, engine_kwargs
from prefixvault.testing.netfault import SlowLink
from prefixvault.testing.servers import free_port, wait_ready
from prefixvault.testing.valkey import Valkey

pytestmark = pytest.mark.slow
PROFILE = "shortconv-hybrid"


def test_sigterm_stores_the_queued_saves_first(tmp_path: Path) -> None:
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    valkey = Valkey()
    link = SlowLink(valkey.port, 0.25)
    port = free_port()
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = 512
    cmd = [sys.executable, "-m", "prefixvault.cli", "serve", str(model), "--store",
           f"redis://127.0.0.1:{link.port}/0?timeout=10", "--role", "kv_producer", "--",
           *engine_flags(engine), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    log = tmp_path / "server.log"
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                wait_ready(proc, f"http://127.0.0.1:{port}", log, time.monotonic() + 300)
                body = json.dumps({"model": "tiny", "prompt": [(7 * i) % 500 + 3 for i in range(400)],
                                   "max_tokens": 1, "temperature": 0}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    assert r.status == 200
                proc.send_signal(signal.SIGTERM)  # at once: the saves are still on their way
                proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        text = log.read_text(errors="replace")
        assert "queued saves before shutting down" in text, text[-3000:]
        assert "not stored at shutdown" not in text
        import redis

        keys = redis.Redis(host="127.0.0.1", port=valkey.port).keys("*/r/*")
        assert keys, "no record reached the store: the queued saves were lost\n" + text[-3000:]
    finally:
        link.close()
        valkey.stop()
