"""A conversation through the OpenAI chat endpoint, rendered by the test tokenizer's chat template.

Three servers on loopback: a cold one (plain vLLM; every request with its own ``cache_salt``, so
nothing is reused), and two ``prefixvault serve`` servers (kv_both) over one local store. Turns
alternate between the two, as a load balancer without session affinity sends them: each turn is
served by the server that did not see the previous one, so its hit can only come from the store.

Where the hit ends: the template only appends (the previous turn's prompt is a prefix of the
next one's), and without ``capture_outputs`` only prompt boundaries are published, so turn n
restores turn n-1's prompt to its end; the previous answer and the new message are computed.
Each user message is padded so that every prompt ends on a block boundary: there the cold
server's steps (one block each) end too, so every turn's tokens and logprobs (top 5) equal the
cold server's. (A prompt that ends inside a block is restored to its exact end as well, a tail
boundary: tests/test_vllm_turns.py checks that against a cold run whose steps end there.)

The pair runs the ``reuse`` capture policy (``prefixvault.admission``): of each turn it stores
the sequence end (its prompt's exact end) and none of the step ends before it, the same hits as
``steps`` with one state per turn instead of one per block. The second server asks
for ``capture_outputs``, which the connector refuses for ShortConv models (one warning line at
start, ``preflight.outputs_refused``): it publishes prompt boundaries only, like the first.
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from prefixvault.scenarios.engine import common_prefix
from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.servers import servers
from prefixvault.serve import engine_flags, serve_command, vllm_command
from prefixvault.stores import open_store

pytestmark = pytest.mark.slow
PROFILE = "shortconv-hybrid"
WORDS = ["model", "state", "block", "cache", "prefix", "token", "layer", "answer", "question", "window",
         "river", "stone", "light", "garden", "number", "letter", "engine", "table", "morning", "signal",
         "harbor", "winter", "paper", "market"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def chat(url: str, messages: list[dict[str, str]], salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
                            "logprobs": True, "top_logprobs": 5, "ignore_eos": True,
                            "return_tokens_as_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    return post(url, "/v1/chat/completions", body)


def padded(url: str, messages: list[dict[str, str]], rng: random.Random, block: int) -> list[int]:
    """Pad the last (user) message with words until the rendered prompt ends on a block
    boundary; its tokens."""
    base = messages[-1]["content"]
    for _ in range(4 * block):
        prompt: list[int] = post(url, "/tokenize", {"model": "tiny", "messages": messages,
                                                    "add_generation_prompt": True})["tokens"]
        if len(prompt) % block == 0:
            return prompt
        messages[-1]["content"] = base = base + " " + rng.choice(WORDS)
    raise AssertionError("no padding ends the prompt on a block boundary")


def tokens_and_logprobs(res: dict[str, Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
            for t in res["choices"][0]["logprobs"]["content"]]


def test_a_chat_resumes_each_turn_from_the_store_and_matches_cold(tmp_path: Path) -> None:
    model = build_model(PROFILE, tmp_path / "m", seed=0)
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    bs = int(engine["block_size"])
    # One block per prefill step: every block boundary is a step end of every run, so a restore
    # at any of them computes exactly what a cold run computes after it (with longer steps a
    # cold run's step may span the restore point; its sums are then split differently, and the
    # result is equivalent, not bit-identical: scenarios/scenario.py, restores_exactly).
    engine["max_num_batched_tokens"] = bs
    flags = [*engine_flags(engine), "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    store = f"local://{tmp_path}/store?capacity=1GiB"
    # Engine core in the server's process: on vLLM CPU a cold server whose engine core runs in
    # its own process gives logprobs ~1e-6 apart from one in-process, connector or not (its
    # cause is vLLM's, not established); every server here runs the same way.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # every hit restored: the test checks where each turn restores to, not whether it pays
    commands = [serve_command(str(model), store, "kv_both", capture="reuse", extra=flags,
                              restore_when="always") for _ in range(2)]
    at = commands[1].index("--kv-transfer-config") + 1
    ktc = json.loads(commands[1][at])
    ktc["kv_connector_extra_config"]["capture_outputs"] = True
    commands[1][at] = json.dumps(ktc)
    cold_command = [*vllm_command(str(model)), *flags, "--enable-prefix-caching",
                    "--mamba-cache-mode", "align"]
    with servers([(cold_command, tmp_path / "cold.log"),
                  *((cmd, tmp_path / f"server{i}.log") for i, cmd in enumerate(commands))], env) as urls:
        cold, pair = urls[0], urls[1:]
        rng = random.Random(0)
        messages = [{"role": "system", "content": text(rng, 160)}, {"role": "user", "content": text(rng, 40)}]
        previous: list[int] = []
        report = []
        for turn in range(4):
            prompt = padded(pair[turn % 2], messages, rng, bs)
            got = chat(pair[turn % 2], messages)
            want = chat(cold, messages, salt=f"cold-{turn}")
            assert tokens_and_logprobs(got) == tokens_and_logprobs(want), f"turn {turn} differs from cold"
            assert got["usage"]["prompt_tokens"] == len(prompt)
            cached = int(got["usage"]["prompt_tokens_details"]["cached_tokens"])
            if previous:
                assert prompt[: len(previous)] == previous  # the template only appends
                assert cached == len(previous), (turn, cached, len(previous))
            else:
                assert cached == 0
            answer = got["choices"][0]["message"]["content"]
            generated = [int(t["token"].split(":")[1]) for t in got["choices"][0]["logprobs"]["content"]]
            report.append({"turn": turn, "prompt": len(prompt), "restored": cached,
                           "answer_tokens_kept": 0})
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": text(rng, 40)}]
            nxt = post(pair[0], "/tokenize", {"model": "tiny", "messages": messages,
                                              "add_generation_prompt": True})["tokens"]
            # How much of the answer the next prompt keeps as the ids the engine generated (the
            # template re-renders it from text): what capture_outputs could restore at most.
            report[-1]["answer_tokens_kept"] = common_prefix([*prompt, *generated], nxt) - len(prompt)
            previous = prompt
        print(json.dumps(report), file=sys.stderr)
        assert all(r["answer_tokens_kept"] >= 0 for r in report)
    refused = "capture_outputs is off for this model"
    assert refused in (tmp_path / "server1.log").read_text()
    assert refused not in (tmp_path / "server0.log").read_text()
    # The servers stopped (their saves drained): one state per turn, at its prompt's end.
    with open_store(store) as s:
        boundaries = {k.rsplit("/", 1)[1] for k, _ in s.scan() if "/s/" in k}
    assert len(boundaries) == len({r["prompt"] for r in report}), boundaries
