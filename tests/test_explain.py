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


METRICS = """\
# TYPE vllm:prefixvault_estimate_compute_us_per_token gauge
vllm:prefixvault_estimate_compute_us_per_token{engine="0",model_name="m"} 200.0
vllm:prefixvault_estimate_step_us{engine="0",model_name="m"} 30000.0
vllm:prefixvault_estimate_lookup_us{engine="0",model_name="m"} 20000.0
vllm:prefixvault_estimate_load_bytes_per_s{engine="0",model_name="m"} 1.0e+09
vllm:prefixvault_estimate_load_in_step_bytes_per_s{engine="0",model_name="m"} 4.0e+09
"""


def test_explain_says_whether_an_engine_would_restore_the_hit_or_compute_it(tmp_path: Path) -> None:
    """With ``--engine``, the estimates an engine exports decide as its ``restore_when:
    faster`` would: 40 tokens at 0.2 ms each (8 ms) do not pay for a 20 ms round trip and a
    30 ms step; held 0 tokens of a longer prompt, they would."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from prefixvault.costs import estimates_from_metrics

    est = estimates_from_metrics(METRICS)
    assert est.compute_s_per_token is not None and est.step_s is not None and est.lookup_s is not None
    figures = (est.compute_s_per_token, est.step_s, est.lookup_s)
    assert [round(v * 1e6) for v in figures] == [200, 30000, 20000]
    assert est.transfer_s_per_byte == 1e-9 and est.in_step_s_per_byte == 0.25e-9
    uri = f"local://{tmp_path}/store?capacity=64MiB"
    store = open_store(uri)
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    vault.keep_layout()
    (report,) = explain(store, TOKENS[:41], costs=est).layouts
    assert report.judgment == "not_worth_it" and report.compute_s is not None and report.load_s is not None
    assert report.compute_s < report.load_s
    cheap = estimates_from_metrics(METRICS.replace(" 200.0", " 20000.0"))  # 20 ms a token
    (report,) = explain(store, TOKENS[:41], costs=cheap).layouts
    assert report.judgment == "pays"
    (report,) = explain(store, TOKENS[:41], costs=est, local=40).layouts
    assert report.judgment is None  # the engine holds it all: nothing to restore
    store.close()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = METRICS.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ids = tmp_path / "ids.json"
        ids.write_text(json.dumps(TOKENS[:41]))
        res = CliRunner().invoke(app, ["explain", "--store", uri, "--model", "m", "--token-ids", str(ids),
                                       "--engine", f"http://127.0.0.1:{server.server_port}"])
        assert res.exit_code == 0, res.output
        assert "restore_when: faster computes it instead (not_worth_it)" in res.output, res.output
        bad = CliRunner().invoke(app, ["explain", "--store", uri, "--model", "m", "--token-ids", str(ids),
                                       "--engine", "ftp://x"])
        assert bad.exit_code == 2 and "--engine must be" in bad.output
    finally:
        server.shutdown()
