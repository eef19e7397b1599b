"""Hostile command lines and connector settings: each is one clear line (exit 2, or a
``ValueError`` naming the key), never a traceback, a hang or a silent default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixvault.cli import app
from prefixvault.inputs import MAX_INPUT_BYTES, InputError, load_json, read_bounded
from prefixvault.vllm.config import ConnectorSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    from prefixvault.stores import open_store

    path = tmp_path_factory.mktemp("cli-inputs") / "store"
    open_store(f"local://{path}").close()
    return f"local://{path}"


def _one_line(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and needle in res.output, res.output


def test_endless_files_are_refused_not_read_forever(store: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="larger than"):
        read_bounded("/dev/zero", "--prompt-file", limit=1 << 20)
    _one_line(["explain", "--store", store, "--model", "m", "--prompt-file", "/dev/zero"], "larger than")
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", "/dev/zero"], "larger than")
    _one_line(["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9",
               "--requests", "/dev/zero"], "larger than")
    assert MAX_INPUT_BYTES >= 1 << 20


def test_deep_or_huge_json_is_one_line(store: str, tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError, match="nested deeper"):
        load_json(str(deep), "--token-ids")
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", str(deep)], "nested deeper")
    _one_line(["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9",
               "--requests", str(deep)], "nested deeper")
    big = tmp_path / "big.json"
    big.write_text(json.dumps([1, 2**64 + 5]))
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", str(big)], "token ids in 0..")
    bools = tmp_path / "bools.json"
    bools.write_text("[true, 3]")
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", str(bools)], "token ids in 0..")


def test_long_paths_and_names_are_one_line(store: str, tmp_path: Path) -> None:
    long = "a" * 5000
    _one_line(["audit", "--store", f"local:///{long}", "--repair"], "error")
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    _one_line(["explain", "--store", store, "--model", "m" * 5000, "--token-ids", str(ids)], "longer than")


def test_out_of_range_sizes_are_refused_before_any_work() -> None:
    _one_line(["repro", "--tp", str(10**30)], "--tp")
    _one_line(["repro", "--model", "x" * 5000], "longer than")


def test_the_demo_refuses_a_store_its_processes_cannot_share() -> None:
    _one_line(["demo", "--store", "memory://"], "separate processes")


def test_serve_says_where_the_model_goes_and_hides_the_password() -> None:
    _one_line(["serve", "--", "--dry-run"], "the model comes before '--'")
    res = CliRunner().invoke(app, ["serve", "m", "--store", "redis://:s3cret@127.0.0.1:6379/0", "--dry-run"])
    if res.exit_code == 2 and "vLLM is not installed" in res.output:
        pytest.skip("no vLLM in this environment")  # the command is built from vLLM's entry point
    assert res.exit_code == 0, res.output
    assert "s3cret" not in res.output and "***" in res.output


def test_demo_output_hides_the_password(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import prefixvault.demo as demo

    def stop(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stop")  # the first line is printed before any store is opened

    monkeypatch.setattr(demo, "_in_process", stop)
    with pytest.raises(RuntimeError):
        demo.run("redis://:s3cret@127.0.0.1:1/0")
    out = capsys.readouterr().out
    assert "store=redis://" in out and "s3cret" not in out


@pytest.mark.parametrize("extra,key", [
    ({"capture_interval": None}, "capture_interval"),
    ({"capture_interval": float("inf")}, "capture_interval"),
    ({"capture_interval": [1]}, "capture_interval"),
    ({"capture_interval": 2.5}, "capture_interval"),
    ({"capture": "interval", "capture_interval": "x"}, "capture_interval"),
    ({"namespace": None}, "namespace"),
    ({"store": 5}, "store"),
    ({"capture": ["steps"]}, "capture"),
    ({"model_id": {"a": 1}}, "model_id"),
    ({"output_boundaries": None}, "output_boundaries"),
    ({"namespace_secret_file": 3}, "namespace_secret_file"),
    ({"verify_sample": True}, "verify_sample"),
])
def test_connector_settings_name_the_bad_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError) as err:
        ConnectorSettings.from_extra(extra)
    assert key in str(err.value) and "\n" not in str(err.value)
