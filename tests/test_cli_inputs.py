"""Hostile command lines and connector settings: each is one clear line (exit 2, or a
``ValueError`` naming the key), never a traceback, a hang or a silent default."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixvault.cli import app
from prefixvault.inputs import MAX_INPUT_BYTES, MAX_TOKEN_IDS, InputError, load_json, read_bounded
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
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(2 << 20)
    with pytest.raises(InputError, match="larger than 1 MiB"):
        read_bounded(str(big), "--prompt-file", limit=1 << 20)
    with pytest.raises(InputError, match="character device"):
        read_bounded("/dev/zero", "--prompt-file", limit=1 << 20)
    _one_line(["explain", "--store", store, "--model", "m", "--prompt-file", "/dev/zero"], "character device")
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", "/dev/zero"], "character device")
    _one_line(["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9",
               "--requests", "/dev/zero"], "character device")
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", str(tmp_path)], "a directory")
    assert MAX_INPUT_BYTES >= 1 << 20


def _within(seconds: float, fn: Callable[[], None]) -> None:
    """``fn()`` returns within ``seconds`` (run aside, so that a hang fails the test instead)."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    if errors:
        raise errors[0]


def test_a_named_pipe_nobody_writes_to_is_refused_at_once(store: str, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    pipe = str(fifo)
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    for args in (["explain", "--store", store, "--model", "m", "--prompt-file", pipe],
                 ["explain", "--store", store, "--model", "m", "--token-ids", pipe],
                 ["explain", "--store", store, "--model", "m", "--token-ids", str(ids), "--namespace", "t",
                  "--secret-file", pipe],
                 ["audit", "--store", store, "--namespace", "t", "--secret-file", pipe],
                 ["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9",
                  "--requests", pipe]):
        _within(10, lambda args=args: _one_line(args, "named pipe"))  # type: ignore[misc]

    def engine_start() -> None:
        with pytest.raises(ValueError, match="named pipe"):
            ConnectorSettings.from_extra({"namespace": "t", "namespace_secret_file": pipe})

    _within(10, engine_start)


def test_a_prompt_past_the_longest_context_is_refused(store: str, tmp_path: Path) -> None:
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1] * (MAX_TOKEN_IDS + 1)))
    _one_line(["explain", "--store", store, "--model", "m", "--token-ids", str(ids)],
              f"at most {MAX_TOKEN_IDS}")


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


def test_out_of_range_sizes_are_refused_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    _one_line(["repro", "--tp", str(10**30)], "--tp")
    _one_line(["repro", "--model", "x" * 5000], "longer than")
    import prefixvault.repro

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("repro built a model before checking its options")

    monkeypatch.setattr(prefixvault.repro, "run_repro", built)
    _one_line(["repro", "--capture", "sometimes"], "capture must be one of")
    _one_line(["repro", "--store", "ftp://x"], "unknown store URI")
    _one_line(["repro", "--store", "local://relative/path"], "three slashes")
    _one_line(["repro", "--store", "memory://"], "separate processes")


def test_repro_of_a_model_needing_torchvision_says_what_to_install(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's venv has no torchvision on its path (the engine tests add a copy of their
    own): a Qwen3.5 checkpoint's engine would fail at start with a pydantic error."""
    import importlib.util
    import sys

    if importlib.util.find_spec("torchvision") is not None:
        monkeypatch.setitem(sys.modules, "torchvision", None)  # (as where it is not installed)
    model = tmp_path / "qwen35"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    import prefixvault.repro

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("repro started before saying what is missing")

    monkeypatch.setattr(prefixvault.repro, "run_repro", built)
    _one_line(["repro", "--model", str(model)], "imports torchvision")
    _one_line(["repro", "--profile", "qwen3.5"], "imports torchvision")


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


def test_a_servers_password_is_sent_as_a_header_and_never_shown(tmp_path: Path) -> None:
    """A real loopback HTTP server behind basic auth: the credentials in the URL reach it as a
    header, and no message of ``verify`` or ``watch`` prints the password."""
    import base64
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from prefixvault.verify import VerifyError, served_models

    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization", "")))
            ok = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"ops:s3cret").decode()
            body = b'{"data": [{"id": "m"}]}' if ok and self.path == "/v1/models" else b"no"
            self.send_response(200 if ok and self.path == "/v1/models" else 503)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://ops:s3cret@127.0.0.1:{httpd.server_address[1]}"
        assert served_models(url) == ["m"]
        assert seen[0] == ("/v1/models", "Basic " + base64.b64encode(b"ops:s3cret").decode())
        with pytest.raises(VerifyError) as e:
            served_models(url.replace("ops:s3cret", "ops:wrong-s3cret"))
        assert "s3cret" not in str(e.value) and "ops:***@" in str(e.value)
        for args in (["verify", "--cold", url, "--restored", "http://ops:s3cret@127.0.0.1:9"],
                     ["verify", "--cold", "http://ops:s3cret@127.0.0.1:bad", "--restored", url],
                     ["watch", "--store", "memory://", "--cold", "http://ops:s3cret@127.0.0.1:9"]):
            res = CliRunner().invoke(app, args)
            assert res.exit_code != 0 and "s3cret" not in res.output, res.output
    finally:
        httpd.shutdown()
