"""``bench/policy_sim.py``: its clairvoyant ``oracle:P`` buys ``P``'s restores with fewer bytes,
and it replays on a real Mooncake master as on the local store."""

from __future__ import annotations

from typing import Any

from test_eviction_variants import run

CELL = ["--models", "qwen3-next-80b-a3b", "--workloads", "fewshot", "--requests", "120", "--jobs", "1"]


def _by_policy(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in result["runs"]}


def test_the_oracle_restores_what_its_policy_restores_with_fewer_bytes() -> None:
    result = run("policy_sim.py", *CELL, "--policies", "steps,marconi,reuse,oracle:marconi",
                 "--capacities", "30")
    runs = _by_policy(result)
    marconi, oracle = runs["marconi"], runs["oracle:marconi"]
    assert marconi["hit_tokens"] > 0
    # Nothing is evicted at 30x: every boundary marconi restored is stored, some at an earlier
    # request than marconi admits it (the oracle takes the first chance), so it restores more.
    assert oracle["hit_tokens"] >= marconi["hit_tokens"]
    assert oracle["bytes_written"] < marconi["bytes_written"]
    ceiling = (oracle["flops_saved"] / oracle["bytes_written"]) / (
        runs["steps"]["flops_saved"] / runs["steps"]["bytes_written"])
    cell = "qwen3-next-80b-a3b/fewshot/30"
    assert result["flops_per_byte_cells"] == 1
    short = result["flops_per_byte_met"] == 0
    assert result["flops_per_byte_out_of_reach"] == ([cell] if short and ceiling < 2.0 else [])


def test_a_replay_on_mooncake_restores_and_evicts() -> None:
    result = run("policy_sim.py", *CELL, "--policies", "reuse", "--capacities", "0.3", "--scale", "16",
                 "--stores", "local,mooncake")
    runs = _by_policy(result)
    local, mooncake = runs["reuse"], runs["reuse[mooncake]"]
    assert mooncake["hit_tokens"] > 0 and mooncake["bytes_written"] > 0
    assert mooncake["prompt_tokens"] == local["prompt_tokens"]
    # More was written than the segment holds: the master made room (or refused puts) itself.
    assert mooncake["bytes_written"] > mooncake["capacity_gb"] * 1e9
