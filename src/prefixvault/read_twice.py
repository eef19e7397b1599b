"""Reading objects whose failure leads to a removal or a replacement: what fails is read once more.

A store may return a torn object where a read races an overwrite of unchanged size (Mooncake
writes it in place: ``stores.mooncake``); the object then stored is whole. Bytes that fail
verification once prove nothing yet: removing or replacing the object on that evidence would
lose another writer's work. What fails is read once more, and only a failure on that read
stands. (A load reads into memory of its own first: ``loading.Loader._wrong_again``.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from prefixvault.codec import IntegrityError
from prefixvault.stores.base import Store

T = TypeVar("T")


def read_opened(store: Store, keys: Sequence[str],
                open_: Callable[[str, bytes], T]) -> list[T | IntegrityError | None]:
    """Each key's object as ``open_(key, bytes)`` opens it, None where there is none, or the
    ``IntegrityError`` it raised on the second of two reads (those that fail are read again,
    in one call)."""
    out = _opened(store, keys, open_)
    again = [i for i, r in enumerate(out) if isinstance(r, IntegrityError)]
    if again:
        for i, r in zip(again, _opened(store, [keys[i] for i in again], open_), strict=True):
            out[i] = r
    return out


def _opened(store: Store, keys: Sequence[str],
            open_: Callable[[str, bytes], T]) -> list[T | IntegrityError | None]:
    out: list[T | IntegrityError | None] = []
    for key, blob in zip(keys, store.get_many(list(keys)) if keys else [], strict=True):
        try:
            out.append(None if blob is None else open_(key, blob))
        except IntegrityError as e:
            out.append(e)
    return out
