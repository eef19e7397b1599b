"""``bench/tenant_timing.py`` on a few prompts: a request with another salt finds none of the
prompts a tenant cached (the control, the tenant's own salt, finds every one), and the last line
is one JSON object with every AUC. The timing AUCs themselves are the bench's figures, not
asserted here (a few prompts give them no precision)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_another_salt_finds_nothing_a_tenant_cached(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tenant_timing.py"), "--trials", "40",
                          "--tokens", "256", "--dir", str(tmp_path)], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["auc"]["found"] == 0.5  # the attacker found nothing, cached or not
    assert result["control_auc"]["found"] == 1.0  # the tenant itself finds every cached prompt
    assert set(result["auc"]) == {"lookup", "load", "found"} and result["goal"] == [0.45, 0.55]
