"""Block I/O on the exact views vLLM's own allocator hands a connector (``allocate_kv_cache``,
what the GPU model runners call), here on CPU with real bytes: every layout vLLM can pick for a
hybrid, attention cut into kernel blocks as FlashInfer/FA4 do, padded state pages, groups that
alias one allocation. The worker's own registration (``group_ios``) builds the block I/O.

Gathers are compared with the logical bytes read through vLLM's views by plain torch; after
every scatter the *whole* allocation is compared with one written through vLLM's views (no
stray byte: padding and the aliased groups included). Object sizes are checked against vLLM's
spec properties, which the layout describes objects by.

Also run against vLLM 0.33 and 0.34's Python sources (``PYTHONPATH``): only the allocator,
the planner and the spec classes are used, imported where each version has them."""

from __future__ import annotations

import math

import pytest
import torch

from prefixvault.blockio import GroupIO
from prefixvault.scenarios.cache_layouts import SMALL, VllmCache, vllm_cache
from prefixvault.vllm.kernel_blocks import describe, group_ios, manager_view, rebuild

pytest.importorskip("vllm.v1.worker.utils")

LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC")
#: Kernel-block cuts of the 64-token block: vLLM cuts only where layers are outermost.
CUTS = [(lay, None) for lay in LAYOUTS] + [(lay, k) for lay in ("LBNHC", "LBHNC") for k in (16, 32)]


def engine(layout: str, kbs: int | None, seed: int) -> VllmCache:
    cache = vllm_cache(SMALL, layout, kbs, "cpu")
    assert cache.raw is not None
    cache.raw.copy_(torch.randint(0, 256, cache.raw.shape, dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(seed)))
    return cache


def block_view(v: torch.Tensor, b: int, num_blocks: int) -> torch.Tensor:
    """Manager block ``b`` of vLLM's view in logical order, by plain slicing: its kernel
    blocks side by side along the token axis (``[H, ratio, kbs, C]``), or the block itself."""
    ratio = v.shape[0] // num_blocks
    if ratio == 1:
        return v[b]
    return v[b * ratio : (b + 1) * ratio].permute(1, 0, *range(2, v.dim()))


def logical(views: dict[str, torch.Tensor], names: list[str], ids: list[int], num_blocks: int
            ) -> torch.Tensor:
    rows = [torch.cat([block_view(views[n], b, num_blocks).contiguous().view(torch.uint8).reshape(-1)
                       for n in names]) for b in ids]
    return torch.stack(rows)


def write_through_views(views: dict[str, torch.Tensor], names: list[str], ids: list[int], src: torch.Tensor,
                        num_blocks: int) -> None:
    """The reference scatter: each layer's slice of each object written into vLLM's view."""
    for i, b in enumerate(ids):
        off = 0
        for n in names:
            dest = block_view(views[n], b, num_blocks)
            size = dest.numel() * dest.element_size()
            dest.copy_(src[i, off : off + size].view(dest.dtype).reshape(dest.shape))
            off += size


@pytest.mark.parametrize(("layout", "kbs"), CUTS)
def test_every_byte_in_every_layout_and_cut(layout: str, kbs: int | None) -> None:
    cache = engine(layout, kbs, seed=len(layout) + (kbs or 0))
    assert cache.raw is not None
    if kbs:  # vLLM really cut the attention views
        assert cache.views["attn.0"].shape[0] == cache.num_blocks * SMALL.block_size // kbs
    ios = group_ios(cache.views, cache.layer_groups, cache.num_blocks)
    g = torch.Generator().manual_seed(7)
    for gi, (io, names) in enumerate(zip(ios, cache.layer_groups, strict=True)):
        assert io.num_blocks == cache.num_blocks
        ids = torch.randperm(cache.num_blocks, generator=g)[:6].tolist()
        out = torch.empty(len(ids), io.object_bytes, dtype=torch.uint8)
        io.gather(ids, out).wait()
        assert torch.equal(out, logical(cache.views, names, ids, cache.num_blocks)), f"group {gi}"
        # scatter other bytes into other blocks; the reference writes them through vLLM's views
        dst = torch.randperm(cache.num_blocks, generator=g)[:5].tolist()
        src = torch.randint(0, 256, (len(dst), io.object_bytes), dtype=torch.uint8, generator=g)
        reference = cache.raw.clone()
        write_through_views(rebuild(describe(cache.views), reference), names, dst, src, cache.num_blocks)
        assert not torch.equal(reference, cache.raw)  # the reference did write
        io.scatter(dst, src)
        assert torch.equal(cache.raw, reference), f"group {gi}: bytes differ from vLLM's views' writes"
        again = torch.empty_like(src)
        io.gather(dst, again).wait()
        assert torch.equal(again, src)


