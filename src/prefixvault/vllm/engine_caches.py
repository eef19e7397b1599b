"""The engine's cache tensors as a worker touches them: objects copied out of blocks and into them.

vLLM hands the worker one view per layer (``register_kv_caches``); they become one ``GroupIO``
per cache group (``kernel_blocks.group_ios``), checked against the layout before any copy: an
object of group g is ``layout.groups[g].nbytes(rank)`` bytes on this rank, or the caches are
refused. Saves and holds read objects out of blocks here, loads write them in.

Memory on a CUDA engine, all allocated at registration (vLLM has sized its KV cache by then: an
allocation that fails shows at start, and nothing grows later): the copy buffers of
``prefixvault.blockio``, shared by the groups (for saves, one step's save, ``save_device_bytes``;
for loads, ``DEVICE_BUFFER_BYTES``), host
memory the other parts keep for copies (``host_buffer``: pinned, so a device's copies overlap)
and one pinned load buffer of ``LOAD_STAGING_BYTES`` (32 MiB, or one object of the largest group
where that is larger), reused by every load: a load larger than it is written in pieces.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from prefixvault.blockio import Done, GroupIO, SaveBatch, StreamOps
from prefixvault.layout import CacheLayout
from prefixvault.vault import ObjectRef
from prefixvault.vllm.kernel_blocks import group_ios

log = logging.getLogger("vllm.prefixvault")

#: Pinned host memory one worker keeps for loads into CUDA caches (a larger load goes in pieces).
LOAD_STAGING_BYTES = 32 << 20


class EngineCaches:
    """One rank's cache groups, as block I/O. Invariant: ``ios`` is empty while nothing usable
    is registered and once the worker lets go of the tensors (``let_go``): no copy touches a
    tensor then (each raises)."""

    def __init__(self, layout: CacheLayout, rank: int, layer_groups: Sequence[Sequence[str]],
                 num_blocks: int | None, save_device_bytes: int | None = None) -> None:
        """``num_blocks``: the engine's manager blocks (``KVCacheConfig.num_blocks``); a layer
        with more (kernel blocks) is viewed as that many manager blocks. ``save_device_bytes``:
        the save device buffer (one step's save; ``blockio.CopyStreams.allocate``)."""
        self.layout = layout
        self.rank = rank
        self.layer_groups = [list(g) for g in layer_groups]
        self.num_blocks = num_blocks
        self.ios: list[GroupIO] = []  # per cache group: copies between its layers' blocks and host bytes
        self._device: Any = None  # the caches' CUDA device, once registered
        # Loads into CUDA caches go through this pinned buffer, one load at a time (under the lock).
        self._load_buffer: Any = None
        self._load_lock = threading.Lock()
        self.save_device_bytes = save_device_bytes
        #: Copies through side streams of these instead of CUDA's (a test's recorder, on CPU).
        self.stream_ops: StreamOps | None = None
        # The open step's gathers (``one_step``), issued together when it ends; engine thread only.
        self._batch: SaveBatch | None = None

    # -- registration -----------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Block I/O for every cache group, checked against the layout, and the pinned load
        buffer on CUDA. Raises ``ValueError`` if the caches do not match the layout."""
        import torch

        self.ios = []
        ios = group_ios(kv_caches, self.layer_groups, self.num_blocks, save_bytes=self.save_device_bytes,
                        ops=self.stream_ops)
        if len(ios) != len(self.layout.groups):
            raise ValueError(f"prefixvault: {len(ios)} cache groups registered, layout has "
                             f"{len(self.layout.groups)}")
        for gi, io in enumerate(ios):
            expected = self.layout.groups[gi].nbytes(self.rank)
            if io.object_bytes != expected:
                raise ValueError(f"prefixvault: cache group {gi} has {io.object_bytes} bytes per block on "
                                 f"rank {self.rank}, layout says {expected}")
        cuda = [io for io in ios if io.device.type == "cuda"]
        if cuda:
            size = max([LOAD_STAGING_BYTES, *(io.object_bytes for io in cuda)])
            self._load_buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._device = cuda[0].device
        self.ios = ios

    def unregister(self) -> None:
        """Hold nothing of caches that could not be used (registration failed part-way)."""
        self.let_go()
        self._device = None

    def let_go(self) -> None:
        """Touch the engine's tensors no more (the worker is disabled): every copy raises from
        now on. The device stays known, for lane threads still to start."""
        self.ios = []
        self._load_buffer = None

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory for copies of these caches (pinned on CUDA)."""
        import torch

        buf: np.ndarray = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._device is not None).numpy()
        return buf

    def state_bytes(self) -> int:
        """Bytes of one boundary's states on this rank (one object of every state group)."""
        return sum(io.object_bytes for g, io in enumerate(self.ios) if self.layout.groups[g].is_state)

    def object_bytes(self, group: int) -> int:
        return self.ios[group].object_bytes

    def on_lane_thread(self) -> None:
        """A lane's thread works on the caches' device: a thread that never chose one would
        open a context on device 0 in every tensor-parallel rank (outside vLLM's budget)."""
        if self._device is None:
            return
        try:
            import torch

            torch.cuda.set_device(self._device)
        except Exception as e:  # the copies still name their device explicitly
            log.warning("prefixvault: a worker thread could not select %s: %s", self._device, e)

    # -- copies out (saves, holds) ----------------------------------------------------------------

    def read(self, ref: ObjectRef, block_id: int) -> memoryview:
        """One object's payload, copied out of the engine's blocks into fresh host memory."""
        out = np.empty(self.ios[ref.group].object_bytes, np.uint8)
        self.read_into(ref, block_id, out.data)
        return out.data

    def read_into(self, ref: ObjectRef, block_id: int, dest: memoryview) -> None:
        """Copy one object's payload out of the engine's blocks into ``dest``."""
        self.ios[ref.group].gather([block_id], _host(dest, 1)).wait()

    @contextlib.contextmanager
    def one_step(self) -> Iterator[None]:
        """The saves of one step (engine thread): their gathers (``copy_out``), every group's,
        are queued together when it ends, so that the engine's stream waits once, for the
        device-side copies only (``blockio.SaveBatch``). Without streams each is done at once."""
        self._batch = self.ios[0].save_batch() if self.ios else None
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            if batch is not None:
                batch.issue()

    def copy_out(self, group: int, block_ids: Sequence[int], dest: memoryview) -> Done:
        """Copy blocks of one group into ``dest``, one object after another, in one gather; on
        a device it may still be running (queued when the step ends, inside ``one_step``): wait
        for the ``Done`` before reading ``dest``. Waiting for it on the engine's thread inside
        ``one_step`` (a save that failed, handing its memory back) issues what the step queued
        so far; the step's later gathers then go in a batch of their own."""
        if self._batch is not None and self._batch.issued:
            self._batch = self.ios[0].save_batch()
        return self.ios[group].gather(list(block_ids), _host(dest, len(block_ids)), self._batch)

    def nbytes_of(self, objects: Sequence[tuple[ObjectRef, int]]) -> int:
        """Bytes ``copy_objects`` needs for ``objects`` (ref, block id) on this rank."""
        return sum(self.object_bytes(ref.group) for ref, _ in objects)

    def copy_objects(self, objects: Sequence[tuple[ObjectRef, int]], dest: memoryview
                     ) -> tuple[dict[str, memoryview], list[Done]]:
        """Copy ``objects`` (ref, block id) into ``dest``, one gather per cache group
        (``copy_out``), group after group: their payloads by object key (views of ``dest``) and
        the copies to wait for before reading them. ``dest`` too small raises before any copy;
        a copy that cannot be queued raises once those queued before it ended (the caller may
        then hand ``dest`` out again)."""
        by_group: dict[int, list[tuple[ObjectRef, int]]] = {}
        for ref, block_id in objects:
            by_group.setdefault(ref.group, []).append((ref, block_id))
        if self.nbytes_of(objects) > len(dest):
            raise ValueError(f"{self.nbytes_of(objects)} bytes of objects do not fit {len(dest)}")
        payloads: dict[str, memoryview] = {}
        copies: list[Done] = []
        off = 0
        try:
            for g, objs in by_group.items():
                size = self.object_bytes(g)
                copies.append(self.copy_out(g, [b for _, b in objs], dest[off : off + len(objs) * size]))
                for ref, _ in objs:
                    payloads[ref.key] = dest[off : off + size]
                    off += size
        except BaseException:
            for c in copies:
                with contextlib.suppress(Exception):  # (a batch that failed left nothing running)
                    c.wait()  # never hand back memory a copy may still write
            raise
        return payloads, copies

    # -- copies in (loads) ------------------------------------------------------------------------

    def mark(self) -> list[Any]:
        """Per cache group: the engine's work queued by now, which writes wait for (``GroupIO.mark``)."""
        return [io.mark() for io in self.ios]

    def write(self, refs: Sequence[ObjectRef], payloads: Sequence[memoryview], blocks: Sequence[int],
              marks: Sequence[Any]) -> None:
        """Write each object's payload into its block, once the engine's work ``marks`` names
        ran; returns once they landed."""
        by_group: dict[int, list[tuple[memoryview, int]]] = {}
        for ref, payload, block_id in zip(refs, payloads, blocks, strict=True):
            by_group.setdefault(ref.group, []).append((payload, block_id))
        for g, items in by_group.items():
            io = self.ios[g]
            if io.device.type == "cpu":  # straight from the loaded bytes, one copy per object
                for payload, block_id in items:
                    io.scatter([block_id], _host(payload, 1))
            else:
                self._write_pinned(io, items, marks[g] if g < len(marks) else None)

    def _write_pinned(self, io: GroupIO, items: Sequence[tuple[memoryview, int]], after: Any) -> None:
        """Write objects into a device's blocks through the pinned load buffer: one transfer
        and one scatter per piece that fits it."""
        host = self._load_buffer
        if host is None:
            raise RuntimeError("no pinned load buffer (caches not registered)")
        rows = max(1, host.numel() // io.object_bytes)
        flat = host.numpy()
        with self._load_lock:
            for start in range(0, len(items), rows):
                piece = items[start : start + rows]
                for j, (payload, _) in enumerate(piece):
                    flat[j * io.object_bytes : (j + 1) * io.object_bytes] = np.frombuffer(payload, np.uint8)
                src = host[: len(piece) * io.object_bytes].view(len(piece), io.object_bytes)
                io.scatter([b for _, b in piece], src, after=after)  # returns once landed

    def scatter(self, group: int, block_ids: Sequence[int], rows: Any) -> None:
        """Write host rows (uint8 ``[len(block_ids), object_bytes]``) into blocks as they are,
        nothing verified: for the negative control, which writes a wrong state on purpose."""
        self.ios[group].scatter(list(block_ids), rows)


def _host(buf: memoryview, rows: int) -> Any:
    """Host bytes as the uint8 [rows, n / rows] tensor block I/O reads or writes (no copy)."""
    import torch

    return torch.from_numpy(np.frombuffer(buf, np.uint8)).view(rows, -1)
