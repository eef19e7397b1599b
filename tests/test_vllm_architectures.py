"""The seed scenario on the other hybrid architectures vLLM CPU can run (issue 34).

Beside the four core profiles (test_vllm_seed.py): Nemotron-H, Granite-4.0-H (MoE),
Falcon-H1 (parallel attention + Mamba2), LFM2-MoE, Qwen3.5 (GDN), and Mamba1 (Jamba and a
pure Mamba) with a reference kernel (vllm_support/mamba1_ops.py: vLLM CPU has none).

Per profile, as in test_vllm_seed.py: a cold engine, a producer engine that fills the store and
a consumer engine, each its own process; every consumer request gives the same token ids and
top-5 logprobs as cold, bit for bit, and restores exactly the longest resumable boundary.
Each profile runs two cases (archlib.CASES), its engines one environment (one engine host).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from vllm_support.archlib import BATCHED, ENV, TORCHVISION_SITE, make_seed
from vllm_support.seedlib import check, run, spec

pytestmark = pytest.mark.slow


def _torchvision_missing() -> str | None:
    if not (TORCHVISION_SITE / "torchvision").is_dir() and importlib.util.find_spec("torchvision") is None:
        return (f"torchvision is not installed in {TORCHVISION_SITE} (make installs it; vLLM's qwen3_5.py "
                "imports the Qwen3-VL code, which needs it)")
    return None


SKIP = {"qwen3.5": _torchvision_missing()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-arch")


#: What ``make test`` runs (its 40-minute budget has room for two): the GDN model most served
#: (Qwen3.5, with torchvision beside its engines) and Mamba1 with attention and MoE (Jamba, on
#: the reference kernel). ``make test-architectures`` (PREFIXVAULT_ARCHITECTURES=all) runs every
#: profile: Nemotron-H, Granite-4.0-H and Falcon-H1 add layer patterns and MoE to Mamba2, LFM2-MoE
#: MoE to ShortConv, and pure Mamba1 the kernel Jamba already runs (~2 min each here).
IN_MAKE_TEST = ("qwen3.5", "jamba")
PROFILES = list(BATCHED) if os.environ.get("PREFIXVAULT_ARCHITECTURES") == "all" else list(IN_MAKE_TEST)


@pytest.mark.parametrize("profile", PROFILES)
def test_seed_scenario_restores_exactly(profile: str, workdir: Path) -> None:
    if SKIP.get(profile):
        pytest.skip(SKIP[profile])
    seed = make_seed(profile, workdir / "models")
    salts = [f"case-{c.name}" for c in seed.cases]
    store = f"local://{workdir}/{profile}-store?capacity=1GiB"
    cold = run(seed, spec(seed, "cold", [c.tokens for c in seed.cases], [f"cold-{s}" for s in salts]),
               workdir, ENV)
    assert all(c.cached_tokens == 0 for c in cold)
    run(seed, spec(seed, "kv_producer", [seed.producer] * len(salts), salts, store), workdir, ENV)
    got = run(seed, spec(seed, "kv_consumer", [c.tokens for c in seed.cases], salts, store), workdir, ENV)
    check(seed, cold, got)
    assert all(c.expected_hit > 0 for c in seed.cases)
