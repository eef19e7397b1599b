"""Block I/O on CPU tensors in every physical layout vLLM can pick (``KVCacheLayout``): a
gather gives each block's bytes in logical order whatever the layout, a scatter writes them
back exactly and touches no other block, and bad input is one clear error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixvault.blockio import CopyStreams, GroupIO
from prefixvault.scenarios.cache_layouts import LAYOUTS, attention_layers, fill_random, state_layers

BLOCKS = 12


def expected(layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    rows = []
    for b in block_ids:
        rows.append(torch.cat([t[b].contiguous().view(torch.uint8).reshape(-1) for t in layers]))
    return torch.stack(rows)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_and_scatter_in_every_layout(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    layers = attention_layers(layout, 3, BLOCKS, 2, 4, 8, torch.bfloat16, generator=g)
    io = GroupIO(layers)
    assert io.block_compact == (layout in ("LBHNC", "BLHNC"))
    ids = [7, 0, 11, 3]
    out = torch.empty(len(ids), io.object_bytes, dtype=torch.uint8)
    io.gather(ids, out).wait()
    assert torch.equal(out, expected(layers, ids))
    before = [t.clone() for t in layers]
    src = torch.randint(0, 256, (2, io.object_bytes), dtype=torch.uint8, generator=g)
    io.scatter([5, 9], src)
    assert torch.equal(expected(layers, [5, 9]), src)
    for t, old in zip(layers, before, strict=True):
        for b in set(range(BLOCKS)) - {5, 9}:
            assert torch.equal(t[b].view(torch.uint8), old[b].view(torch.uint8))


def test_a_block_moves_between_layouts_unchanged() -> None:
    """Objects are in logical order: what an engine on one layout saves, an engine on another
    restores to the same values."""
    g = torch.Generator().manual_seed(1)
    src = attention_layers("LHBNC", 2, BLOCKS, 2, 4, 8, torch.float16, generator=g)
    dst = attention_layers("BLNHC", 2, BLOCKS, 2, 4, 8, torch.float16, generator=g)
    a, b = GroupIO(src), GroupIO(dst)
    buf = torch.empty(3, a.object_bytes, dtype=torch.uint8)
    a.gather([1, 2, 3], buf).wait()
    b.scatter([4, 5, 6], buf)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[1:4].view(torch.uint8), d[4:7].view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), ids=st.lists(st.integers(0, BLOCKS - 1), min_size=1,
                                                               max_size=BLOCKS, unique=True),
       with_state=st.booleans())
def test_round_trip_is_exact(layout: str, ids: list[int], with_state: bool) -> None:
    g = torch.Generator().manual_seed(len(ids))
    layers = (state_layers(2, BLOCKS, (3, 5), torch.float32, generator=g) if with_state
              else attention_layers(layout, 2, BLOCKS, 2, 2, 4, torch.float32, generator=g))
    io = GroupIO(layers)
    out = torch.empty(len(ids), io.object_bytes, dtype=torch.uint8)
    io.gather(ids, out).wait()
    saved = out.clone()
    for t in layers:
        fill_random(t, g)
    io.scatter(ids, saved)
    again = torch.empty_like(out)
    io.gather(ids, again).wait()
    assert torch.equal(again, saved)


def test_bad_input_is_one_clear_error() -> None:
    io = GroupIO(state_layers(1, BLOCKS, (4,)))
    with pytest.raises(ValueError, match="host buffer must be uint8"):
        io.gather([1], torch.empty(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"outside 0\.\.11"):
        io.gather([12], torch.empty(1, io.object_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no block dimension"):
        GroupIO([torch.zeros(())])
    with pytest.raises(ValueError, match="without layers"):
        GroupIO([])


def test_the_device_bench_runs_and_checks_bytes_on_cpu() -> None:
    """bench/gpu_blockio.py is run by hand on CUDA machines; here it must at least run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "bench" / "gpu_blockio.py"), "--device", "cpu",
                          "--blocks", "4", "--pool", "16", "--layers", "2", "--repeat", "1",
                          "--state", "4,8"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["all_ok"] and len(out["rows"]) == 7


def test_device_buffers_are_for_cuda_and_a_cpu_copy_is_one_piece() -> None:
    with pytest.raises(ValueError, match="for CUDA"):
        CopyStreams.allocate(torch.device("cpu"), [10])
    io = GroupIO(state_layers(1, BLOCKS, (4,)))
    assert io.pieces(7) == 1 and io.pieces(0) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_groups_share_one_bounded_buffer_per_direction_allocated_at_registration() -> None:
    from prefixvault.blockio import DEVICE_BUFFER_BYTES
    from prefixvault.vllm.kernel_blocks import group_ios

    big = attention_layers("LBNHC", 2, BLOCKS, 2, 16, 4096, torch.bfloat16, "cuda")  # 512 KiB objects
    small = state_layers(2, BLOCKS, (64,), torch.float32, "cuda")
    before = torch.cuda.memory_allocated()
    caches = {"a0": big[0], "a1": big[1], "s0": small[0], "s1": small[1]}
    ios = group_ios(caches, [["a0", "a1"], ["s0", "s1"]])
    assert torch.cuda.memory_allocated() - before == 2 * DEVICE_BUFFER_BYTES  # not per group, not later
    assert ios[0]._streams is ios[1]._streams
    assert ios[0].pieces(BLOCKS) == 1
    ids = [3, 1, 7]
    out = torch.empty(3, ios[0].object_bytes, dtype=torch.uint8, pin_memory=True)
    ios[0].piece_rows = 1  # a load in three pieces through the one buffer
    ios[0].gather(ids, out).wait()
    assert torch.equal(out, expected([t.cpu() for t in big], ids))
    ios[0].scatter([0, 2, 4], out, after=ios[0].mark())
    assert torch.equal(expected([t.cpu() for t in big], [0, 2, 4]), out)
