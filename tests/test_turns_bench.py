"""``bench/turns.py`` on one small geometry under the installed vLLM: where the chat template
drops the previous answer, a turn restored through the store computes nothing the previous
turn computed, under both schedulers; no prefixvault cell recomputes more than vLLM's own
cache; and with ``capture_outputs`` a kept answer is restored to its last output boundary,
under both schedulers and with both ``output_boundaries``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--block-sizes", "528", "--units", "block", "--checkpoints", "0", "--turns", "3", "--first", "1200",
        "--answer", "100", "--message", "200", "--quiet"]


def test_a_turn_recomputes_none_of_the_previous_prompt() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "turns.py"), *ARGS], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    (run,) = result["runs"]
    cells = run["cells"]
    assert len(cells) == 2 * 2 * 4  # schedulers x templates x columns
    for scheduler in ("sync", "async"):
        base = f"{scheduler}/bs528-unitblock-ckpt0"
        for column in ("prefixvault", "capture", "every"):
            dropped = cells[f"{base}-dropped/{column}"]
            assert dropped["total"] == 0, dropped
            assert all(t["restored"] == t["previous"] for t in dropped["turns"][1:]), dropped["turns"]
            for template in ("kept", "dropped"):
                cell, own = cells[f"{base}-{template}/{column}"], cells[f"{base}-{template}/vllm"]
                assert cell["total"] <= own["total"], (template, column, cell, own)
        # the previous prompt's exact end: the answer but its last token is computed again
        assert cells[f"{base}-kept/prefixvault"]["total"] == cells[f"{base}-kept/prefixvault"]["goal_total"]
    capture = cells["sync/bs528-unitblock-ckpt0-kept/capture"]
    assert capture["output_boundaries"] > 0 and capture["total"] == capture["goal_total"], capture
    asynchronous = cells["async/bs528-unitblock-ckpt0-kept/capture"]
    assert asynchronous["overlapped"] > 0  # the batch queue ran two deep
    # async scheduling: output boundaries held and keyed at the request's end, as under sync
    assert asynchronous["output_boundaries"] > 0 and asynchronous["total"] == capture["total"], asynchronous
    # output_boundaries every: stored as each step ends (sync), or held until the token is
    # known and stored while the request runs (async): the same depth either way
    for scheduler in ("sync", "async"):
        every = cells[f"{scheduler}/bs528-unitblock-ckpt0-kept/every"]
        assert every["output_boundaries"] > 0 and every["total"] == capture["total"], (scheduler, every)
    assert not result["flagged"]
