"""Stand-ins for CUDA streams and events that log what block I/O queues, on CPU tensors.

``blockio`` queues every stream, event and copy through ``StreamOps``; ``RecordingOps`` takes
its place on a machine without a GPU: each copy is done at once (so the bytes are checked too)
and every call is appended to ``log`` in the order it was queued. The order is what the GPU
would run in: within one stream, queued order; across streams, only what events impose. What a
test reads from the log: which side of the engine's wait each copy was queued on, how many
events the engine's stream waited for, and which threads waited on the host for an event
(``host_wait``: on the engine's thread, a wait for a transfer stalls the engine).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixvault.blockio import StreamOps


@dataclass(frozen=True)
class Op:
    """One queued call: ``what`` (gather, to_host, to_device, record, wait_event, wait_stream,
    synchronize, host_wait), on ``stream`` (a name; for ``host_wait``, the waiting thread's),
    for ``group`` or ``event`` where it has one."""

    what: str
    stream: str
    group: int = -1
    event: int = -1


@dataclass(eq=False)
class FakeEvent:
    ops: RecordingOps
    id: int
    recorded_on: str = ""

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.name
        self.ops.append(Op("record", stream.name, event=self.id))

    def synchronize(self) -> None:  # every copy was done when it was queued: only logged
        self.ops.append(Op("host_wait", threading.current_thread().name, event=self.id))


@dataclass(eq=False)
class FakeStream:
    ops: RecordingOps
    name: str

    def wait_event(self, event: FakeEvent) -> None:
        self.ops.append(Op("wait_event", self.name, event=event.id))

    def wait_stream(self, other: FakeStream) -> None:
        self.ops.append(Op("wait_stream", self.name))

    def synchronize(self) -> None:
        self.ops.append(Op("synchronize", self.name))


@dataclass(eq=False)
class RecordingOps(StreamOps):
    """``StreamOps`` on CPU tensors, logging every call; ``engine`` is the engine's stream."""

    log: list[Op] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _current: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        self.engine = FakeStream(self, "engine")

    def append(self, op: Op) -> None:
        with self._lock:
            self.log.append(op)

    def _on(self) -> str:
        return str(getattr(self._current, "name", "engine"))

    def stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self, f"side{next(self._ids)}")

    def current(self, device: torch.device) -> FakeStream:
        return self.engine

    def event(self, blocking: bool = False) -> FakeEvent:
        return FakeEvent(self, next(self._ids))

    @contextlib.contextmanager
    def on(self, stream: Any, device: torch.device) -> Iterator[None]:
        old = self._on()
        self._current.name = stream.name
        try:
            yield
        finally:
            self._current.name = old

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def index(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=device)

    def gather(self, dest: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, page: int, group: int) -> None:
        self.append(Op("gather", self._on(), group=group))
        super().gather(dest, src, idx, page, group)

    def to_host(self, dest: torch.Tensor, src: torch.Tensor, group: int) -> None:
        self.append(Op("to_host", self._on(), group=group))
        dest.copy_(src)

    def to_device(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        self.append(Op("to_device", self._on()))
        dest.copy_(src)

    def take(self) -> list[Op]:
        """The calls logged since the last ``take``."""
        with self._lock:
            out, self.log = self.log, []
        return out


def engine_waits(ops: Sequence[Op]) -> list[Op]:
    """The events the engine's stream waited for."""
    return [op for op in ops if op.what == "wait_event" and op.stream == "engine"]


def host_waits(ops: Sequence[Op], thread: str | None = None) -> list[Op]:
    """The host's waits for an event, on ``thread`` (by name; default: the calling one)."""
    name = threading.current_thread().name if thread is None else thread
    return [op for op in ops if op.what == "host_wait" and op.stream == name]


def held_for_transfers(ops: Sequence[Op]) -> bool:
    """Whether the engine's stream waited for an event recorded after a transfer to the host on
    the same side stream (it would then wait for that transfer over PCIe)."""
    recorded: dict[int, int] = {op.event: i for i, op in enumerate(ops) if op.what == "record"}
    for wait in engine_waits(ops):
        at = recorded.get(wait.event)
        if at is not None and any(op.what == "to_host" and op.stream == ops[at].stream for op in ops[:at]):
            return True
    return False
