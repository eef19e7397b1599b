"""What the cached bytes are: cache groups, their per-rank shapes, and the layout fingerprint.

Two processes may exchange bytes only if their layouts have the same fingerprint. The
fingerprint covers everything that changes the meaning of a byte: model and revision,
dtypes, shapes, block size, tensor/pipeline parallel sizes and each rank's shard, and the
engine's own layout version.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class GroupKind(StrEnum):
    """How a group's cache lets a prefix resume."""

    FULL_ATTENTION = "full_attention"  # needs every KV block before the boundary
    SLIDING_WINDOW = "sliding_window"  # needs the KV blocks inside the window
    STATE = "state"  # needs the one state captured exactly at the boundary


class StateFamily(StrEnum):
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN = "gdn"
    SHORTCONV = "shortconv"
    GENERIC = "generic"


DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an object: e.g. one layer's K and V for a block, or a conv window."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class CacheGroup:
    """Layers sharing one kind of cache. ``shards[r]`` is what rank r keeps per object."""

    kind: GroupKind
    shards: tuple[tuple[TensorSpec, ...], ...]
    window: int | None = None  # sliding window in tokens
    family: StateFamily | None = None  # state groups only
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW and not (self.window and self.window > 0):
            raise ValueError("a sliding-window group needs a positive window")
        if self.kind is not GroupKind.SLIDING_WINDOW and self.window is not None:
            raise ValueError(f"only sliding-window groups have a window, not {self.kind}")
        if self.kind is GroupKind.STATE and self.family is None:
            object.__setattr__(self, "family", StateFamily.GENERIC)
        if self.kind is not GroupKind.STATE and self.family is not None:
            raise ValueError("only state groups have a state family")
        if not self.shards:
            raise ValueError("a cache group needs at least one rank shard")

    @classmethod
    def uniform(
        cls, kind: GroupKind, tensors: Sequence[TensorSpec], world_size: int = 1, **kw: Any
    ) -> CacheGroup:
        """A group whose every rank keeps tensors of the same shapes (tensor parallel)."""
        return cls(kind, tuple(tuple(tensors) for _ in range(world_size)), **kw)

    @property
    def is_state(self) -> bool:
        return self.kind is GroupKind.STATE

    def nbytes(self, rank: int) -> int:
        """Payload bytes of one object of this group on ``rank``."""
        return sum(t.nbytes for t in self.shards[rank])


@dataclass(frozen=True)
class CacheLayout:
    """Everything that makes cached bytes compatible between processes."""

    model: str
    block_size: int
    groups: tuple[CacheGroup, ...]
    revision: str = ""
    tp_size: int = 1
    pp_size: int = 1
    engine: str = "generic"
    engine_layout_version: str = "1"
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.tp_size <= 0 or self.pp_size <= 0:
            raise ValueError("tp_size and pp_size must be positive")
        if not self.groups:
            raise ValueError("a layout needs at least one cache group")
        for i, g in enumerate(self.groups):
            if len(g.shards) != self.world_size:
                raise ValueError(
                    f"group {i} has {len(g.shards)} rank shards, layout has {self.world_size} ranks"
                )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def has_state(self) -> bool:
        return any(g.is_state for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "engine": self.engine,
            "engine_layout_version": self.engine_layout_version,
            "extra": [list(kv) for kv in self.extra],
            "groups": [
                {
                    "kind": g.kind.value,
                    "window": g.window,
                    "family": g.family.value if g.family else None,
                    "name": g.name,
                    "shards": [[[list(t.shape), t.dtype] for t in shard] for shard in g.shards],
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheLayout:
        groups = tuple(
            CacheGroup(
                kind=GroupKind(g["kind"]),
                shards=tuple(
                    tuple(TensorSpec(tuple(shape), dtype) for shape, dtype in shard)
                    for shard in g["shards"]
                ),
                window=g["window"],
                family=StateFamily(g["family"]) if g["family"] else None,
                name=g["name"],
            )
            for g in data["groups"]
        )
        return cls(
            model=data["model"],
            revision=data["revision"],
            block_size=data["block_size"],
            groups=groups,
            tp_size=data["tp_size"],
            pp_size=data["pp_size"],
            engine=data["engine"],
            engine_layout_version=data["engine_layout_version"],
            extra=tuple((k, v) for k, v in data["extra"]),
        )

    def fingerprint(self, formats: tuple[int, ...] = ()) -> bytes:
        """16 bytes naming this exact layout; stable across processes and machines. ``formats``:
        the versions objects of it are stored in (the vault's codec and record versions), so
        a new format names everything anew and never meets the old one's bytes."""
        described = self.to_json()
        if formats:
            described["formats"] = list(formats)
        canon = json.dumps(described, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canon.encode(), digest_size=16, person=b"pv-layout").digest()
