"""`prefixvault repro`: the report's protocol as a command, each engine a fresh process.

The default profile (what ``make demo`` runs) at a step size of the user's, with the negative
control, and a user's checkpoint (pure Mamba2, whose prefill steps must be one block on CPU)
with no option. Both hybrids of the other kinds run the same protocol, with the same engine
arguments (``scenarios.models.engine_kwargs``), on engines in tests/test_vllm_seed.py, and the
ShortConv one as OpenAI servers in tests/test_vllm_chat.py. ``--turns`` checks a conversation
turn by turn, each turn against a cold run whose steps end where the previous prompt did, with
both templates (the previous answer kept in the next prompt, or dropped)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _repro(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixvault.cli", "repro", *args],
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_repro_on_a_step_size_of_the_users_compares_with_the_engines_own_prefix_cache(tmp_path: Path) -> None:
    """GDN at 768 tokens per step: the consumer restores 1024 (the producer's prompt checkpoint),
    where the cold consumer's steps do not end (768, 1536, ...). A restore can then only equal the
    engine's own prefix cache at 1024, which is what repro compares with; and the negative
    control (zeroed states at the same boundary) diverges."""
    res = _repro("--producer-repeats", "400", "--consumer-repeats", "600", "--max-num-batched-tokens", "768",
                 "--control", "--workdir", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["tokens_equal"] and out["logprobs_equal"]
    assert out["external_hit_tokens"] == out["longest_resumable_boundary"] == 1024
    assert out["reference"].startswith("the engine's own prefix cache at 1024")
    assert out["control"]["states_zeroed"] and out["control"]["diverged"] and out["control"]["hit"] == 1024


@pytest.mark.slow
def test_repro_on_a_users_checkpoint_runs_at_one_block_per_step(tmp_path: Path) -> None:
    """``--model DIR`` with no other option (a pure Mamba2 checkpoint, which vLLM CPU can run only
    at one block per step): repro reads the engine's block size, runs every engine at one block
    per step, and compares with cold, whose steps then end at the restored boundary."""
    from prefixvault.scenarios.models import build_model

    model = build_model("mamba2", tmp_path / "mamba2-checkpoint", seed=0)
    res = _repro("--model", str(model), "--producer-repeats", "400", "--consumer-repeats", "380",
                 "--workdir", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["tokens_equal"] and out["logprobs_equal"]
    assert out["max_num_batched_tokens"] == out["block_size"]
    assert out["reference"].startswith("a cold run whose steps end at the restored boundary")
    assert out["external_hit_tokens"] == out["longest_resumable_boundary"] > 0
    assert out["producer"]["put_keys"] > 0 and out["consumer"]["get_keys"] > 0
    assert out["consumer"].get("get_failed", 0) == 0


def _turns(tmp_path: Path, *args: str) -> list[dict[str, object]]:
    """``--turns 3`` on the default profile (turn 1: 944 tokens; block size 256): every turn n >= 2
    restores exactly the previous prompt, the boundary a lookup finds in the store, and equals
    its reference bit for bit, a cold run whose steps end there."""
    res = _repro("--turns", "3", "--producer-repeats", "300", "--consumer-repeats", "300",
                 "--workdir", str(tmp_path), "--json", *args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    turns: list[dict[str, object]] = out["turns"]
    assert out["ok"] and len(turns) == 3 and out["block_size"] == 256, out["problems"]
    assert turns[0]["prompt_tokens"] == 944 and turns[0]["hit"] == 0
    for prev, turn in itertools.pairwise(turns):
        end = prev["prompt_tokens"]
        assert turn["previous_prompt_tokens"] == end and turn["hit"] == turn["longest"] == end, turns
        assert turn["exact"] and turn["identical"], turns
        assert turn["reference"] == (f"a cold run whose steps end at {end} tokens "
                                     f"(max_num_batched_tokens {turn['max_num_batched_tokens']})")
    return turns


@pytest.mark.slow
def test_repro_turns_drop_restores_each_previous_prompt_to_its_exact_end(tmp_path: Path) -> None:
    """``--template drop`` (a template that drops the answers): turn n's prompt is turn n-1's and
    a message (944, 1008, 1072 tokens), so each turn restores a prefix that ends inside a block
    (a tail boundary), at a budget of the previous prompt's length modulo the block size."""
    turns = _turns(tmp_path, "--template", "drop")
    assert [t["prompt_tokens"] for t in turns] == [944, 1008, 1072]
    assert [t["max_num_batched_tokens"] for t in turns[1:]] == [176, 240]


@pytest.mark.slow
def test_repro_turns_reports_every_turn(tmp_path: Path) -> None:
    """``--template keep`` (the default): each turn's prompt is the last one, its answer (16 tokens,
    the ones the turn's producer generated for it) and a message; turn 3 resumes at 1024, a block
    boundary, at one block per step."""
    turns = _turns(tmp_path)
    assert [t["prompt_tokens"] for t in turns] == [944, 1024, 1104]
    assert [t["max_num_batched_tokens"] for t in turns[1:]] == [176, 256]


@pytest.mark.parametrize(
    "args,needle",
    [(["--profile", "mamba1"], "has no Mamba1 kernels"), (["--profile", "jamba"], "has no Mamba1 kernels"),
     (["--profile", "rwkv"], "unknown profile"),
     (["--tp", "0"], "positive"),
     (["--turns", "0"], "--turns in 1..20"),
     (["--turns", "2", "--template", "chat"], "unknown template 'chat'"),
     (["--template", "drop"], "add --turns"),
     (["--turns", "2", "--max-num-batched-tokens", "240"], "drop --max-num-batched-tokens")],
)
def test_repro_bad_input_is_one_clear_line(args: list[str], needle: str) -> None:
    res = _repro(*args)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
