#!/usr/bin/env python3
"""Other vLLM versions' Python, beside the installed one, for the scheduler contract suite.

Why: the connector must keep its contract with every vLLM it supports (0.32-0.34), but only
0.32 has a CPU build, and one virtualenv holds one vLLM. vLLM's scheduler and KV cache manager
are plain Python, so the suite (tests/contract) runs against another version's *sources*: its
wheel's ``vllm/**.py`` (and its package metadata, so ``importlib.metadata`` sees that version)
extracted to ``.vllm-versions/<version>/`` and put first on PYTHONPATH, while torch and the
rest come from the virtualenv. Nothing compiled is used: no model runs.

    tools/vllm_versions.py fetch [VERSION...]        download (hash-pinned) and extract, once
    tools/vllm_versions.py run [-j N] [VERSION...] [-- PYTEST_ARGS...]
                                                     the contract suite once per version

``0.32.0`` means the installed vLLM (CPU build); others are fetched. A version is extracted
once: ``.vllm-versions/<version>/.stamp`` records the wheel's hash and what was taken.
Standard library only; run it with the virtualenv's Python (it calls ``-m pip`` and
``-m pytest`` with the same interpreter).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".vllm-versions"
SUITE = "tests/contract"
#: The installed vLLM (the CPU build the virtualenv pins): run as is, nothing fetched.
INSTALLED = "0.32.0"
#: PyPI's x86_64 wheels (cp38-abi3, manylinux_2_28), pinned by hash: a re-published or
#: tampered file is refused by pip (``--require-hashes``).
WHEELS = {
    "0.33.0": "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    "0.34.0": "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
}
ALL = (INSTALLED, *WHEELS)
#: What is taken from a wheel: the package's Python and its metadata (no RECORD: it lists
#: compiled files that are not taken). Bump LAYOUT when this changes: stamps are re-made.
LAYOUT = "1"
METADATA = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")


def _wanted(name: str, version: str) -> bool:
    if name.startswith("vllm/"):
        return name.endswith(".py") or name == "vllm/py.typed"
    dist = f"vllm-{version}.dist-info/"
    return name.startswith(dist) and name[len(dist):] in METADATA


def source_dir(version: str) -> Path | None:
    """Where ``version``'s sources are (None: the installed vLLM)."""
    return None if version == INSTALLED else CACHE / version


def _stamp(version: str) -> str:
    return json.dumps({"version": version, "sha256": WHEELS[version], "layout": LAYOUT}, sort_keys=True)


def fetch(version: str, log: bool = True) -> float:
    """Download and extract ``version`` unless its stamp says it is there; seconds spent."""
    if version not in WHEELS:
        if version == INSTALLED:
            return 0.0
        raise SystemExit(f"unknown vLLM version {version} (known: {', '.join(ALL)})")
    dest = CACHE / version
    stamp = dest / ".stamp"
    if stamp.is_file() and stamp.read_text() == _stamp(version):
        return 0.0
    t0 = time.monotonic()
    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{version}-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"vllm=={version} --hash=sha256:{WHEELS[version]}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--require-hashes", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                        "-r", str(req), "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        with wheel.open("rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if got != WHEELS[version]:  # pip checked it; this is the record of what was extracted
            raise SystemExit(f"vllm {version}: wheel hash {got} is not the pinned {WHEELS[version]}")
        t1 = time.monotonic()
        out = Path(tmp) / "src"
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if _wanted(n, version)]
            zf.extractall(out, names)
        if not (out / "vllm" / "_version.py").is_file():
            raise SystemExit(f"vllm {version}: the wheel has no vllm/_version.py")
        (out / ".stamp").write_text(_stamp(version))
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    if log:
        print(f"vllm {version}: downloaded in {t1 - t0:.1f}s, extracted {len(names)} files in "
              f"{time.monotonic() - t1:.1f}s to {dest.relative_to(ROOT)}", flush=True)
    return time.monotonic() - t0


@dataclass
class Result:
    version: str
    passed: int
    failed: int
    skipped: int
    seconds: float
    returncode: int
    output: str

    def line(self) -> str:
        return (f"vllm {self.version}: {self.passed} passed, {self.failed} failed, {self.skipped} skipped "
                f"in {self.seconds:.0f}s")


def run_suite(version: str, pytest_args: list[str]) -> Result:
    """The contract suite in a pytest of its own, with ``version``'s vLLM imported."""
    # vLLM caches what it inspects of a model class under one file per class, keyed by the
    # source's hash: versions sharing it would inspect again (a subprocess) at every switch.
    CACHE.mkdir(exist_ok=True)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CACHE_ROOT=str(CACHE / f"cache-{version}"))
    src = source_dir(version)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="contract-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               SUITE, *pytest_args]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        counts = dict(tests=0, failures=0, errors=0, skipped=0)
        if junit.is_file():
            root = ET.parse(junit).getroot()
            for suite in ([root] if root.tag == "testsuite" else list(root)):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    if proc.returncode and not failed:  # no report, or a crash: count it as a failure
        failed = 1
    return Result(version, passed, failed, counts["skipped"], seconds, proc.returncode,
                  proc.stdout + proc.stderr)


def run(versions: list[str], pytest_args: list[str], jobs: int = 1) -> list[Result]:
    """Fetch what is missing, then the suite once per version (``jobs`` at a time)."""
    for v in versions:
        fetch(v)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda v: run_suite(v, pytest_args), versions))
    for r in results:
        if r.failed:
            print(f"---- vllm {r.version} ----\n{r.output.rstrip()}", flush=True)
    for r in results:
        print(r.line(), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["fetch", "run"])
    parser.add_argument("versions", nargs="*", default=None, help=f"default: {' '.join(ALL)}")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="versions run at once")
    args = parser.parse_intermixed_args(argv)
    versions = args.versions or list(ALL)
    unknown = [v for v in versions if v not in ALL]
    if unknown:
        parser.error(f"unknown version(s) {unknown}; known: {list(ALL)}")
    if args.command == "fetch":
        for v in versions:
            if not fetch(v):
                print(f"vllm {v}: {'installed' if v == INSTALLED else 'already extracted'}")
        return 0
    results = run(versions, pytest_args, args.jobs)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
