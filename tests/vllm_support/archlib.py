"""The seed scenario for the architectures beyond the four core profiles
(tests/test_vllm_architectures.py): their step sizes, and the start-up hooks their engines need.

The core profiles' step sizes live in ``seedlib.BATCHED`` (test_vllm_seed.py runs each entry);
these run in a module of their own, whose engines share one environment (hence one engine
host) that loads ``vllm_support/site``: the reference Mamba1 kernels and the torchvision shim.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixvault.scenarios import scenario
from prefixvault.scenarios.engine import common_prefix
from prefixvault.scenarios.models import build_model, consumer_prompt, engine_kwargs, producer_prompt
from vllm_support import seedlib
from vllm_support.seedlib import SUPPORT, Case, Seed, _tokenize

#: max_num_batched_tokens per profile: Mamba2-based models on CPU need one block per step
#: (IndexError in the CPU Mamba2 scan otherwise); the others take two, so that some block
#: boundaries have no state.
BATCHED = {"nemotron-h": 256, "granite-4-h": 256, "falcon-h1": 256, "lfm2-moe": 512,
           "qwen3.5": 512, "jamba": 512, "mamba1": 512}
SITE = str(Path(SUPPORT) / "site")
#: torchvision for Qwen3.5's engines only (the Makefile installs it there: a vLLM engine of any
#: other model fails to start beside this CUDA build, so it is kept off the venv's own path).
TORCHVISION_SITE = Path(SUPPORT).parent.parent / ".venv" / "torchvision-site"
#: The environment of these engines.
ENV = {"PYTHONPATH": os.pathsep.join([SITE, SUPPORT, str(TORCHVISION_SITE),
                                      *filter(None, [os.environ.get("PYTHONPATH")])])}

#: The seed cases each profile runs (all four of seedlib's would cost 4 engine prefill runs
#: each): a partial shared prefix whose last block boundary has a state only when every block
#: is a step end, and the full producer prompt (the full resumable hit).
CASES = ("crosses-no-state", "fully-covered")


def make_seed(profile: str, root: Path) -> Seed:
    """seedlib.make_seed for these profiles, with CASES only."""
    model = build_model(profile, root / profile, seed=0)
    engine = engine_kwargs(profile, model)
    engine.pop("model")
    bs = int(engine["block_size"])
    batched = BATCHED[profile]
    engine["max_num_batched_tokens"] = batched
    producer = _tokenize(model, producer_prompt(seedlib.CODE, 430, varied=True))
    captured = scenario.captured(len(producer), batched, bs)
    shapes = {
        "crosses-no-state": _tokenize(model, consumer_prompt(seedlib.CODE, 315, varied=True)),
        "fully-covered": list(producer),
    }
    cases = []
    for name in CASES:
        toks = shapes[name]
        hit = scenario.expected_hit(captured, len(toks), common_prefix(producer, toks), bs)
        assert scenario.restores_exactly(hit, len(toks), batched, bs), (profile, name, hit)
        cases.append(Case(name, toks, hit))
    return Seed(profile, str(model), engine, producer, cases, bs, batched)
