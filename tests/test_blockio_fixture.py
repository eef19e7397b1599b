"""The description of vLLM's cache views that ``bench/gpu_check.py`` runs from on a device
machine without vLLM (``tests/data/vllm_views.json``) rebuilds into the worker's block I/O, and
the device check passes on CPU. That the fixture is what each supported vLLM builds is a
contract test (``tests/contract/test_contract_views.py``), run once per version."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prefixvault.vllm.kernel_blocks import group_ios, rebuild

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "vllm_views.json"


def test_the_fixture_rebuilds_into_block_io_of_the_sizes_vllm_says() -> None:
    """What the device check does, on CPU, for the small geometry: one allocation, the views
    over it, the worker's registration; the objects are as big as vLLM's specs say."""
    for config in json.loads(FIXTURE.read_text())["configs"]:
        if config["geometry"] != "small":
            continue
        raw = torch.zeros(config["raw_bytes"], dtype=torch.uint8)
        groups = [g["layers"] for g in config["groups"]]
        views = rebuild({n: d for layers in groups for n, d in layers.items()}, raw)
        ios = group_ios(views, [list(layers) for layers in groups], config["num_blocks"])
        assert [io.object_bytes for io in ios] == [g["object_bytes"] for g in config["groups"]]
        for v in views.values():  # every view inside the one allocation
            last = v.storage_offset() + sum((s - 1) * st for s, st in zip(v.shape, v.stride(), strict=True))
            assert (last + 1) * v.element_size() <= config["raw_bytes"]


def test_the_device_check_runs_and_checks_bytes_on_cpu() -> None:
    """bench/gpu_check.py runs on a CUDA machine without vLLM; here it must at least pass on
    CPU, on the small geometry, with vLLM made unimportable (the worker is driven with torch
    alone), and say which CUDA-only parts it skipped."""
    import os
    import subprocess
    import sys

    no_vllm = ("import runpy, sys\n"
               "class NoVLLM:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'vllm' or name.startswith('vllm.'):\n"
               "            raise ModuleNotFoundError(f'No module named {name!r}', name='vllm')\n"
               "sys.meta_path.insert(0, NoVLLM())\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = [sys.executable, "-c", no_vllm, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu",
           "--only", "small"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["failed"] == [] and out["all_exact"]
    assert len(out["exact"]) == 8 and len(out["cross_backend"]) == 4
    assert all(r["ok"] for r in out["cross_backend"])
    assert any("ordering" in s for s in out["skipped"])
    assert out["worker_ok"] and {(r["config"], r["store"]) for r in out["worker"]} == {
        (c, s) for c in ("small/LBNHC/kbs64", "small/LBNHC/kbs16") for s in ("memory", "local")}
    assert all(r["published"] and r["restored_exact"] for r in out["worker"])
