"""`prefixvault demo`: producer and consumer processes over a real local store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_restores_exactly_the_longest_resumable_prefix(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/store?capacity=64MiB"
    res = subprocess.run(
        [sys.executable, "-m", "prefixvault.cli", "demo", "--store", uri, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] is True
    assert out["consumer"]["hit_tokens"] == out["expected_hit"] == 400
    assert out["producer"]["published"] == [400, 800]
    assert out["producer"]["refused_reasons"] == ["not_captured"]
    assert out["consumer"]["naive_state_equal"] is False


def test_demo_with_other_chunks(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/store"
    res = subprocess.run(
        [sys.executable, "-m", "prefixvault.cli", "demo", "--store", uri, "--chunk", "128", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["consumer"]["hit_tokens"] == 640  # last chunk end before the 700-token shared prefix
