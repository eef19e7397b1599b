"""Describe the cache views vLLM's own allocator hands a connector, for checks on machines
without vLLM (``bench/gpu_check.py``).

    PYTHONPATH=src .venv/bin/python tools/gen_views.py [--out tests/data/vllm_views.json]

Runs vLLM's planner and ``allocate_kv_cache`` (what the GPU model runners call) on
``device="meta"`` (no memory) for a small hybrid and Qwen3-Next-80B at TP1, in every layout
vLLM can pick for a hybrid (LBNHC, LBHNC, BLHNC, BLNHC) and with the attention group cut into
kernel blocks of 16 and 32 tokens (FlashInfer's sizes; vLLM cuts only layer-outermost
layouts). Each layer's view is written as dtype, shape, stride and storage offset, with what
vLLM's spec says one object of its group is. ``tests/test_blockio_fixture.py`` regenerates
it with the installed vLLM and fails on any drift.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefixvault.scenarios.cache_layouts import QWEN3_NEXT_80B_TP1, SMALL, VllmCache, vllm_cache
from prefixvault.vllm.kernel_blocks import describe

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_views.json"
LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC")
#: (layout, kernel block) cuts vLLM makes: only where layers are outermost (a block is one page).
SPLITS = (("LBNHC", 16), ("LBNHC", 32), ("LBHNC", 16), ("LBHNC", 32))


def config(cache: VllmCache) -> dict[str, Any]:
    groups = []
    for names, spec, nbytes in zip(cache.layer_groups, cache.specs, cache.spec_object_bytes(), strict=True):
        groups.append({"kind": "state" if hasattr(spec, "shapes") else "attention", "object_bytes": nbytes,
                       "layers": describe({n: cache.views[n] for n in names})})
    return {"geometry": cache.geometry.name, "layout": cache.layout, "block_size": cache.geometry.block_size,
            "kernel_block_size": cache.kernel_block_size, "num_blocks": cache.num_blocks,
            "raw_bytes": cache.raw_bytes, "groups": groups}


def build() -> dict[str, Any]:
    import vllm

    configs = []
    for geometry in (SMALL, QWEN3_NEXT_80B_TP1):
        cuts: list[tuple[str, int | None]] = [(lay, None) for lay in LAYOUTS]
        cuts += list(SPLITS)
        for layout, kbs in cuts:
            configs.append(config(vllm_cache(geometry, layout, kbs, "meta")))
    return {"generator": "tools/gen_views.py", "vllm": str(getattr(vllm, "__version__", "?")),
            "configs": configs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT)
    out = build()
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: {len(out['configs'])} configs (vLLM {out['vllm']})")


if __name__ == "__main__":
    main()
