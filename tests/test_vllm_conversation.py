"""Conversations: boundaries over generated tokens (``capture_outputs``), on real engines.

Turn 2's prompt is turn 1's prompt, the token ids turn 1 generated, then a new message. With
``capture_outputs`` a producer publishes the boundaries its decode steps end on, and a consumer
of turn 2 restores the last one before turn 2's new message (1024: turn 1 is 700 tokens + 400
generated, computed through 1099).

What this engine cannot give is bit-identity: a decode step computes the same tokens' KV and
state with other kernels and shapes than a prefill step (a matrix-vector product per token
instead of a chunked scan over 512), and in bfloat16 the two round differently. The test
measures it: every decode-computed object against the prefill-computed object of the same key
(a second producer prefilling turn 2's prompt). They agree to bfloat16 rounding, not bit for
bit, so restoring them gives an equivalent continuation, not the cold run's exact logprobs;
that is why ``capture_outputs`` is off by default (docs/configuration.md).
"""

from __future__ import annotations

import pytest
from vllm_support.seedlib import make_seed, run_with_metrics, spec

from prefixvault.stores import open_store
from prefixvault.testing.compare import compare_namespaces

pytestmark = pytest.mark.slow


# ShortConv (LFM2) is left out on purpose: on vLLM CPU its decode-computed KV blocks differ from
# the prefill-computed ones of the same tokens by 0.64-0.89 of their scale (not rounding), a gap
# this test would report and docs/configuration.md records; capture_outputs is not for it yet.
@pytest.mark.parametrize("profile", ["gdn-hybrid"])
def test_a_consumer_restores_the_previous_answer_with_capture_outputs(
    profile: str, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp(f"conversation-{profile}")
    seed = make_seed(profile, root / "models")
    turn1 = seed.producer[:700]
    store_uri = f"local://{root}/store?capacity=1GiB"

    decode = {"namespace": "decode", "capture_outputs": True}
    s = spec(seed, "kv_producer", [turn1], [""], store_uri, extra_config=decode, max_tokens=400,
             ignore_eos=True, conversation=True)
    answer = run_with_metrics(seed, s, root / "producer")[0][0].token_ids
    turn2 = [*turn1, *answer, *seed.producer[700:760]]

    got, metrics = run_with_metrics(seed, spec(seed, "kv_consumer", [turn2], [""], store_uri,
                                               extra_config=decode), root / "consumer")
    assert got[0].cached_tokens == 1024, metrics  # 768 and 1024 ended decode steps of turn 1

    # The same prefix computed by prefill: every decode-computed object is the object at its
    # key up to bfloat16 rounding (a wrong state or block would be off by about 1).
    prefill = {"namespace": "prefill"}
    run_with_metrics(seed, spec(seed, "kv_producer", [turn2], [""], store_uri, extra_config=prefill,
                                max_tokens=1), root / "prefill")
    compared = compare_namespaces(open_store(store_uri), "decode", "prefill")
    matches = [m for m in compared if m.error is not None]
    assert {m.is_state for m in matches} == {True, False}, matches
    assert all(m.error < 0.1 for m in matches), [(m.suffix[:12], m.error) for m in matches]
