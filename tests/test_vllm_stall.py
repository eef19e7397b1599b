"""A store that stalls does not stall decoding.

One ``prefixvault serve`` server (kv_both) over Valkey behind a loopback link whose delay can be
changed while it runs. Request A decodes (streamed, each token's arrival time recorded) while
request B arrives with a prompt of its own: B's lookup and both requests' saves go to the store.
First with a fast link, then with every round trip stalled for longer than many engine steps.
Lookups, loads and saves run on their own threads, so A's gaps between tokens must stay what
they were without the stall (B's own prefill step is in both runs); were any store call made in
a step, a gap would be at least the stall. The server's /metrics then shows every counter the
connector keeps.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.netfault import SlowLink
from prefixvault.scenarios.servers import server
from prefixvault.scenarios.valkey import Valkey
from prefixvault.serve import engine_flags, serve_command
from prefixvault.vllm.stats import COUNTERS, LABELLED

pytestmark = pytest.mark.slow
PROFILE = "shortconv-hybrid"
STALL = 3.0  # seconds per store round trip while stalled


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def gaps_while_another_arrives(url: str, seed: int) -> list[float]:
    """Stream A's tokens; send B after A's 20th token (B's lookup may wait up to lookup_timeout:
    A decodes long enough for B's prefill to come while it runs); A's gaps between tokens, in
    seconds."""
    a = [(seed * 31 + 7 * i) % 900 + 3 for i in range(300)]
    b = [(seed * 17 + 11 * i) % 900 + 3 for i in range(700)]
    times: list[float] = []
    b_done: list[float] = []

    def send_b() -> None:
        post(url, {"model": "tiny", "prompt": b, "max_tokens": 2, "temperature": 0}).read()
        b_done.append(time.monotonic())

    other = threading.Thread(target=send_b)
    with post(url, {"model": "tiny", "prompt": a, "max_tokens": 800, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            times.append(time.monotonic())
            if len(times) == 20:
                other.start()
    other.join(timeout=120)
    assert len(times) >= 400  # one event per token, unless the server merged some
    # B was looked up, computed and saved while A decoded: its steps are among A's gaps.
    assert b_done and times[19] < b_done[0] < times[-1], "B did not run while A decoded"
    return [y - x for x, y in itertools.pairwise(times)]


def check_metrics(url: str) -> None:
    """Every counter the connector keeps is a family on the server's /metrics (issue 32: many
    were counted and never exported), and the lanes that ran say so."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    for name in [*COUNTERS, *LABELLED]:
        assert re.search(rf"^# TYPE vllm:prefixvault_{name}(_total)? counter$", text, re.M), name
    def value(pattern: str) -> float:
        found = re.search(rf"^{pattern} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    for lane in ("lookup", "save"):
        assert value(rf'vllm:prefixvault_lane_jobs_total{{[^}}]*lane="{lane}"[^}}]*}}') > 0, lane
    assert value(r"vllm:prefixvault_lookups_total{[^}]*}") > 0
    # what the connector added to the steps, on each side's thread (it looked up and saved)
    assert value(r"vllm:prefixvault_scheduler_us_total{[^}]*}") > 0
    assert value(r"vllm:prefixvault_worker_step_us_total{[^}]*}") > 0


def test_a_stalled_store_does_not_stall_decoding(tmp_path: Path) -> None:
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = 512
    valkey = Valkey()
    link = SlowLink(valkey.port, 0.0)
    store = f"redis://127.0.0.1:{link.port}/0?timeout=30"
    flags = [*engine_flags(engine), "--served-model-name", "tiny"]
    try:
        # every request looked up (restore_when: always), into the stalled store too
        with server(serve_command(str(model), store, "kv_both", extra=flags, restore_when="always"),
                    tmp_path / "server.log",
                    {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) as url:
            gaps_while_another_arrives(url, 0)  # warm up
            fast = gaps_while_another_arrives(url, 1)
            link.delay = STALL
            stalled = gaps_while_another_arrives(url, 2)
            link.delay = 0.0
            check_metrics(url)
        assert max(stalled) < min(STALL, max(fast) + 1.0), (max(fast), max(stalled))
        log = (tmp_path / "server.log").read_text(errors="replace")
        assert "failed" not in "".join(line for line in log.splitlines(True) if "prefixvault:" in line)
    finally:
        link.close()
        valkey.stop()
