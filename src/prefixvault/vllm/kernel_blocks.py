"""vLLM's per-layer cache views regrouped into manager blocks, as block I/O takes them (torch only).

Kernel blocks: where an attention backend cannot take the manager's block size, vLLM splits
each manager block into kernel blocks; this module undoes the split (no vLLM import).

vLLM hands ``register_kv_caches`` one view per layer of one shared int8 allocation: a logical
``[B, H, N, C]`` view with the strides of the engine's ``KVCacheLayout`` for attention, an int8
``[B, 1, 1, state bytes]`` view with a padded block stride for a recurrent state; cache groups
alias the same bytes. Where the attention backend cannot take the manager's block size
(FlashInfer on Blackwell, FA4 with head size 256, ...), vLLM cuts every manager block into
``ratio`` kernel blocks and the view is ``[num_blocks * ratio, H, kernel_block, C]``.

``manager_view`` undoes that cut without a copy, so one object is still one manager block in
logical ``[H, N, C]`` order: the bytes an engine with kernel blocks saves are the bytes an
engine without restores. ``group_ios`` is the registration the worker does (and the checks
run on a device machine without vLLM, from a description of the views: ``describe`` and
``rebuild``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from prefixvault.blockio import DEVICE_BUFFER_BYTES, CopyStreams, GroupIO, StreamOps


def manager_view(t: torch.Tensor, num_blocks: int | None, name: str) -> torch.Tensor:
    """Layer ``name``'s view with manager blocks as dimension 0 (no copy). A view of kernel
    blocks ``[num_blocks * ratio, H, kernel_block, C]`` becomes ``[num_blocks, H, ratio *
    kernel_block, C]`` where the strides allow it, else ``[num_blocks, H, ratio, kernel_block,
    C]``: the same logical order either way (a manager block's kernel blocks follow each other
    along the token axis)."""
    if num_blocks is None or t.dim() < 1 or t.shape[0] == num_blocks:
        return t
    if num_blocks <= 0 or t.shape[0] % num_blocks:
        raise ValueError(f"prefixvault: layer {name} has {t.shape[0]} blocks, not a multiple of the "
                         f"engine's {num_blocks} (shape {tuple(t.shape)})")
    if t.dim() != 4:
        raise ValueError(f"prefixvault: layer {name} has {t.shape[0]} kernel blocks for {num_blocks} "
                         f"blocks, but is not a [blocks, heads, tokens, content] view "
                         f"(shape {tuple(t.shape)})")
    ratio = t.shape[0] // num_blocks
    grouped = t.unflatten(0, (num_blocks, ratio)).permute(0, 2, 1, 3, 4)  # [B, H, ratio, kbs, C]
    try:
        return grouped.view(num_blocks, t.shape[1], ratio * t.shape[2], t.shape[3])
    except RuntimeError:  # heads inside a kernel block (LBHNC): tokens are not one axis in memory
        return grouped


def group_ios(kv_caches: Mapping[str, Any], layer_groups: Sequence[Sequence[str]],
              num_blocks: int | None = None, budget: int = DEVICE_BUFFER_BYTES,
              save_bytes: int | None = None, ops: StreamOps | None = None) -> list[GroupIO]:
    """Block I/O for every cache group, from the views vLLM registered (kernel-block views
    regrouped to ``num_blocks`` manager blocks). On CUDA the groups share one side stream and
    one device buffer per direction, allocated here: ``save_bytes`` (one step's save) for saves,
    ``budget`` for loads (``CopyStreams.allocate``). ``ops``: copies through side streams of
    these (a test's recorder on CPU tensors) instead of CUDA's. Any problem is one ``ValueError``."""
    groups: list[tuple[list[torch.Tensor], list[str]]] = []
    for gi, names in enumerate(layer_groups):
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"prefixvault: cache group {gi}: no tensor registered for layers {missing[:3]}")
        tensors = [kv_caches[n] for n in names]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"prefixvault: cache group {gi}: a layer's cache is not one tensor "
                             f"({sorted({type(t).__name__ for t in tensors})})")
        kinds = {t.device.type for t in tensors}
        if not kinds <= {"cpu", "cuda"}:
            raise ValueError(f"prefixvault: cache tensors on {sorted(kinds)}: only CPU and CUDA caches "
                             "are supported")
        tensors = [manager_view(t, num_blocks, n) for t, n in zip(tensors, names, strict=True)]
        groups.append((tensors, list(names)))
    devices = {t.device for tensors, _ in groups for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"prefixvault: cache tensors on several devices: {sorted(map(str, devices))}")
    streams: CopyStreams | None = None
    if devices and (next(iter(devices)).type == "cuda" or ops is not None):
        pages = [sum(t[0].numel() * t.element_size() for t in tensors) for tensors, _ in groups]
        try:
            streams = CopyStreams.allocate(next(iter(devices)), pages, budget, save_bytes, ops)
        except torch.cuda.OutOfMemoryError as e:
            need = max([budget if save_bytes is None else save_bytes, *pages]) + max([budget, *pages])
            raise ValueError(f"prefixvault: no device memory for the copy buffers ({need} bytes): {e}") from e
    ios = [GroupIO(tensors, names, streams, gi) for gi, (tensors, names) in enumerate(groups)]
    if num_blocks is not None:
        for gi, io in enumerate(ios):
            if io.num_blocks != num_blocks:
                raise ValueError(f"prefixvault: cache group {gi} has {io.num_blocks} blocks, the engine "
                                 f"{num_blocks}")
    return ios


# -- a portable description of the views (fixtures for machines without vLLM) ------------------


def describe(views: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Each layer's view as dtype, shape, stride and storage offset (in elements of its dtype),
    enough for ``rebuild`` to make the same view of another buffer."""
    return {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                   "stride": list(t.stride()), "offset": int(t.storage_offset())}
            for name, t in views.items()}


def rebuild(layers: Mapping[str, Mapping[str, Any]], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The views ``describe`` described, over ``raw`` (uint8, one byte per element: the
    engine's whole allocation), exactly as vLLM made them: same bytes, same aliasing."""
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError("prefixvault: rebuild views over a 1-D uint8 buffer")
    out = {}
    for name, d in layers.items():
        dtype = getattr(torch, str(d["dtype"]))
        typed = raw.view(dtype) if dtype != torch.uint8 else raw
        out[name] = torch.as_strided(typed, list(d["shape"]), list(d["stride"]), int(d["offset"]))
    return out
