"""The local store's files: owner-only by default, the group's with ``?shared=1``, under any
umask (issue 31: the WAL and SHM were 0644 under umask 022; a shared store's directory 0750)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixvault.stores.local import LocalStore


@pytest.fixture(params=[0o022, 0o077, 0o002, 0o000])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for entry in os.scandir(root):
        name = "slab" if entry.name.startswith("slab-") else entry.name
        out[name] = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_index_log_files_and_slabs_have_the_store_mode_under_any_umask(
        tmp_path: Path, umask: int, shared: bool) -> None:
    root = tmp_path / "s"
    store = LocalStore(root, capacity=64 << 20, shared=shared)
    assert store.put_many([("a/b/s/k", [b"x" * (300 << 10)]), ("a/b/r/k", [b"small"])]) == [True, True]
    reader = LocalStore(root, existing=True)  # a second connection keeps the WAL and SHM around
    assert reader.get_many(["a/b/r/k"]) == [b"small"]
    modes = _modes(root)
    file_mode, dir_mode = (0o660, 0o770) if shared else (0o600, 0o700)
    for name in ("index.db", "index.db-wal", "index.db-shm", "index.db.lock", "slab"):
        assert modes.get(name) == file_mode, (name, oct(modes.get(name, 0)), oct(umask))
    assert modes["."] == dir_mode and modes["writers"] == dir_mode, {k: oct(v) for k, v in modes.items()}
    reader.close()
    store.close()


def test_log_files_left_open_to_others_by_an_older_version_are_tightened(tmp_path: Path) -> None:
    root = tmp_path / "s"
    LocalStore(root, capacity=64 << 20).close()
    for name in ("index.db-wal", "index.db-shm"):
        (root / name).touch()
        os.chmod(root / name, 0o644)
    os.chmod(root / "index.db", 0o644)
    with LocalStore(root) as store:
        assert store.put_many([("k", [b"v"])]) == [True]
        modes = _modes(root)
    assert {n: oct(modes[n]) for n in ("index.db", "index.db-wal", "index.db-shm") if n in modes} == {
        n: "0o600" for n in ("index.db", "index.db-wal", "index.db-shm") if n in modes}
