"""One answer to "can boundary b resume": ``Coverage``, asked by lookups and ``explain``, and
``audit`` held to it. Real vault and memory store; objects and records removed at random."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_vault import BS, fill, layout

from prefixvault.coverage import Coverage
from prefixvault.explain import GONE, RESTORABLE, explain
from prefixvault.inventory import audit
from prefixvault.layout import GroupKind
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault

TOKENS = list(range(64))  # eight blocks
PROMPT = [*TOKENS[:56], 999]  # restores up to 56 tokens


def test_a_boundary_resumes_only_with_every_object_it_needs() -> None:
    lay = layout()  # full attention, a one-block sliding window, a state group
    cov = Coverage.from_flags(lay, [(0, 0, range(6), [True, True, False, True, True, True]),
                                    (1, 0, range(6), [True] * 5 + [False]),
                                    (2, 0, [5, 3, 1], [True, False, True])])
    assert cov.missing == {(0, 0): [2], (1, 0): [5], (2, 0): [3]}
    assert cov.resumable(2 * BS)  # blocks 0-1, window block 1, state at index 1
    assert cov.first_missing(3 * BS) == (0, 0, 2)  # full attention needs block 2 from here on
    assert cov.missing_at(4 * BS) == [(0, 0, 2), (2, 0, 3)]
    assert cov.missing_at(6 * BS, kinds=frozenset({GroupKind.SLIDING_WINDOW})) == [(1, 0, 5)]
    assert not cov.resumable(6 * BS)


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(range(BS, 57, BS)), min_size=1),
       st.lists(st.integers(0, 10_000), max_size=12))
def test_lookup_explain_and_audit_agree_on_what_resumes(boundaries: set[int], removals: list[int]) -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    published = fill(vault, TOKENS, sorted(boundaries))
    vault.keep_layout()
    keys = sorted(k for k, _ in store.scan() if not k.endswith("/layout"))
    gone = {keys[i % len(keys)] for i in removals}
    store.delete_many(sorted(gone))

    hit = vault.lookup(vault.hashes(PROMPT), len(PROMPT))
    (report,) = explain(store, PROMPT).layouts
    assert report.restorable == hit
    status = {b.tokens: b.status for b in report.boundaries}

    found = audit(store)
    broken, unknown = found.broken_records, {f.record_key for f in found.unverifiable}
    hashes = vault.hashes(TOKENS)
    for b in published:
        rkey = vault.keys.record(hashes[b // BS - 1])
        if rkey in gone or rkey in unknown:
            continue  # no record to judge, or audit cannot judge it (a parent record is gone)
        assert status[b] in (RESTORABLE, GONE)
        assert (rkey in broken) == (status[b] == GONE), (b, status[b], found.findings)