@pytest.mark.parametrize(("layout", "kbs"), CUTS[:1] + CUTS[4:])
def test_object_bytes_are_what_vllms_specs_describe(layout: str, kbs: int | None) -> None:
    cache = vllm_cache(SMALL, layout, kbs, "cpu")
    ios = group_ios(cache.views, cache.layer_groups, cache.num_blocks)
    for io, spec, names in zip(ios, cache.specs, cache.layer_groups, strict=True):
        if hasattr(spec, "shapes"):  # a state: its tensors' bytes, never the padded page
            one = sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                      for s, d in zip(spec.shapes, spec.dtypes, strict=True))
            assert one == spec.state_content_size_bytes < spec.page_size_bytes
        else:  # an attention page, whatever the kernel blocks
            one = spec.num_heads * spec.num_states * spec.state_content_size_bytes
            assert one == spec.page_size_bytes
        assert io.object_bytes == len(names) * one


@pytest.mark.parametrize(("split", "whole"), [("LBNHC", "LBNHC"), ("LBHNC", "LBHNC"), ("LBHNC", "BLNHC")])
@pytest.mark.parametrize("kbs", [16, 32])
def test_objects_saved_with_kernel_blocks_restore_without(split: str, whole: str, kbs: int) -> None:
    """An engine on FlashInfer (kernel blocks) and one on FlashAttention (none) share objects."""
    a, b = engine(split, kbs, seed=1), engine(whole, None, seed=2)
    io_a, io_b = group_ios(a.views, a.layer_groups, a.num_blocks)[0], group_ios(b.views, b.layer_groups)[0]
    assert io_a.object_bytes == io_b.object_bytes
    src_ids, dst_ids = [3, 40, 1], [10, 2, 63]
    saved = torch.empty(3, io_a.object_bytes, dtype=torch.uint8)
    io_a.gather(src_ids, saved).wait()
    io_b.scatter(dst_ids, saved)
    names = a.layer_groups[0]
    for s, d in zip(src_ids, dst_ids, strict=True):
        for n in names:
            want = block_view(a.views[n], s, a.num_blocks).contiguous().view(torch.uint8).flatten()
            assert torch.equal(b.views[n][d].contiguous().view(torch.uint8).flatten(), want)
    back = torch.empty_like(saved)
    io_b.gather(dst_ids, back).wait()
    assert torch.equal(back, saved)


def test_regrouping_copies_nothing_and_refuses_what_is_no_cut() -> None:
    cache = vllm_cache(SMALL, "LBHNC", 16, "cpu")
    v = cache.views["attn.1"]
    grouped = manager_view(v, cache.num_blocks, "attn.1")
    assert grouped.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert grouped.shape[0] == cache.num_blocks
    assert grouped[0].numel() == v[0].numel() * v.shape[0] // cache.num_blocks
    lbnhc = vllm_cache(SMALL, "LBNHC", 32, "cpu").views["attn.0"]
    assert tuple(manager_view(lbnhc, SMALL.num_blocks, "attn.0").shape) == (64, 2, 64, 64)  # tokens one axis
    with pytest.raises(ValueError, match=r"layer attn\.1 has 256 blocks, not a multiple of the engine's 60"):
        manager_view(v, 60, "attn.1")
    with pytest.raises(ValueError, match="cache group 0: no tensor registered"):
        group_ios({}, cache.layer_groups, cache.num_blocks)
    # what the worker did before: the kernel blocks taken for blocks, a page a quarter of vLLM's
    assert GroupIO([v]).object_bytes * 4 == group_ios({"a": v}, [["a"]], cache.num_blocks)[0].object_bytes
