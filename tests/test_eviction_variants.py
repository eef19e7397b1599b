"""``bench/eviction_variants.py`` replays what ``bench/policy_sim.py`` replays: its ``lru``
variant is the simulator's own figure, and its other variants really change the eviction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "bench"
ARGS = ["--models", "qwen3-next-80b-a3b", "--workloads", "agent", "--policies", "reuse",
        "--capacities", "0.1", "--requests", "120", "--jobs", "1"]


def run(script: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src")}
    out = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_the_plain_order_is_the_simulators_and_value_moves_the_hit_rate() -> None:
    plain = run("policy_sim.py", *ARGS)
    variants = run("eviction_variants.py", *ARGS, "--weights", "20")
    (sim,) = plain["runs"]
    runs = {r["policy"]: r for r in variants["runs"]}
    assert set(runs) == {"reuse/lru", "reuse/chain", "reuse/value:20"}
    assert runs["reuse/lru"]["hit_rate"] == sim["hit_rate"]  # its clock keeps the same order
    assert sim["hit_rate"] > 0.05  # the cell is under pressure and shares prefixes
    table = variants["variants"]
    assert isinstance(table, dict) and set(table) == {"reuse/chain", "reuse/value:20"}
    # A credit of 20 requests per doubling reorders eviction enough to show (it loses hits).
    assert runs["reuse/value:20"]["hit_rate"] != runs["reuse/chain"]["hit_rate"]
    change = 100 * (runs["reuse/value:20"]["hit_rate"] - runs["reuse/lru"]["hit_rate"])
    assert abs(table["reuse/value:20"]["hit_mean"] - change) <= 0.02
