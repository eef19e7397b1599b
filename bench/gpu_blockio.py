"""Block I/O against a plain pinned copy of the same bytes, on CUDA (or CPU), in one run.

    PYTHONPATH=src python bench/gpu_blockio.py [--device cuda] [--blocks 64] [--repeat 5]

Torch only (no vLLM: it runs on a GPU machine where vLLM's CUDA wheel is not installed). For
every physical layout vLLM can pick for an attention group (``KVCacheLayout``), and for a state
group, it builds per-layer cache tensors on the device, gathers ``--blocks`` random blocks into
pinned host memory with ``GroupIO.gather`` (device -> host), checks every byte against the
tensors, scatters them into other blocks with ``GroupIO.scatter`` (host -> device) and checks
again. Beside each, the same number of bytes copied with one plain ``copy_`` between a
contiguous device buffer and pinned host memory: the ratio is what the layout and the gather
cost over the link's own speed. Best of ``--repeat``. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from prefixvault.blockio import GroupIO
from prefixvault.scenarios.cache_layouts import LAYOUTS, attention_layers, state_layers

GOAL = 0.8  # of the plain pinned copy, both directions


def timed(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(name: str, layers: list[torch.Tensor], n: int, repeat: int, device: torch.device,
            gen: torch.Generator) -> dict[str, object]:
    io = GroupIO(layers)
    total = layers[0].shape[0]
    ids = torch.randperm(total, generator=gen)[: 2 * n].tolist()
    src_ids, dst_ids = ids[:n], ids[n:]
    pin = device.type == "cuda"
    host = torch.empty((n, io.object_bytes), dtype=torch.uint8, pin_memory=pin)
    host.fill_(0)  # pre-fault
    # correctness: every byte of the gather, then of the scatter
    io.gather(src_ids, host).wait()
    want = torch.stack([torch.cat([t[b].contiguous().view(torch.uint8).reshape(-1).cpu() for t in layers])
                        for b in src_ids])
    gathered_ok = bool(torch.equal(host, want))
    io.scatter(dst_ids, host)
    back = torch.stack([torch.cat([t[b].contiguous().view(torch.uint8).reshape(-1).cpu() for t in layers])
                        for b in dst_ids])
    scattered_ok = bool(torch.equal(back, want))
    plain_dev = torch.empty((n, io.object_bytes), dtype=torch.uint8, device=device)
    plain_dev.fill_(1)
    nbytes = n * io.object_bytes
    d2h = timed(lambda: io.gather(src_ids, host).wait(), device, repeat)
    plain_d2h = timed(lambda: host.copy_(plain_dev, non_blocking=pin), device, repeat)
    h2d = timed(lambda: io.scatter(dst_ids, host), device, repeat)
    plain_h2d = timed(lambda: plain_dev.copy_(host, non_blocking=pin), device, repeat)
    row = {
        "group": name, "block_compact": io.block_compact, "object_mib": round(io.object_bytes / 2**20, 3),
        "bytes": nbytes, "ok": gathered_ok and scattered_ok,
        "d2h_gbs": round(nbytes / d2h / 1e9, 2), "plain_d2h_gbs": round(nbytes / plain_d2h / 1e9, 2),
        "h2d_gbs": round(nbytes / h2d / 1e9, 2), "plain_h2d_gbs": round(nbytes / plain_h2d / 1e9, 2),
    }
    row["d2h_ratio"] = round(plain_d2h / d2h, 3)
    row["h2d_ratio"] = round(plain_h2d / h2d, 3)
    print(f"{name:6} compact={io.block_compact!s:5} ok={row['ok']!s:5} "
          f"gather {row['d2h_gbs']:7.2f} GB/s ({row['d2h_ratio']:.2f}x plain {row['plain_d2h_gbs']:.2f})  "
          f"scatter {row['h2d_gbs']:7.2f} GB/s ({row['h2d_ratio']:.2f}x plain {row['plain_h2d_gbs']:.2f})")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per gather/scatter")
    ap.add_argument("--pool", type=int, default=512, help="blocks in each cache tensor")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--content", type=int, default=256, help="K and V of one head, elements")
    ap.add_argument("--state", default="32,64,128", help="one state's shape per layer (float32)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layout in LAYOUTS:
        layers = attention_layers(layout, args.layers, args.pool, args.heads, args.block_size, args.content,
                                  torch.bfloat16, device, gen)
        rows.append(measure(layout, layers, args.blocks, args.repeat, device, gen))
        del layers
    shape = tuple(int(x) for x in args.state.split(","))
    states = state_layers(args.layers, max(2 * args.blocks, 8), shape, torch.float32, device, gen)
    rows.append(measure("state", states, args.blocks, args.repeat, device, gen))
    worst_d2h = min(float(r["d2h_ratio"]) for r in rows)  # type: ignore[arg-type]
    worst_h2d = min(float(r["h2d_ratio"]) for r in rows)  # type: ignore[arg-type]
    print(json.dumps({
        "bench": "gpu_blockio", "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "all_ok": all(r["ok"] for r in rows),
        "worst_d2h_ratio": worst_d2h, "worst_h2d_ratio": worst_h2d, "goal": GOAL,
        "meets_goal": worst_d2h >= GOAL and worst_h2d >= GOAL, "rows": rows,
    }))


if __name__ == "__main__":
    main()
