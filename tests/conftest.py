"""Store fixtures: every kind of store, fresh and empty, behind the one Store contract.

Adding a kind of store to the conformance suite is one entry in ``STORE_KINDS``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixvault.stores import Store, open_store


@dataclass(frozen=True)
class StoreKind:
    #: (scratch dir, unique tag, capacity or None) -> URI of a fresh, empty store
    uri: Callable[[Path, str, str | None], str]
    #: whether other processes can open the same URI and see the same objects
    shared: bool


def _memory_uri(tmp: Path, tag: str, capacity: str | None) -> str:
    return f"memory://{tag}" + (f"?capacity={capacity}" if capacity else "")


def _local_uri(tmp: Path, tag: str, capacity: str | None) -> str:
    return f"local://{tmp / tag}?capacity={capacity or '256MiB'}"


STORE_KINDS: dict[str, StoreKind] = {
    "memory": StoreKind(_memory_uri, shared=False),
    "local": StoreKind(_local_uri, shared=True),
}

UriFactory = Callable[..., str]
_counter = itertools.count()


@pytest.fixture
def store_uri_factory(tmp_path: Path) -> UriFactory:
    """``make(kind, capacity=None) -> uri`` of a fresh store nobody has used yet."""

    def make(kind: str, capacity: str | None = None) -> str:
        tag = f"store-{os.getpid()}-{next(_counter)}"
        return STORE_KINDS[kind].uri(tmp_path, tag, capacity)

    return make


@pytest.fixture(params=sorted(STORE_KINDS))
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def shared_store_kind(store_kind: str) -> str:
    """A kind whose store other processes can open; the others are skipped."""
    if not STORE_KINDS[store_kind].shared:
        pytest.skip(f"{store_kind}:// lives in one process; no other process can open it")
    return store_kind


@pytest.fixture
def any_store(store_kind: str, store_uri_factory: UriFactory) -> Iterator[Store]:
    store = open_store(store_uri_factory(store_kind))
    try:
        yield store
    finally:
        store.close()
