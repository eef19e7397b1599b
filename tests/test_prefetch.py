"""A lookup that reads its hit's objects ahead (a synchronous load's) reads them in its first
round trip where the store pipelines a check and a read (Redis, Valkey, Mooncake): a restore then costs one
round trip before its answer, not two. Real vault; a memory store marked as pipelining, that
counts its calls (one per round trip); no engine."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_in_step_loads import corrupt_state
from test_tails import publish
from test_vault import fill, layout

from prefixvault import lookup as lookup_module
from prefixvault.guard import Guard
from prefixvault.keys import ExtraKeys
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.in_step import ReadAheadBudget
from prefixvault.vllm.lookups import Lookups

TOKENS = list(range(64))


class Pipelined(MemoryStore):
    """A network store whose ``touch_and_get`` is one round trip; lookup-lane calls are counted."""

    remote = True
    pipelines = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def touch_and_get(self, keys: Sequence[str], touch: Sequence[bool] | None, reads: Sequence[str],
                      sizes: Sequence[int] | None = None) -> tuple[list[bool], list[bytes | None]]:
        self.calls.append("touch+get")
        return MemoryStore.touch_many(self, keys, touch), MemoryStore.get_many(self, reads)

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        self.calls.append("touch")
        return super().touch_many(keys, touch)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        self.calls.append("get")
        return super().get_into(keys, buffers)


def _ask(min_tokens: int) -> dict[str, object]:
    return dict(prompt=TOKENS[:41], extra=ExtraKeys(), known=[], num_tokens=41, min_tokens=min_tokens,
                saving=None)


def _read_ahead(store: Pipelined, vault: Vault, min_tokens: int, read_from: int) -> tuple[int, set[str]]:
    """A lookup reading ahead: its hit, and the keys of the objects read ahead (then let go)."""
    lookups = Lookups(vault, Guard(), budget=ReadAheadBudget(1 << 20))
    try:
        _, found, ahead = lookups.submit(**_ask(min_tokens), read_from=read_from).result(5)  # type: ignore[arg-type]
        assert found is not None and ahead is not None
        keys = {r.key for r in ahead.objects}
        ahead.release()
        return found.hit, keys
    finally:
        lookups.close(5)


def test_a_hits_objects_are_read_in_the_lookups_first_round_trip() -> None:
    store = Pipelined()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    vault.refresh_deny()
    store.calls.clear()
    hit, keys = _read_ahead(store, vault, 16, 16)
    assert hit == 40
    assert keys == {r.key for r in vault.needed(vault.hashes(TOKENS[:41])[:5], 40, ranks=[0], since=16)}
    lookup_calls = [c for c in store.calls if c != "touch"]  # (the touch lane's, after the answer)
    assert lookup_calls == ["touch+get"]  # records, objects and the read: one round trip
    assert vault.counters.get_keys >= len(keys)  # counted as read from the store


def test_a_tail_hits_objects_are_read_in_the_round_trip_that_checks_them() -> None:
    """A tail is named only once its index is read (the first round trip): its objects are read
    in the second, which checks them, and reading ahead needs no third."""
    store = Pipelined()
    vault = Vault(store, layout())
    publish(vault, TOKENS, 16)
    publish(vault, TOKENS, 21, parent=16)  # a tail past block boundary 16
    vault.refresh_deny()
    store.calls.clear()
    lookups = Lookups(vault, Guard(), budget=ReadAheadBudget(1 << 20))
    try:
        ask = dict(_ask(0), prompt=TOKENS[:22], num_tokens=22)
        _, found, ahead = lookups.submit(**ask, read_from=0).result(5)  # type: ignore[arg-type]
        assert found is not None and found.hit == 21 and ahead is not None
        keys = {r.key for r in ahead.objects}
        ahead.release()
    finally:
        lookups.close(5)
    named = [*vault.hashes(TOKENS[:22])[: 21 // vault.layout.block_size], found.boundary_hash]
    assert keys == {r.key for r in vault.needed(named, 21, ranks=[0], since=0)}
    assert [c for c in store.calls if c != "touch"] == ["touch+get", "touch+get"]


def test_more_bytes_than_a_round_trip_is_worth_are_read_after_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = Pipelined()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    vault.refresh_deny()
    monkeypatch.setattr(lookup_module, "PREFETCH_BYTES", 100)  # less than one object
    store.calls.clear()
    hit, keys = _read_ahead(store, vault, 16, 16)
    assert hit == 40 and keys
    assert [c for c in store.calls if c != "touch"] == ["touch+get", "get"]


def test_a_prefetched_object_is_verified_as_any_read() -> None:
    store = Pipelined()
    vault = Vault(store, layout())
    key = corrupt_state(store, vault)
    lookups = Lookups(vault, Guard(), budget=ReadAheadBudget(1 << 20))
    try:
        _, found, ahead = lookups.submit(**_ask(16), read_from=16).result(5)  # type: ignore[arg-type]
    finally:
        lookups.close(5)
    assert found is not None and found.hit == 40 and ahead is None  # its load reads for itself
    assert sum(vault.counters.rejected.values()) >= 1
    assert store.get_many([key]) == [None]  # proved wrong: removed, as a load removes it
