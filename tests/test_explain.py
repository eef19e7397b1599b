"""``prefixvault explain`` names, boundary by boundary, why a prompt restores what it restores."""

from __future__ import annotations

import json
from pathlib import Path

from test_vault import BS, fill, layout
from typer.testing import CliRunner

from prefixvault.cli import app
from prefixvault.explain import GONE, NO_STATE, NOT_STORED, RESTORABLE, UNPUBLISHED, explain
from prefixvault.keys import ExtraKeys
from prefixvault.stores import open_store
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault

TOKENS = list(range(64))


def test_every_boundary_has_its_reason_and_the_hit_matches_a_lookup() -> None:
    store = MemoryStore()
    vault = Vault(store, layout())
    assert fill(vault, TOKENS, [16, 32, 48]) == [16, 32, 48]
    vault.keep_layout()
    h = vault.hashes(TOKENS)
    state32 = next(r for r in vault.needed(h, 32) if r.kind.name == "STATE")
    store.delete_many([state32.key, vault.keys.record(h[5])])  # 32 loses its state, 48 its record
    prompt = [*TOKENS[:56], 999]
    ex = explain(store, prompt)
    (report,) = ex.layouts
    assert report.restorable == vault.lookup(vault.hashes(prompt), len(prompt)) == 16
    assert report.longest == 56 and report.longest_record == 32
    status = {b.tokens: b.status for b in report.boundaries}
    assert status == {56: NOT_STORED, 48: UNPUBLISHED, 40: NO_STATE, 32: GONE, 24: NO_STATE,
                      16: RESTORABLE, 8: NO_STATE}
    assert next(b for b in report.boundaries if b.tokens == 32).missing == [state32.key]


def test_records_elsewhere_are_found() -> None:
    store = MemoryStore()
    mine, theirs = Vault(store, layout(), "default"), Vault(store, layout(), "tenant-b")
    fill(theirs, TOKENS, [16, 40])
    fill(mine, TOKENS, [16])
    for v in (mine, theirs):
        v.keep_layout()
    ex = explain(store, TOKENS[:41], "default")
    assert ex.restorable == 16
    assert ex.elsewhere == ["namespace 'tenant-b': records up to 40 tokens, 40 restorable"]
    salted = explain(store, TOKENS[:41], "default", cache_salt="s1")
    assert salted.restorable == 0
    assert salted.elsewhere == ["without the cache salt: records up to 16 tokens"]
    assert mine.lookup(mine.hashes(TOKENS[:41], ExtraKeys(cache_salt="s1")), 41) == 0


def test_layouts_that_differ_say_in_what(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/store?capacity=64MiB"
    store = open_store(uri)
    a = Vault(store, layout())
    fill(a, TOKENS, [16, 40])
    a.keep_layout()
    other = layout(world=2)  # the same model served with TP 2
    b = Vault(store, other)
    fill(b, TOKENS, [16], world=2)
    b.keep_layout()
    store.close()
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(TOKENS[:41]))
    res = CliRunner().invoke(app, ["explain", "--store", uri, "--model", str(tmp_path / "no-model"),
                                   "--token-ids", str(ids), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["restorable"] == 40
    assert [r["restorable"] for r in out["layouts"]] == [40, 16]
    assert out["layouts"][1]["differs"] == ["groups", "tp_size"]
    text = CliRunner().invoke(app, ["explain", "--store", uri, "--model", "m", "--token-ids", str(ids)])
    assert text.exit_code == 0 and "restorable 40 of 40 tokens" in text.output, text.output
    assert f"{BS * 4}..{BS}" in text.output or "restorable" in text.output
    bad = CliRunner().invoke(app, ["explain", "--store", uri, "--model", "m"])
    assert bad.exit_code == 2 and "--prompt-file or --token-ids" in bad.output
