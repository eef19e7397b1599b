"""The prefixvault command: stats, audit and repair, and one-line errors for bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.cli import app
from prefixvault.codec import HEADER_SIZE
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores import open_store
from prefixvault.stores.local import LocalStore
from prefixvault.vault import ObjectRef, Vault

runner = CliRunner()


def _fill(uri: str) -> Vault:
    attn = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((4, 8), "float16")])
    state = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((16,), "float32")])
    vault = Vault(open_store(uri), CacheLayout(model="cli", block_size=4, groups=(attn, state)), "cli")
    tokens = list(range(16))
    hashes = vault.hashes(tokens)
    d = plan_saves(vault.layout, 16, {0: [1, 2, 3, 4]}, [StateCapture(1, 8, 5, 1), StateCapture(1, 16, 6, 1)],
                   step=1)

    def read(ref: ObjectRef, block_id: int) -> bytes:
        return bytes([block_id]) * vault.layout.groups[ref.group].nbytes(0)

    acks = vault.save(0, hashes, d.publishable, read)
    assert all(why is None for why in vault.publish(hashes, acks).values())
    return vault


def test_stats_counts_objects_by_group_kind() -> None:
    _fill("memory://cli-stats")
    res = runner.invoke(app, ["stats", "--store", "memory://cli-stats"])
    assert res.exit_code == 0, res.output
    assert "full_attention" in res.output and "state" in res.output
    assert "records: 2" in res.output


def test_stats_shows_the_states_budget(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/s?capacity=16MiB&states=25%"
    _fill(uri).store.close()
    res = runner.invoke(app, ["stats", "--store", f"local://{tmp_path}/s"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # as one line, however the console wraps it
    assert re.search(r"states take [1-9]\d* B of their budget 4\.0 MiB", text), text
    assert "states never take the rest of the capacity (12.0 MiB) from KV blocks" in text
    open_store(f"local://{tmp_path}/s?states=0").close()
    res = runner.invoke(app, ["stats", "--store", f"local://{tmp_path}/s"])
    assert "(no budget of their own" in " ".join(res.output.split()), res.output


def test_stats_shows_each_namespaces_space_and_its_bound(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/s?capacity=16MiB&namespace_share=50%"
    _fill(uri).store.close()
    other = Vault(open_store(f"local://{tmp_path}/s"), CacheLayout(model="cli", block_size=4, groups=(
        CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((4, 8), "float16")]),)), "tenant-b")
    other.keep_layout()
    other.store.close()
    res = runner.invoke(app, ["stats", "--store", f"local://{tmp_path}/s"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "each bounded to 8.0 MiB: namespace_share" in text, text
    assert re.search(r"cli\W+\d+\W+[\d.]+ (K?i?B|KiB)", text) and "tenant-b" in text, text


def test_audit_finds_and_repairs_broken_records() -> None:
    vault = _fill("memory://cli-audit")
    res = runner.invoke(app, ["audit", "--store", "memory://cli-audit"])
    assert res.exit_code == 0 and "broken records: 0" in res.output, res.output
    store = vault.store
    hashes = vault.hashes(list(range(16)))
    state16 = next(r for r in vault.needed(hashes, 16) if r.kind.name == "STATE")
    blob = bytearray(store.get_many([state16.key])[0] or b"")
    blob[HEADER_SIZE] ^= 1
    store.put_many([(state16.key, [bytes(blob)])])
    block0 = vault.needed(hashes, 8)[0]
    store.delete_many([block0.key])  # breaks both records
    res = runner.invoke(app, ["audit", "--store", "memory://cli-audit"])
    assert res.exit_code == 1
    assert "payload checksum" in res.output and "missing object" in res.output
    assert "broken records: 2" in res.output
    res = runner.invoke(app, ["audit", "--store", "memory://cli-audit", "--repair"])
    assert res.exit_code == 0 and "removed: 2" in res.output
    assert store.exists_many([state16.key]) == [False]
    res = runner.invoke(app, ["audit", "--store", "memory://cli-audit"])
    assert "records: 0" in res.output and res.exit_code == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixvault.cli", *args], capture_output=True, text=True)


def test_bad_input_gets_one_clear_line(tmp_path: Path) -> None:
    for args, needle in [
        (["stats", "--store", "nosuch://x"], "unknown store URI"),
        (["stats", "--store", f"local://{tmp_path}/absent"], "does not exist"),
        (["audit", "--store", "local://host/x"], "three slashes"),
    ]:
        res = _cli(*args)
        assert res.returncode == 2, (args, res.stderr)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], res.stderr
        assert "Traceback" not in res.stderr


def test_help_lists_the_commands() -> None:
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("demo", "stats", "audit"):
        assert cmd in res.output


def test_watch_rejects_bad_options_in_one_line(tmp_path: Path) -> None:
    for args in (["--tolerance", "-1"], ["--interval", "0"], ["--namespace", "a b"]):
        cmd = ["watch", "--store", "memory://cli-watch", "--cold", "http://127.0.0.1:9", *args]
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and "Traceback" not in res.output, args
    res = runner.invoke(app, ["watch", "--store", f"local://{tmp_path}/none", "--cold", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_samples_round_trip_and_live_beside_their_record() -> None:
    from prefixvault.samples import VerifySample, pending_samples, write_sample

    vault = _fill("memory://cli-samples")
    record = vault.keys.record(vault.hashes(list(range(16)))[1])
    sample = VerifySample(list(range(16)), 8, record, [3, 4], 1.5, "host:1")
    assert write_sample(vault.store, sample)
    (key, got), = list(pending_samples(vault.store, "cli"))
    assert got == sample and key.startswith(record.rsplit("/r/", 1)[0] + "/v/")
    vault.store.put_many([(key + "x", [b"{not json"])])
    assert sorted(v is None for _, v in pending_samples(vault.store)) == [False, True]
    res = runner.invoke(app, ["stats", "--store", "memory://cli-samples"])
    assert "sample" in res.output


def test_read_commands_never_create_resize_or_write_a_local_store(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(app, ["stats", "--store", f"local://{empty}"])
    assert res.exit_code == 2 and "no local store" in res.output
    assert list(empty.iterdir()) == []  # nothing created
    uri = f"local://{tmp_path / 'full'}?capacity=64MiB"
    _fill(uri)
    with LocalStore(tmp_path / "full") as s:
        before = s.stats()
    for cmd in (["stats"], ["audit"]):
        res = runner.invoke(app, [*cmd, "--store", f"local://{tmp_path / 'full'}?capacity=1KiB"])
        assert res.exit_code == 0, res.output
        assert "records: 2" in res.output
    with LocalStore(tmp_path / "full") as s:
        assert s.stats() == before and before.capacity == 64 << 20  # not shrunk, nothing evicted
    res = runner.invoke(app, ["audit", "--repair", "--store", f"local://{tmp_path / 'full'}?capacity=1KiB"])
    assert res.exit_code == 0, res.output
    with LocalStore(tmp_path / "full") as s:
        assert s.stats().capacity == 64 << 20
