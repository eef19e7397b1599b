"""The scheduler contract suite (tests/contract) once per supported vLLM version.

    python bench/vllm_versions.py [-j N] [VERSION...] [-- PYTEST_ARGS...]

Why: one line that says, for every vLLM the connector supports, whether its scheduler side
keeps its contract with that version's real scheduler (``tools/vllm_versions.py`` fetches
the versions not installed and runs the suite with each one's sources first on PYTHONPATH).
Printed: the fetch time of each version (0 when already extracted), each run's counts and
wall time, and, as the last line, one JSON object
``{"0.32.0": {"passed": N, "failed": 0, "skipped": 0, "seconds": S}, ...}``.
Exit status 1 if any version failed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType


def _tool() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "tools" / "vllm_versions.py"
    spec = importlib.util.spec_from_file_location("vllm_versions_tool", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    tool = _tool()
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    jobs = 1
    if argv[:1] in (["-j"], ["--jobs"]):
        jobs, argv = int(argv[1]), argv[2:]
    versions = argv or list(tool.ALL)
    for v in versions:
        t0 = time.monotonic()
        tool.fetch(v)
        print(f"vllm {v}: fetch {time.monotonic() - t0:.1f}s", flush=True)
    results = tool.run(versions, pytest_args, jobs)
    summary = {r.version: {"passed": r.passed, "failed": r.failed, "skipped": r.skipped,
                           "seconds": round(r.seconds, 1)} for r in results}
    print(json.dumps(summary))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
