"""Block I/O: copy objects between an engine's cache tensors and host bytes, on any device.

An object is one block (or one state) of one cache group on one rank: the bytes of that block
in every layer of the group, layer after layer, each layer's block in *logical* order (the
tensor's shape after its block dimension, row-major). That order does not depend on the
physical layout vLLM picked for the engine and device (``KVCacheLayout``: LBHNC, LBNHC, LHBNC,
BLHNC, ...), so a consumer on another layout reads what a producer wrote; where a block's bytes
are one run in logical order (LBHNC, BLHNC: ``block_compact`` layers), a block is one copy.

vLLM hands one tensor per layer whose first dimension is the block (its logical shape); its
strides carry the physical layout (``prefixvault.vllm.kernel_blocks`` regroups kernel-block-split views
to manager blocks first). This module needs nothing else, and imports no vLLM: the same code
runs in the connector and in ``bench/gpu_check.py`` on a machine without vLLM.

On CUDA, copies run on side streams, one per direction (gathers come from the engine's
thread, scatters from a load thread: they never share a stream or a buffer). A gather waits
for the work already queued on the engine's stream (the forward that wrote the blocks), copies
the blocks into a device buffer (one ``index_select`` per layer), then into pinned host memory
in one transfer; the engine's stream waits only for the device-side gather of the last piece,
so the blocks can be reused by the next step while that piece's transfer to the host goes on.
The caller waits for the returned ``Done`` before it reads the host bytes (a save thread, not
the step). A scatter first waits for an event the engine thread recorded when it handed the
load over (``mark``: vLLM may still have work queued on the blocks, such as zeroing them),
copies the host bytes to the device and into the blocks (``index_copy_``) and returns once they
landed. Whatever goes wrong, a copy returns or raises only once nothing it queued on its side
stream is still running: the caller may then hand its host memory out again, and vLLM may
recompute into the blocks.

Device memory (vLLM sizes its KV cache before any connector copies, so ours must be small and
known at start): the cache groups of one worker share one side stream and one device buffer
per direction (``CopyStreams``), allocated once when the caches are registered. Each buffer is
``DEVICE_BUFFER_BYTES`` (32 MiB), or one object of the worker's largest group where that is
larger: 64 MiB of device memory per worker in all for a model such as Qwen3-Next-80B (objects
of 12.75 MiB). Larger copies go through the buffer in pieces; the engine's stream is then held
for the transfers of all pieces but the last.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Device buffer of one worker per direction (save, load), shared by all its cache groups; a
#: buffer holds at least one object of the largest group.
DEVICE_BUFFER_BYTES = 32 << 20


class Done:
    """A copy that may still be running; ``wait()`` returns once its bytes are in place."""

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class CopyStream:
    """One direction's side stream and device buffer (CUDA only). Copies are queued on it one
    after another (under ``lock``), so every group of a worker can use the same buffer: stream
    order keeps a piece's bytes until its last reader ran."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.stream: Any = torch.cuda.Stream(device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.lock = threading.Lock()

    def rows(self, object_bytes: int) -> int:
        """Objects of ``object_bytes`` one piece holds (at least one)."""
        return max(1, int(self.buffer.numel()) // max(object_bytes, 1))

    def view(self, n: int, object_bytes: int) -> torch.Tensor:
        return self.buffer[: n * object_bytes].view(n, object_bytes)


@dataclass(frozen=True)
class CopyStreams:
    """The save and load copy streams of one worker's groups on one CUDA device."""

    save: CopyStream
    load: CopyStream

    @classmethod
    def allocate(cls, device: torch.device, object_bytes: Iterable[int],
                 budget: int = DEVICE_BUFFER_BYTES) -> CopyStreams:
        """Both directions' buffers, now: ``budget`` bytes each, or one object of the largest
        group where that is more (an out-of-memory shows at start, not at the first save)."""
        if device.type != "cuda":
            raise ValueError(f"prefixvault: side streams and device buffers are for CUDA, not {device}")
        size = max([budget, *object_bytes])
        return cls(CopyStream(device, size), CopyStream(device, size))

    @property
    def nbytes(self) -> int:
        return int(self.save.buffer.numel() + self.load.buffer.numel())


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

    def __init__(self, layers: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                 streams: CopyStreams | None = None) -> None:
        """``streams``: the side streams and device buffers this group shares with the worker's
        other groups (CUDA); without, the group gets its own."""
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
        self._streams: CopyStreams | None = None
        #: Objects per piece through the device buffer (a test may lower it to force pieces).
        self.piece_rows = 1
        if self._cuda:
            if streams is None:
                streams = CopyStreams.allocate(self.device, [self.object_bytes])
            if streams.save.device != self.device:
                raise ValueError(f"prefixvault: copy streams on {streams.save.device} for a group on "
                                 f"{self.device}")
            self._streams = streams
            self.piece_rows = min(streams.save.rows(self.object_bytes), streams.load.rows(self.object_bytes))

    def mark(self) -> Any:
        """On the engine's thread: an event after the work queued so far on its stream (None
        off CUDA), for ``scatter(after=...)``."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def pieces(self, n: int) -> int:
        """How many pieces a copy of ``n`` objects goes in (through the device buffer; one
        off CUDA, where blocks are copied straight to and from host memory)."""
        if self._streams is None or n <= 0:
            return 1 if n > 0 else 0
        rows = max(1, min(self.piece_rows, self._streams.save.rows(self.object_bytes)))
        return -(-n // rows)

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
        assert self._streams is not None
        copies = self._streams.save
        engine = torch.cuda.current_stream(self.device)
        side = copies.stream
        rows = max(1, min(self.piece_rows, copies.rows(self.object_bytes)))
        gathered: Any = None
        with copies.lock, torch.cuda.device(self.device), torch.cuda.stream(side):
            try:
                side.wait_stream(engine)  # the forward that wrote these blocks
                for start in range(0, len(block_ids), rows):
                    ids = block_ids[start : start + rows]
                    idx = torch.tensor(ids, dtype=torch.long, pin_memory=True)
                    idx = idx.to(self.device, non_blocking=True)
                    buf = copies.view(len(ids), self.object_bytes)
                    off = 0
                    for lay in self.layers:
                        src = lay.flat if lay.flat is not None else lay.tensor
                        buf[:, off : off + lay.page].copy_(_as_bytes(src.index_select(0, idx), lay.page))
                        off += lay.page
                    if start + rows >= len(block_ids):  # every block read: the engine may go on
                        gathered = torch.cuda.Event()
                        gathered.record(side)
                    out[start : start + len(ids)].copy_(buf, non_blocking=True)  # before buf is reused
                landed = torch.cuda.Event(blocking=True)  # a waiting save thread sleeps, not spins
                landed.record(side)
            except BaseException:
                side.synchronize()  # nothing left writing into ``out`` once the caller sees this
                raise
        # The next forward may overwrite the blocks only after the device-side gathers (not
        # the last transfer to the host, which the caller waits for).
        engine.wait_event(gathered)
        return Done(landed)

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
        self._scatter_cuda(block_ids, src, after)

    def _scatter_cuda(self, block_ids: Sequence[int], src: torch.Tensor, after: Any) -> None:
        assert self._streams is not None
        copies = self._streams.load
        side = copies.stream
        rows = max(1, min(self.piece_rows, copies.rows(self.object_bytes)))
        pinned = src.is_pinned()
        # The device context: a load thread that never chose one must not touch device 0.
        with copies.lock, torch.cuda.device(self.device), torch.cuda.stream(side):
            try:
                if after is not None:
                    side.wait_event(after)
                for start in range(0, len(block_ids), rows):
                    ids = block_ids[start : start + rows]
                    idx = torch.tensor(ids, dtype=torch.long, pin_memory=True)
                    idx = idx.to(self.device, non_blocking=True)
                    buf = copies.view(len(ids), self.object_bytes)
                    buf.copy_(src[start : start + len(ids)], non_blocking=pinned)
                    off = 0
                    for lay in self.layers:
                        part = buf[:, off : off + lay.page].contiguous()
                        if lay.flat is not None:
                            lay.flat.index_copy_(0, idx, part)
                        else:
                            lay.tensor.index_copy_(0, idx, _from_bytes(part, lay.tensor))
                        off += lay.page
            finally:  # landed, or failed with nothing of ours still writing into the blocks
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
