"""Compare what a producer published with what a reference producer published.

Why not bytes alone: vLLM on CPU is not batch-invariant. A state or KV block computed while
other requests share the step, or with other chunk ends, differs from a reference computed
alone in the last bits (relative L2 error up to ~3e-3 for GDN states here), while a state taken
from another position — the seed bug's class — is off by O(1). So each object is compared
tensor by tensor as numbers: identical bytes, or relative L2 error below a tolerance far from
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixvault.codec import HEADER_SIZE
from prefixvault.inventory import load_layouts
from prefixvault.keys import ExtraKeys, chain_hashes, tail_hash
from prefixvault.layout import CacheLayout, TensorSpec
from prefixvault.stores import Store

#: Relative L2 error under which two objects hold the same values computed differently.
SAME_VALUES = 0.05


def _values(payload: bytes, spec: TensorSpec) -> np.ndarray:
    if spec.dtype == "bfloat16":
        bits = np.frombuffer(payload, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if spec.dtype.startswith("float8"):
        return np.frombuffer(payload, np.uint8).astype(np.float64)  # compared as codes
    return np.frombuffer(payload, np.dtype(spec.dtype)).astype(np.float64)


def relative_error(a: bytes, b: bytes, specs: Sequence[TensorSpec]) -> float:
    """Largest relative L2 error, over the object's tensors, of payload ``a`` against ``b``."""
    if len(a) != len(b):
        return float("inf")
    worst, off = 0.0, 0
    for spec in specs:
        n = spec.nbytes
        x, y = _values(a[off:off + n], spec), _values(b[off:off + n], spec)
        off += n
        if x.size == 0 or a[off - n:off] == b[off - n:off]:
            continue
        scale = float(np.linalg.norm(y))
        err = float(np.linalg.norm(x - y))
        worst = max(worst, err / scale if scale else float("inf"))
    return worst


@dataclass(frozen=True)
class ObjectMatch:
    suffix: str  # the key without its namespace: kind/group/rank/hash
    is_state: bool
    error: float | None  # None: the reference has no such object


def compare_namespaces(store: Store, namespace: str, reference: str) -> list[ObjectMatch]:
    """Every block and state object of ``namespace`` against the same key in ``reference``."""
    layouts = [lay for lay in load_layouts(store).values() if lay is not None]
    if not layouts:
        raise ValueError("no layout object in the store")
    layout: CacheLayout = layouts[0]
    ours = {k.split("/", 2)[2]: k for k, _ in store.scan(f"{namespace}/") if "/s/" in k or "/b/" in k}
    refs = {k.split("/", 2)[2]: k for k, _ in store.scan(f"{reference}/") if "/s/" in k or "/b/" in k}
    out = []
    for suffix, key in sorted(ours.items()):
        kind, group, rank = suffix.split("/")[:3]
        if suffix not in refs:
            out.append(ObjectMatch(suffix, kind == "s", None))
            continue
        a, b = store.get_many([key, refs[suffix]])
        assert a is not None and b is not None, suffix
        specs = layout.groups[int(group)].shards[int(rank)]
        out.append(ObjectMatch(suffix, kind == "s", relative_error(a[HEADER_SIZE:], b[HEADER_SIZE:], specs)))
    return out


def published_state_boundaries(store: Store, namespace: str, prompts: Sequence[Sequence[int]],
                               block_size: int) -> dict[str, set[tuple[int, int]]]:
    """Each state object of ``namespace``, by key, with the (prompt index, boundary) it names: a
    block boundary (its chain hash) or a tail boundary inside a block (its tail hash)."""
    where: dict[str, set[tuple[int, int]]] = {}
    for i, prompt in enumerate(prompts):
        chain = chain_hashes(prompt, block_size)
        for j, h in enumerate(chain):
            where.setdefault(h.hex(), set()).add((i, (j + 1) * block_size))
        seed = ExtraKeys().seed()
        for t in range(1, len(prompt) + 1):
            if t % block_size:
                k = t // block_size
                name = tail_hash(chain[k - 1] if k else seed, prompt[k * block_size : t])
                where.setdefault(name.hex(), set()).add((i, t))
    return {key: where.get(key.rsplit("/", 1)[1], set())
            for key, _ in store.scan(f"{namespace}/") if key.split("/")[2] == "s"}
