"""Where a store keeps its bytes (``Store.medium``), which labels its hits in vLLM's metrics:
read from the mounts this machine really has, never assumed from a path's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixvault.stores import open_store
from prefixvault.stores.base import MEMORY_FILE_SYSTEMS, Medium, medium_of_path
from prefixvault.stores.breaker import BreakerStore
from prefixvault.stores.memory import MemoryStore


def _mounts() -> list[tuple[str, str]]:
    lines = Path("/proc/self/mounts").read_text().splitlines()
    return [(f[1], f[2]) for f in (line.split() for line in lines) if len(f) >= 3]


def test_a_directory_on_tmpfs_is_memory_and_one_on_disk_is_disk(tmp_path: Path) -> None:
    mounts = _mounts()
    tmpfs = [point for point, kind in mounts if kind in MEMORY_FILE_SYSTEMS and Path(point).is_dir()]
    root = [kind for point, kind in mounts if point == "/"][-1]
    if not tmpfs:
        pytest.fail(f"this machine should mount a tmpfs (/dev/shm): {mounts}")
    assert medium_of_path(str(Path(tmpfs[0]) / "not" / "there")) is Medium.MEMORY
    if any(point in ("/usr", "/usr/") for point, _ in mounts):
        pytest.fail("/usr should be a directory of the root file system here")
    expected = Medium.MEMORY if root in MEMORY_FILE_SYSTEMS else Medium.DISK
    assert medium_of_path("/usr") is expected  # (the root file system's)


def test_each_store_says_where_its_bytes_are(tmp_path: Path) -> None:
    assert MemoryStore().medium is Medium.MEMORY
    shm = Path("/dev/shm")
    if shm.is_dir():
        store = open_store(f"local://{shm}/pv-medium-{tmp_path.name}?capacity=1MiB")
        try:
            assert store.medium is Medium.MEMORY
        finally:
            store.close()
            import shutil

            shutil.rmtree(shm / f"pv-medium-{tmp_path.name}", ignore_errors=True)
    local = open_store(f"local://{tmp_path}/store?capacity=1MiB")
    assert local.medium is medium_of_path(str(tmp_path))
    local.close()

    def never(uri: str) -> MemoryStore:
        raise AssertionError("not opened")

    assert BreakerStore("redis://127.0.0.1:1/0", never).medium is Medium.NETWORK  # before it opens
    assert BreakerStore("memory://", never, MemoryStore()).medium is Medium.MEMORY
