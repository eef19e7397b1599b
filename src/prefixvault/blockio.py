"""Block I/O: copy objects between an engine's cache tensors and host bytes, on any device.

An object is one block (or one state) of one cache group on one rank: the bytes of that block
in every layer of the group, layer after layer, each layer's block in *logical* order (the
tensor's shape after its block dimension, row-major). That order does not depend on the
physical layout vLLM picked for the engine and device (``KVCacheLayout``: LBHNC, LBNHC, LHBNC,
BLHNC, ...), so a consumer on another layout reads what a producer wrote; where a block's bytes
are one run in logical order (LBHNC, BLHNC: ``block_compact`` layers), a block is one copy.

vLLM hands one tensor per layer whose first dimension is the block (its logical shape); its
strides carry the physical layout. This module needs nothing else, and imports no vLLM: the same
code runs in the connector and in ``bench/gpu_blockio.py`` on a machine without vLLM.

On CUDA, copies run on side streams, one per direction (gathers come from the engine's
thread, scatters from a load thread: they never share a stream or a buffer). A gather waits
for the work already queued on the engine's stream (the forward that wrote the blocks), copies
the blocks into a device buffer (one ``index_select`` per layer), then into pinned host memory
in one transfer; the engine's stream waits only for the device-side gather, so the block can be
reused by the next step while the transfer to the host goes on. The caller waits for the
returned ``Done`` before it reads the host bytes (a save thread, not the step). A scatter
first waits for an event the engine thread recorded when it handed the load over (``mark``:
vLLM may still have work queued on the blocks, such as zeroing them), copies the host bytes to
the device and into the blocks (``index_copy_``) and returns once they landed. Device buffers
are at most ``DEVICE_BUFFER_BYTES``: larger copies go through them in pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Largest device buffer one direction of one group keeps (larger copies go in pieces).
DEVICE_BUFFER_BYTES = 64 << 20


class Done:
    """A copy that may still be running; ``wait()`` returns once its bytes are in place."""

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


@dataclass(frozen=True)
class _Layer:
    tensor: torch.Tensor  # the engine's tensor; dimension 0 is the block
    flat: torch.Tensor | None  # [num_blocks, page bytes] uint8 view, where a block is one logical run
    page: int  # bytes of one block of this layer
    # The same view as numpy, on CPU: a block is copied by one memcpy on the calling thread
    # (torch's copy may fan out to the intra-op thread pool the engine's forward is using).
    flat_np: np.ndarray | None = None


def _layer(t: torch.Tensor, name: str) -> _Layer:
    if t.dim() < 1 or t.shape[0] == 0:
        raise ValueError(f"prefixvault: layer {name} has no block dimension (shape {tuple(t.shape)})")
    page = t[0].numel() * t.element_size()
    flat = None
    if t[0].is_contiguous():  # logical order == physical order within a block
        u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        flat = torch.as_strided(u8, (t.shape[0], page), (u8.stride(0), 1), u8.storage_offset())
    flat_np = flat.numpy() if flat is not None and t.device.type == "cpu" else None
    return _Layer(t, flat, page, flat_np)


class GroupIO:
    """Objects of one cache group on one rank: gather them out of the layers' blocks into host
    bytes, scatter host bytes back into blocks."""

    def __init__(self, layers: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
        if not layers:
            raise ValueError("prefixvault: a cache group without layers")
        names = list(names or [str(i) for i in range(len(layers))])
        self.layers = [_layer(t, n) for t, n in zip(layers, names, strict=True)]
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise ValueError(f"prefixvault: one cache group's layers are on several devices: {devices}")
        self.device: torch.device = next(iter(devices))
        self.num_blocks = min(t.shape[0] for t in layers)
        self.object_bytes = sum(lay.page for lay in self.layers)
        self._cuda = self.device.type == "cuda"
        # Per direction: a side stream and a device buffer used on it only.
        self._save_stream: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._load_stream: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._bufs: dict[str, torch.Tensor] = {}
        self._rows = max(1, DEVICE_BUFFER_BYTES // max(self.object_bytes, 1))  # objects per piece

    def mark(self) -> Any:
        """On the engine's thread: an event after the work queued so far on its stream (None
        off CUDA), for ``scatter(after=...)``."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @property
    def block_compact(self) -> bool:
        """Every layer's block is one run of bytes in logical order (one copy per block)."""
        return all(lay.flat is not None for lay in self.layers)

    def _check(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        n = len(block_ids)
        if out.dtype != torch.uint8 or tuple(out.shape) != (n, self.object_bytes) or not out.is_contiguous():
            raise ValueError(f"prefixvault: host buffer must be uint8 [{n}, {self.object_bytes}] and "
                             f"contiguous, got {out.dtype} {tuple(out.shape)}")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"prefixvault: block ids {bad[:5]} outside 0..{self.num_blocks - 1}")

    # -- gather: blocks -> host ------------------------------------------------------------------

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> Done:
        """Copy blocks ``block_ids`` (one object each) into ``out`` (host, uint8 [n, object
        bytes]; pinned, on CUDA, for the transfer to overlap). Wait for the result before
        reading ``out``; the blocks themselves may be overwritten as soon as this returns."""
        self._check(block_ids, out)
        if not block_ids:
            return Done()
        if not self._cuda:
            self._gather_host(block_ids, out)
            return Done()
        return self._gather_cuda(block_ids, out)

    def _gather_host(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        off = 0
        idx: torch.Tensor | None = None
        out_np = out.numpy()
        for lay in self.layers:
            dest = out[:, off : off + lay.page]
            if lay.flat_np is not None:
                for i, b in enumerate(block_ids):  # one memcpy per block: no intermediate copy
                    out_np[i, off : off + lay.page] = lay.flat_np[b]
            else:  # strided block: one gather into logical order
                if idx is None:
                    idx = torch.tensor(block_ids, dtype=torch.long)
                dest.copy_(_as_bytes(lay.tensor.index_select(0, idx), lay.page))
            off += lay.page

    def _gather_cuda(self, block_ids: Sequence[int], out: torch.Tensor) -> Done:
        engine = torch.cuda.current_stream(self.device)
        side = self._save_stream
        with torch.cuda.stream(side):
            side.wait_stream(engine)  # the forward that wrote these blocks
            for start in range(0, len(block_ids), self._rows):
                ids = block_ids[start : start + self._rows]
                idx = torch.tensor(ids, dtype=torch.long, pin_memory=True)
                idx = idx.to(self.device, non_blocking=True)
                buf = self._device_buffer("save", len(ids))
                off = 0
                for lay in self.layers:
                    src = lay.flat if lay.flat is not None else lay.tensor
                    buf[:, off : off + lay.page].copy_(_as_bytes(src.index_select(0, idx), lay.page))
                    off += lay.page
                if start + self._rows >= len(block_ids):  # every block read: the engine may go on
                    gathered = torch.cuda.Event()
                    gathered.record(side)
                out[start : start + len(ids)].copy_(buf, non_blocking=True)  # before buf is reused
            landed = torch.cuda.Event()
            landed.record(side)
        # The next forward may overwrite the blocks only after the device-side gathers (not
        # the last transfer to the host, which the caller waits for).
        engine.wait_event(gathered)
        return Done(landed)

    def _device_buffer(self, direction: str, n: int) -> torch.Tensor:
        buf = self._bufs.get(direction)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((min(max(n, 16), self._rows), self.object_bytes), dtype=torch.uint8,
                              device=self.device)
            self._bufs[direction] = buf
        return buf[:n]

    # -- scatter: host -> blocks -----------------------------------------------------------------

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, after: Any = None) -> None:
        """Write ``src`` (host, uint8 [n, object bytes]) into blocks ``block_ids``; returns once
        the bytes are in the blocks. The blocks must not be in use by the engine meanwhile
        (a load writes only a request's fresh blocks); ``after`` (from ``mark``) orders the
        writes after the engine's work queued when the load was handed over."""
        self._check(block_ids, src)
        if not block_ids:
            return
        if not self._cuda:
            off = 0
            idx: torch.Tensor | None = None
            src_np = src.numpy()
            for lay in self.layers:
                part = src[:, off : off + lay.page]
                if lay.flat_np is not None:
                    for i, b in enumerate(block_ids):
                        lay.flat_np[b] = src_np[i, off : off + lay.page]
                else:
                    if idx is None:
                        idx = torch.tensor(block_ids, dtype=torch.long)
                    lay.tensor.index_copy_(0, idx, _from_bytes(part.contiguous(), lay.tensor))
                off += lay.page
            return
        side = self._load_stream
        with torch.cuda.stream(side):
            if after is not None:
                side.wait_event(after)
            for start in range(0, len(block_ids), self._rows):
                ids = block_ids[start : start + self._rows]
                idx = torch.tensor(ids, dtype=torch.long).to(self.device)
                buf = self._device_buffer("load", len(ids))
                buf.copy_(src[start : start + len(ids)])
                off = 0
                for lay in self.layers:
                    part = buf[:, off : off + lay.page].contiguous()
                    if lay.flat is not None:
                        lay.flat.index_copy_(0, idx, part)
                    else:
                        lay.tensor.index_copy_(0, idx, _from_bytes(part, lay.tensor))
                    off += lay.page
        side.synchronize()


def _as_bytes(blocks: torch.Tensor, page: int) -> torch.Tensor:
    """[n, ...] contiguous blocks as uint8 [n, page]."""
    blocks = blocks.contiguous()
    u8 = blocks.view(torch.uint8) if blocks.dtype != torch.uint8 else blocks
    return u8.reshape(blocks.shape[0], page)


def _from_bytes(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """uint8 [n, page] as blocks shaped and typed like ``like``'s."""
    n = part.shape[0]
    typed = part.view(like.dtype) if like.dtype != torch.uint8 else part
    return typed.reshape(n, *like.shape[1:])
