"""The cache views ``bench/gpu_check.py`` runs from on a device machine without vLLM
(``tests/data/vllm_views.json``) are what this vLLM's own allocator builds: run once per
supported version with the rest of the contract suite, so a version that lays out caches
differently fails here; the fixture is then regenerated with ``tools/gen_views.py`` (and the
device check run again)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import vllm

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "vllm_views.json"


def test_the_fixture_is_what_this_vllm_builds() -> None:
    spec = importlib.util.spec_from_file_location("gen_views", ROOT / "tools" / "gen_views.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.build()["configs"]
    stored = json.loads(FIXTURE.read_text())["configs"]
    assert [(c["geometry"], c["layout"], c["kernel_block_size"]) for c in fresh] == \
        [(c["geometry"], c["layout"], c["kernel_block_size"]) for c in stored]
    for new, old in zip(fresh, stored, strict=True):
        assert new == old, (f"vLLM {vllm.__version__}'s views changed for {new['geometry']} "
                            f"{new['layout']} kernel block {new['kernel_block_size']}: run "
                            "tools/gen_views.py and the device check")
