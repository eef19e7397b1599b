"""Bad store URIs and sizes are one clear line (StoreError; exit 2 from the CLI), never a
traceback and never a silent default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixvault.cli import app
from prefixvault.keys import check_namespace
from prefixvault.stores import StoreError, open_store
from prefixvault.units import parse_size

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a fuzzed --model never reaches for the network

BAD = [
    ("local:///tmp/pv-bad?capacity=99999999999999999999999999999999TiB", "larger than 1 EiB"),
    ("memory://x?capacity=99999999999999999999999999TiB", "larger than 1 EiB"),
    ("redis://127.0.0.1:0/0", "port must be 1..65535"),
    ("redis://127.0.0.1:1/0?timeout=inf", "timeout must be"),
    ("redis://127.0.0.1:1/0?timeout=1e400", "timeout must be"),
    ("redis://[::1", "bad store URI"),
    ("mooncake://127.0.0.1:1?timeout=inf", "timeout must be"),
    ("local:///" + "a" * 5000, "cannot use local store directory"),
    ("bogus://x", "unknown store URI"),
]


@pytest.mark.parametrize(("uri", "needle"), BAD)
def test_bad_uris_are_one_line(uri: str, needle: str) -> None:
    with pytest.raises(StoreError) as info:
        open_store(uri)
    assert needle in str(info.value) and "\n" not in str(info.value)
    if not uri.startswith("memory:"):  # the CLI's memory store is its own, empty one
        res = CliRunner().invoke(app, ["stats", "--store", uri])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output


def test_namespaces_are_matched_whole() -> None:
    for bad in ("a\n", "", "a/b", "x" * 65):
        with pytest.raises(ValueError):
            check_namespace(bad)
    assert check_namespace("tenant-A.1") == "tenant-A.1"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_parse_size_answers_or_says_why(text: str) -> None:
    try:
        n = parse_size(text)
    except ValueError as e:
        assert "\n" not in str(e).replace(repr(text), "")
    else:
        assert 0 <= n <= 1 << 60


@settings(max_examples=150, deadline=None)
@given(scheme=st.sampled_from(["local", "redis", "rediss", "redis+cluster", "mooncake", "memory", "x"]),
       rest=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40))
def test_any_uri_opens_or_is_a_store_error(
    scheme: str, rest: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Fuzzed URIs: a store or one StoreError, nothing else (remote ones never reachable here)."""
    if scheme == "local":
        rest = f"/{tmp_path_factory.getbasetemp()}/fuzz/{rest.replace('/', '_')}"
    uri = f"{scheme}://{rest}"
    if scheme in ("redis", "rediss", "redis+cluster", "mooncake"):
        uri += ("&" if "?" in uri else "?") + "timeout=0.2"
    try:
        open_store(uri).close()
    except StoreError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("args", [
    ["serve", "/models/m", "--store", "bogus://x", "--dry-run"],
    ["serve", "/models/m", "--store", "local://relative", "--dry-run"],
    ["serve", "/models/m", "--store", "redis://[::1", "--dry-run"],
    ["serve", "/models/m", "--capture-outputs", "first", "--dry-run"],
    ["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9", "--timeout", "-1"],
    ["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9", "--timeout", "inf"],
    ["verify", "--cold", "http://127.0.0.1:9", "--restored", "http://127.0.0.1:9",
     "--producer-repeats", "-5"],
])
def test_bad_command_lines_are_one_line_and_exit_2(args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("body", ['{"consumer": [{"prompt": null}]}', '[{"prompt": 5}]', '{"consumer": []}',
                                  '[{"prompt": [1, "a"]}]', '"just text"', '{"consumer": {"x": 1}}'])
def test_bad_request_files_are_one_line(tmp_path: Path, body: str) -> None:
    f = tmp_path / "requests.json"
    f.write_text(body)
    res = CliRunner().invoke(app, ["verify", "--cold", "http://127.0.0.1:9", "--restored",
                                   "http://127.0.0.1:9", "--requests", str(f)])
    assert res.exit_code == 2 and ("prompt" in res.output or "request" in res.output), res.output
    assert "Traceback" not in res.output


MALFORMED = [
    b"not json", b"[]", b'{"choices": []}', b'{"choices": [null]}', b'{"choices": [{"logprobs": "x"}]}',
    b'{"choices": [{"logprobs": {"token_logprobs": [1], "tokens": [5]}}]}',
    b'{"choices": [{"logprobs": {"token_logprobs": ["abc"], "tokens": ["token_id:1"]}}]}',
    b'{"choices": [{"logprobs": {"token_logprobs": [0.0], "tokens": ["token_id:x"], "top_logprobs": [1]}}]}',
]


@pytest.mark.parametrize("body", MALFORMED)
def test_verify_says_in_one_line_when_a_server_answers_nonsense(body: bytes) -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            self._send(b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b"")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        res = CliRunner().invoke(app, ["verify", "--cold", url, "--restored", url, "--timeout", "5"])
    finally:
        server.shutdown()
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output


def test_verify_gives_up_on_a_hanging_server_within_its_timeout() -> None:
    import socket
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        res = CliRunner().invoke(app, ["verify", "--cold", url, "--restored", url, "--timeout", "2"])
    finally:
        listener.close()
    assert res.exit_code == 2 and time.monotonic() - t0 < 10, res.output


@pytest.mark.parametrize("args", [
    ["audit", "--store", "memory://x", "--secret-file", "/nonexistent/secret"],  # no --namespace
    ["audit", "--store", "memory://x", "--namespace", "t", "--secret-file", "/nonexistent/secret"],
    ["watch", "--store", "memory://x", "--cold", "http://127.0.0.1:9", "--namespace", "t",
     "--secret-env", "PV_TEST_UNSET_SECRET_VAR"],
    ["serve", "/models/m", "--namespace", "t", "--secret-env", "PV_TEST_UNSET_SECRET_VAR", "--dry-run"],
    ["serve", "/models/m", "--namespace", "t", "--secret-file", "/etc/hostname", "--dry-run"],  # too short
])
def test_bad_secrets_are_one_line_and_exit_2(args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert len([line for line in res.output.splitlines() if line.strip()]) == 1, res.output


# -- the whole command line, fuzzed ----------------------------------------------------------------

WEIRD = st.one_of(
    st.sampled_from(["", "-1", "0", "inf", "-inf", "nan", "1e400", "9" * 40, "\x00", "--", "-",
                     "memory://fuzz", "local://", "local://rel", "redis://[::1", "bogus://x",
                     "http://127.0.0.1:9", "http://[::1", "/nonexistent/file", "a" * 5000, "\ud800"]),
    st.text(max_size=20),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
)
OPTIONS = {
    "stats": ["--store"],
    "audit": ["--store", "--namespace", "--secret-file", "--secret-env", "--repair"],
    "serve": ["--store", "--role", "--namespace", "--capture", "--secret-file", "--secret-env"],
    "verify": ["--cold", "--restored", "--producer", "--requests", "--code", "--producer-repeats",
               "--consumer-repeats", "--max-tokens", "--logprobs", "--timeout", "--json"],
    "watch": ["--store", "--cold", "--namespace", "--tolerance", "--interval", "--timeout", "--json",
              "--secret-file", "--secret-env"],
    "explain": ["--store", "--model", "--prompt-file", "--token-ids", "--namespace", "--cache-salt",
                "--secret-file", "--secret-env", "--json"],
}
FLAGS = {"--repair", "--json"}
REQUIRED = {"stats": ["--store"], "audit": ["--store"], "verify": ["--cold", "--restored"],
            "watch": ["--store", "--cold"], "serve": [], "explain": ["--store", "--model"]}


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    cmd = draw(st.sampled_from(sorted(OPTIONS)))
    args = [cmd]
    if cmd == "serve":
        args += ["--dry-run", draw(WEIRD)]  # first, before any "--": never exec vLLM; then the model
    names = draw(st.lists(st.sampled_from(OPTIONS[cmd] + REQUIRED[cmd]), max_size=6))
    for name in [*REQUIRED[cmd], *names]:
        args += [name] if name in FLAGS else [name, draw(WEIRD)]
    if cmd in ("verify", "watch"):
        args += ["--timeout", "2"]  # the last value wins: no server here answers anyway
    return args


@settings(max_examples=400, deadline=None)
@given(command_lines())
def test_fuzzed_command_lines_never_trace_back_or_hang(args: list[str]) -> None:
    """Any command line: exit 0, 1 or 2, our own errors in one line, never a traceback, and
    never longer than the timeout asked (no server is reachable on 127.0.0.1:9)."""
    import time

    t0 = time.monotonic()
    res = CliRunner().invoke(app, args)
    assert time.monotonic() - t0 < 30, args
    shown = (args, res.exit_code, res.output[:1000])
    assert res.exit_code in (0, 1, 2), shown
    assert res.exception is None or isinstance(res.exception, SystemExit), (shown, repr(res.exception))
    assert "Traceback" not in res.output, shown
    for line in res.output.splitlines():
        if line.startswith("error:"):
            assert len(line) < 1000, shown  # a value echoed back is cut, not all 5000 chars
