"""``cache_salt`` bound to an authenticated identity inside vLLM's server (``BindCacheSalt``,
``prefixvault serve --salt-header``): the client's salt is replaced, a POST without the
identity never reaches the engine. The middleware alone against a recording ASGI app; then a
real vLLM server started by ``prefixvault serve``, whose prefix cache shows whose salt each
request carried."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.servers import server
from prefixvault.serve import SALT_MIDDLEWARE, engine_flags, serve_command, serve_env
from prefixvault.tenancy import SecretError
from prefixvault.vllm.bind_salt import HEADER_ENV, KEY_FILE_ENV, MAX_BODY, BindCacheSalt, salt_for

KEY = b"k" * 32


class Recorder:
    """The app behind the middleware: what reached it, and a 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        self.headers.append(dict(scope.get("headers", [])))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app: Any, method: str, body: bytes, headers: list[tuple[bytes, bytes]],
         chunks: int = 1) -> tuple[int, bytes]:
    """One request through ``app`` (the body in ``chunks`` messages): its status and body."""
    size = -(-len(body) // chunks) if body else 1
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "salt.key"
    path.write_bytes(KEY + b"\n")
    return path


def test_the_client_s_salt_is_replaced_by_the_identity_s(key_file: Path) -> None:
    inner = Recorder()
    app = BindCacheSalt(inner, header="X-User", key_file=str(key_file))  # type: ignore[arg-type]
    body = json.dumps({"prompt": "hi", "cache_salt": salt_for(KEY, "bob")}).encode()
    assert call(app, "POST", body, [(b"x-user", b"alice"), (b"content-length", b"999")], chunks=3)[0] == 200
    sent = json.loads(inner.bodies[0])
    assert sent == {"prompt": "hi", "cache_salt": salt_for(KEY, "alice")}
    assert inner.headers[0][b"content-length"] == str(len(inner.bodies[0])).encode()
    call(app, "POST", json.dumps({"prompt": "hi"}).encode(), [(b"X-User", b"bob")])
    assert json.loads(inner.bodies[1])["cache_salt"] == salt_for(KEY, "bob") != sent["cache_salt"]
    assert salt_for(KEY, "alice") != salt_for(b"j" * 32, "alice")  # the key, not the name, makes it


@pytest.mark.parametrize(("headers", "body", "status"), [
    ([], b'{"prompt": "hi"}', 401),
    ([(b"x-user", b"  ")], b'{"prompt": "hi"}', 401),
    ([(b"x-user", b"a"), (b"x-user", b"b")], b'{"prompt": "hi"}', 401),  # two identities: none
    ([(b"x-user", b"alice")], b"not json", 400),
    ([(b"x-user", b"alice")], b'["a list"]', 400),
    ([(b"x-user", b"alice")], b"", 400),
])
def test_a_post_the_middleware_cannot_bind_never_reaches_the_engine(
        key_file: Path, headers: list[tuple[bytes, bytes]], body: bytes, status: int) -> None:
    inner = Recorder()
    app = BindCacheSalt(inner, header="x-user", key_file=str(key_file))  # type: ignore[arg-type]
    got, text = call(app, "POST", body, headers)
    assert got == status and inner.bodies == []
    assert json.loads(text)["error"]["code"] == status


def test_a_body_too_large_is_refused_and_other_methods_pass_as_they_are(
        key_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixvault.vllm import bind_salt

    monkeypatch.setattr(bind_salt, "MAX_BODY", 100)
    inner = Recorder()
    app = BindCacheSalt(inner, header="x-user", key_file=str(key_file))  # type: ignore[arg-type]
    assert call(app, "POST", b'{"p": "' + b"x" * 200 + b'"}', [(b"x-user", b"a")], chunks=4)[0] == 413
    assert call(app, "GET", b"", [])[0] == 200 and inner.bodies == [b""]
    assert MAX_BODY == 64 << 20


def test_bad_config_stops_the_server_at_start(tmp_path: Path, key_file: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEADER_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match=HEADER_ENV):
        BindCacheSalt(Recorder())  # type: ignore[arg-type]
    monkeypatch.setenv(HEADER_ENV, "x-user")
    with pytest.raises(ValueError, match=KEY_FILE_ENV):
        BindCacheSalt(Recorder())  # type: ignore[arg-type]
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    monkeypatch.setenv(KEY_FILE_ENV, str(short))
    with pytest.raises(SecretError, match="shorter than 16 bytes"):
        BindCacheSalt(Recorder())  # type: ignore[arg-type]
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    assert BindCacheSalt(Recorder()).header == b"x-user"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="go together"):
        serve_command("m", "local://", salt_header="x-user")
    with pytest.raises(SecretError, match="shorter"):
        serve_command("m", "local://", salt_header="x-user", salt_key_file=str(short))


def test_prefixvault_serve_adds_the_middleware_or_says_what_is_wrong(key_file: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from prefixvault.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["serve", "m", "--salt-header", "X-User", "--salt-key-file", str(key_file),
                             "--dry-run"])
    assert ok.exit_code == 0 and f"--middleware {SALT_MIDDLEWARE}" in ok.output
    for args, message in ((["--salt-header", "X-User"], "go together"),
                          (["--salt-header", "X-User", "--salt-key-file", str(tmp_path / "none")], "none")):
        bad = runner.invoke(app, ["serve", "m", *args, "--dry-run"])
        assert bad.exit_code != 0 and message in bad.output, bad.output
    env = serve_env({}, "kv_consumer", "X-User", str(key_file))
    assert env == {HEADER_ENV: "X-User", KEY_FILE_ENV: str(key_file.resolve())}


def completion(url: str, prompt: str, user: str | None, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Content-Type": "application/json", **({"X-User": user} if user else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


@pytest.mark.slow
def test_a_served_engine_caches_per_identity_whatever_salt_the_client_sends(
        tmp_path: Path, key_file: Path) -> None:
    """``prefixvault serve --salt-header``: the same prompt under one identity is a prefix-cache
    hit, under another a miss, whatever ``cache_salt`` the client puts in the body; a request
    without the identity is refused by the server."""
    profile = "gdn-hybrid"
    model = build_model(profile, tmp_path / "m", seed=0)
    engine = engine_kwargs(profile, model)
    engine.pop("model")
    flags = [*engine_flags(engine), "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    command = serve_command(str(model), f"local://{tmp_path}/store", extra=flags, salt_header="X-User",
                            salt_key_file=str(key_file))
    assert SALT_MIDDLEWARE in command
    env = serve_env({}, "kv_both", "X-User", str(key_file))
    rng = random.Random(0)
    prompt = " ".join(rng.choice(["cache", "state", "block", "river", "stone"]) for _ in range(3 * 256))
    with server(command, tmp_path / "server.log", env=env) as url:
        with pytest.raises(urllib.error.HTTPError) as refused:
            completion(url, prompt, None)
        assert refused.value.code == 401

        def cached(user: str, salt: str | None = None) -> int:
            usage = completion(url, prompt, user, salt)["usage"]
            return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

        assert cached("alice", salt="anything") == 0
        assert cached("alice", salt="something else") > 0  # alice's salt both times
        assert cached("bob", salt=salt_for(KEY, "alice")) == 0  # alice's salt, sent by bob: replaced
        assert cached("bob") > 0
