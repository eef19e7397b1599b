"""Conversations: boundaries over generated tokens (``capture_outputs``), on real engines.

Turn 2's prompt is turn 1's prompt, the token ids turn 1 generated, then a new message. With
``capture_outputs`` a producer publishes the boundaries its decode steps end on (every one, or
only the last one before the request finishes: ``output_boundaries``), and a consumer of turn 2
restores the last one before turn 2's new message (1024: turn 1 is 700 tokens + 400 generated,
computed through 1099).

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
from vllm_support.compare import compare_namespaces
from vllm_support.seedlib import make_seed, run_result, run_with_metrics, spec

from prefixvault.stores import open_store

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

    # Two producers of turn 1, one per output_boundaries policy: "every" publishes 768 and 1024 as
    # their decode steps end; "last" holds each and publishes 1024 only, once the request finished.
    answers, metrics = {}, {}
    for mode in ("every", "last"):
        extra = {"namespace": mode, "capture_outputs": True, "output_boundaries": mode}
        s = spec(seed, "kv_producer", [turn1], [""], store_uri, extra_config=extra, max_tokens=400,
                 ignore_eos=True, conversation=True)
        # "last" stores at finish, in a step after the request's last: an engine in its own
        # process (vLLM's default) steps on while vLLM keeps the request's blocks for it. Both
        # run so, for their bytes to be comparable (in-process engines differ in the last bits).
        got, metrics[mode] = run_with_metrics(seed, s, root / f"producer-{mode}",
                                              {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        answers[mode] = got[0].token_ids
    answer = answers["every"]
    assert answers["last"] == answer  # the same greedy request on the same model
    turn2 = [*turn1, *answer, *seed.producer[700:760]]

    got, consumer = run_with_metrics(seed, spec(seed, "kv_consumer", [turn2], [""], store_uri,
                                                extra_config={"namespace": "last", "capture_outputs": True}),
                                     root / "consumer")
    assert got[0].cached_tokens == 1024, (consumer, metrics)  # 1024: the last output boundary of turn 1

    # "last" stored what "every" stored, bit for bit, except the state at 768 (one per state group).
    store = open_store(store_uri)
    states = {mode: {k.split("/", 2)[2] for k, _ in store.scan(f"{mode}/") if "/s/" in k}
              for mode in ("every", "last")}
    groups = {k.split("/")[1] for k in states["every"]}
    assert states["last"] < states["every"] and len(states["every"] - states["last"]) == len(groups)
    same = compare_namespaces(store, "last", "every")
    assert same and all(m.error == 0.0 for m in same), [(m.suffix[:12], m.error) for m in same]
    assert metrics["last"]["put_bytes"] < metrics["every"]["put_bytes"], metrics

    # An in-process engine steps only while requests are unfinished: turn 1's boundary is stored
    # with turn 2's first step, and vLLM frees turn 1's blocks once the worker reports it sent
    # (only turn 2, whose own hold has no later step, is still kept at the end). Turn 2 adds
    # the state at its prompt's exact end (a tail boundary), one per state group.
    inproc = {"namespace": "last-inproc", "capture_outputs": True}
    out = run_result(seed, spec(seed, "kv_producer", [turn1, seed.producer[700:760]], ["", ""], store_uri,
                                extra_config=inproc, max_tokens=400, ignore_eos=True, conversation=True),
                     root / "producer-inproc")
    assert out["requests_kept"] == 1, out["metrics"]
    kept = {k.split("/", 2)[2] for k, _ in store.scan("last-inproc/") if "/s/" in k}
    assert states["last"] < kept and len(kept - states["last"]) == len(groups), (sorted(kept),
                                                                                 sorted(states["last"]))

    # The same prefix computed by prefill: every decode-computed object is the object at its
    # key up to how decode and prefill round (a wrong state or block would be off by about 1).
    # That rounding is the host's: under 0.1 relative on AVX2 hosts, up to 0.25 for a KV block
    # on an AVX512-BF16 host (vLLM CPU picks its bf16 kernels by ISA).
    prefill = {"namespace": "prefill"}
    run_with_metrics(seed, spec(seed, "kv_producer", [turn2], [""], store_uri, extra_config=prefill,
                                max_tokens=1), root / "prefill")
    compared = compare_namespaces(store, "every", "prefill")
    matches = [m for m in compared if m.error is not None]
    assert {m.is_state for m in matches} == {True, False}, matches
    assert all(m.error < 0.5 for m in matches), [(m.suffix[:12], m.error) for m in matches]
