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
thread, scatters from a load thread: they never share a stream or a buffer). The gathers of one
step, every cache group's, go together (``SaveBatch``): once the engine's forward is queued, the
side stream waits for it, copies every block the step saves into the save device buffer (one
``index_select`` per layer and group), records **one** event the engine's stream waits on, and
only then queues the transfers to pinned host memory. The engine thus waits for device-side
copies only, never for a transfer over PCIe; the save lane waits for the transfers (``Done``)
before it reads the host bytes. A scatter first waits for an event the engine thread recorded
when it handed the load over (``mark``: vLLM may still have work queued on the blocks, such as
zeroing them), copies the host bytes to the device and into the blocks (``index_copy_``) and
returns once they landed. Whatever goes wrong, a copy returns or raises only once nothing it
queued on its side stream is still running: the caller may then hand its host memory out
again, and vLLM may recompute into the blocks.

Device memory (vLLM sizes its KV cache before any connector copies, so ours must be small and
known at start): the cache groups of one worker share one side stream and one device buffer
per direction (``CopyStreams``), allocated once when the caches are registered.

- Save: one step's save (``save_bytes``, which the connector derives from the step's token
  budget: ``prefixvault.vllm.config.save_device_bytes``), at least one object of the largest
  group. A step that saves more (several requests' states, say) goes in rounds through the
  buffer, and the engine then waits for the transfers of every round but the last. The next
  step's gathers follow the previous step's transfers on the side stream (one buffer): they
  have the whole forward to end.
- Load: ``DEVICE_BUFFER_BYTES`` (32 MiB), or one object of the largest group where that is
  larger; larger loads go in pieces.

Every stream, event and copy the CUDA path queues goes through ``StreamOps`` (``CUDA_OPS``): a
test gives CPU tensors a recorder in its place and reads the order of what was queued.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Load device buffer of one worker, shared by all its cache groups (and the save buffer's size
#: where the caller names none); a buffer holds at least one object of the largest group.
DEVICE_BUFFER_BYTES = 32 << 20


class StreamOps:
    """What the stream path of block I/O queues, as CUDA does it. The one seam between the
    copies' order and the device: a subclass may record each call (on CPU tensors) instead."""

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current(self, device: torch.device) -> Any:
        """The engine's stream: the calling thread's current one on ``device``."""
        return torch.cuda.current_stream(device)

    def event(self, blocking: bool = False) -> Any:
        return torch.cuda.Event(blocking=blocking)

    @contextlib.contextmanager
    def on(self, stream: Any, device: torch.device) -> Iterator[None]:
        """Queue on ``stream``, with ``device`` current (a lane thread must not touch device 0)."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def index(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """Block ids on the device, without a host synchronisation."""
        return torch.tensor(list(ids), dtype=torch.long, pin_memory=True).to(device, non_blocking=True)

    def gather(self, dest: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, page: int, group: int) -> None:
        """Device-side: blocks ``idx`` of one layer into ``dest`` (uint8 [n, page])."""
        dest.copy_(_as_bytes(src.index_select(0, idx), page))

    def to_host(self, dest: torch.Tensor, src: torch.Tensor, group: int) -> None:
        """Device to host, asynchronous (``dest`` pinned)."""
        dest.copy_(src, non_blocking=True)

    def to_device(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src, non_blocking=src.is_pinned())


CUDA_OPS = StreamOps()


class Done:
    """A copy that may still be running; ``wait()`` returns once its bytes are in place (and
    raises if the copy failed)."""

    def __init__(self, event: Any = None, batch: SaveBatch | None = None) -> None:
        self._event = event
        self._batch = batch

    def wait(self) -> None:
        event = self._event if self._batch is None else self._batch.landed()
        if event is not None:
            event.synchronize()

    @property
    def failed(self) -> bool:
        """Whether it is known to have failed by now (its step's gathers could not be queued),
        without waiting."""
        return self._batch is not None and self._batch.failed


class CopyStream:
    """One direction's side stream and device buffer. Copies are queued on it one after
    another (under ``lock``), so every group of a worker can use the same buffer: stream order
    keeps a piece's bytes until its last reader ran."""

    def __init__(self, device: torch.device, nbytes: int, ops: StreamOps = CUDA_OPS) -> None:
        self.device = device
        self.ops = ops
        self.stream: Any = ops.stream(device)
        self.buffer = ops.empty(nbytes, device)
        self.lock = threading.Lock()

    def rows(self, object_bytes: int) -> int:
        """Objects of ``object_bytes`` one piece holds (at least one)."""
        return max(1, int(self.buffer.numel()) // max(object_bytes, 1))

    def view(self, n: int, object_bytes: int, offset: int = 0) -> torch.Tensor:
        return self.buffer[offset : offset + n * object_bytes].view(n, object_bytes)


@dataclass(frozen=True)
class CopyStreams:
    """The save and load copy streams of one worker's groups on one device."""

    save: CopyStream
    load: CopyStream

    @classmethod
    def allocate(cls, device: torch.device, object_bytes: Iterable[int], budget: int = DEVICE_BUFFER_BYTES,
                 save_bytes: int | None = None, ops: StreamOps | None = None) -> CopyStreams:
        """Both directions' buffers, now (an out-of-memory shows at start, not at the first
        save): ``save_bytes`` (else ``budget``) for saves, ``budget`` for loads, each at least
        one object of the largest group. ``ops``: CUDA's own, the only device with streams."""
        if ops is None:
            if device.type != "cuda":
                raise ValueError(f"prefixvault: side streams and device buffers are for CUDA, not {device}")
            ops = CUDA_OPS
        largest = max([0, *object_bytes])
        save = max(budget if save_bytes is None else save_bytes, largest)
        return cls(CopyStream(device, save, ops), CopyStream(device, max(budget, largest), ops))

    @property
    def nbytes(self) -> int:
        return int(self.save.buffer.numel() + self.load.buffer.numel())


class SaveBatch:
    """The gathers of one step, every cache group's, queued as one: every device-side gather
    first, then one event the engine's stream waits on, then every transfer to the host.

    Made and ``issue``d on the engine's thread (the engine's stream is that thread's current
    stream). Invariant: ``_parts`` only grows until issued; issued once; ``_issued`` is set
    once issued or failed, and ``_landed`` (or ``_error``) is final from then on. A ``Done``
    of the batch waited for on another thread (the save lane) waits until the engine's thread
    issued it; on the engine's thread it issues what is queued so far."""

    def __init__(self, streams: CopyStreams) -> None:
        self.streams = streams
        self._owner = threading.get_ident()
        self._parts: list[tuple[GroupIO, list[int], torch.Tensor]] = []
        self._issued = threading.Event()
        self._landed: Any = None
        self._error: BaseException | None = None
        #: Rounds through the save buffer (1 when the step's save fits it) and bytes copied, once issued.
        self.rounds = 0
        self.nbytes = 0

    def add(self, io: GroupIO, block_ids: list[int], out: torch.Tensor) -> Done:
        if self._issued.is_set():
            raise RuntimeError("prefixvault: a gather added to a step's save already issued")
        self._parts.append((io, block_ids, out))
        return Done(batch=self)

    @property
    def issued(self) -> bool:
        """Whether it was issued (or failed issuing): nothing more can be added to it."""
        return self._issued.is_set()

    @property
    def failed(self) -> bool:
        """Whether issuing it failed (every ``Done`` of it then raises)."""
        return self._issued.is_set() and self._error is not None

    def landed(self) -> Any:
        """The event after every transfer to the host (None: nothing was queued)."""
        if not self._issued.is_set() and threading.get_ident() == self._owner:
            self.issue()
        self._issued.wait()
        if self._error is not None:
            raise RuntimeError(f"prefixvault: a step's gathers failed: {self._error!r}") from self._error
        return self._landed

    def issue(self) -> None:
        """Queue every gather added (on the engine's thread); the engine's stream waits for the
        device-side ones only. Raises only once nothing it queued is still running."""
        if self._issued.is_set():
            return
        copies = self.streams.save
        ops, side, device = copies.ops, copies.stream, copies.device
        try:
            if not self._parts:
                return
            engine = ops.current(device)
            with copies.lock, ops.on(side, device):
                try:
                    self._queue(copies, engine)
                except BaseException:
                    side.synchronize()  # nothing left writing into the hosts' memory
                    raise
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._issued.set()

    def _queue(self, copies: CopyStream, engine: Any) -> None:
        ops, side, device = copies.ops, copies.stream, copies.device
        capacity = int(copies.buffer.numel())
        side.wait_stream(engine)  # the forward that wrote these blocks
        used = 0
        transfers: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (host rows, device rows, group)
        self.rounds = 1
        for io, block_ids, out in self._parts:
            ob = io.object_bytes
            start = 0
            while start < len(block_ids):
                if capacity - used < ob:  # buffer full: this round's transfers first (the engine waits)
                    for dest, src, group in transfers:
                        ops.to_host(dest, src, group)
                    transfers, used = [], 0
                    self.rounds += 1
                n = min(len(block_ids) - start, (capacity - used) // ob)
                ids = block_ids[start : start + n]
                buf = copies.view(n, ob, used)
                idx = ops.index(ids, device)
                off = 0
                for lay in io.layers:
                    src = lay.flat if lay.flat is not None else lay.tensor
                    ops.gather(buf[:, off : off + lay.page], src, idx, lay.page, io.group)
                    off += lay.page
                transfers.append((out[start : start + n], buf, io.group))
                used += n * ob
                self.nbytes += n * ob
                start += n
        gathered = ops.event()
        gathered.record(side)
        engine.wait_event(gathered)  # the engine may reuse the blocks once every one is read
        for dest, src, group in transfers:
            ops.to_host(dest, src, group)
        landed = ops.event(blocking=True)  # a waiting save thread sleeps, not spins
        landed.record(side)
        self._landed = landed


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
                 streams: CopyStreams | None = None, group: int = 0) -> None:
        """``streams``: the side streams and device buffers this group shares with the worker's
        other groups (CUDA: without, the group gets its own); ``group``: its index, for logs."""
        if not layers:
            raise ValueError("prefixvault: a cache group without layers")
        names = list(names or [str(i) for i in range(len(layers))])
        self.layers = [_layer(t, n) for t, n in zip(layers, names, strict=True)]
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise ValueError(f"prefixvault: one cache group's layers are on several devices: {devices}")
        self.device: torch.device = next(iter(devices))
        self.group = group
        self.num_blocks = min(t.shape[0] for t in layers)
        self.object_bytes = sum(lay.page for lay in self.layers)
        if streams is None and self.device.type == "cuda":
            streams = CopyStreams.allocate(self.device, [self.object_bytes])
        if streams is not None and streams.save.device != self.device:
            raise ValueError(f"prefixvault: copy streams on {streams.save.device} for a group on "
                             f"{self.device}")
        # Copies through side streams (CUDA, or a test's recorder), else straight on this thread.
        self._streams: CopyStreams | None = streams
        #: Objects per piece of a load through the device buffer (a test may lower it to force pieces).
        self.piece_rows = 1 if streams is None else streams.load.rows(self.object_bytes)

    def mark(self) -> Any:
        """On the engine's thread: an event after the work queued so far on its stream (None
        without streams), for ``scatter(after=...)``."""
        if self._streams is None:
            return None
        ops = self._streams.load.ops
        event = ops.event()
        event.record(ops.current(self.device))
        return event

    def pieces(self, n: int) -> int:
        """How many pieces a load of ``n`` objects goes in (through the device buffer; one
        without streams, where blocks are copied straight from host memory)."""
        if self._streams is None or n <= 0:
            return 1 if n > 0 else 0
        rows = max(1, min(self.piece_rows, self._streams.load.rows(self.object_bytes)))
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

    def save_batch(self) -> SaveBatch | None:
        """A batch for one step's gathers on this group's streams (None without streams: every
        gather is then done at once)."""
        return None if self._streams is None else SaveBatch(self._streams)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, batch: SaveBatch | None = None) -> Done:
        """Copy blocks ``block_ids`` (one object each) into ``out`` (host, uint8 [n, object
        bytes]; pinned, on CUDA, for the transfer to overlap). Wait for the result before
        reading ``out``. With ``batch`` (of this group's streams), the copy is queued with the
        step's others when the batch is issued, and the blocks may be overwritten once it is;
        without, it is queued now, and they may be overwritten as soon as this returns."""
        self._check(block_ids, out)
        if not block_ids:
            return Done()
        if self._streams is None:
            self._gather_host(block_ids, out)
            return Done()
        if batch is not None:
            if batch.streams is not self._streams:
                raise ValueError("prefixvault: a gather batched on another worker's streams")
            return batch.add(self, list(block_ids), out)
        alone = SaveBatch(self._streams)
        done = alone.add(self, list(block_ids), out)
        alone.issue()
        return done

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

    # -- scatter: host -> blocks -----------------------------------------------------------------

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, after: Any = None) -> None:
        """Write ``src`` (host, uint8 [n, object bytes]) into blocks ``block_ids``; returns once
        the bytes are in the blocks. The blocks must not be in use by the engine meanwhile
        (a load writes only a request's fresh blocks); ``after`` (from ``mark``) orders the
        writes after the engine's work queued when the load was handed over."""
        self._check(block_ids, src)
        if not block_ids:
            return
        if self._streams is None:
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
        self._scatter_streams(block_ids, src, after)

    def _scatter_streams(self, block_ids: Sequence[int], src: torch.Tensor, after: Any) -> None:
        assert self._streams is not None
        copies = self._streams.load
        ops, side = copies.ops, copies.stream
        rows = max(1, min(self.piece_rows, copies.rows(self.object_bytes)))
        # The device context: a load thread that never chose one must not touch device 0.
        with copies.lock, ops.on(side, self.device):
            try:
                if after is not None:
                    side.wait_event(after)
                for start in range(0, len(block_ids), rows):
                    ids = block_ids[start : start + rows]
                    idx = ops.index(ids, self.device)
                    buf = copies.view(len(ids), self.object_bytes)
                    ops.to_device(buf, src[start : start + len(ids)])
                    off = 0
                    for lay in self.layers:
                        part = buf[:, off : off + lay.page].contiguous()
                        if lay.flat is not None:
                            lay.flat.index_copy_(0, idx, part)
                        else:
                            lay.tensor.index_copy_(0, idx, _from_bytes(part, lay.tensor))
                        off += lay.page
            finally:  # landed, or failed with nothing of ours still writing into the blocks
                landed = ops.event(blocking=True)  # an event wait: sleeps, and is no stream sync
                landed.record(side)
                landed.synchronize()


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
