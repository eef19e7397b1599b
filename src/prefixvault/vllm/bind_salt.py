"""Binding ``cache_salt`` to an authenticated identity, inside vLLM's own server.

vLLM takes a request's ``cache_salt`` from its body, that is from the client, and with a
namespace secret a salt selects a tenant's keys: whoever may send a salt reads that tenant's
cache. ``BindCacheSalt`` is an ASGI middleware for vLLM's OpenAI server (``--middleware``,
added by ``prefixvault serve --salt-header``) that takes the identity from a header an
authenticating proxy in front of the server sets (a verified JWT subject, an mTLS subject), and
replaces whatever salt the client sent with one derived from that identity: HMAC-SHA256 under a
key only the server holds, so a tenant's name alone does not give its salt. A POST without the
header is refused (401) and never reaches the engine; so is a body that is not a JSON object
(400), since no salt could be bound into it. Other methods (health checks, metrics) pass as
they are.

The header is only as trustworthy as the path to the server: the server must be reachable only
through the proxy that sets it (and strips any copy a client sent). Configured through the
environment, since vLLM constructs middleware without arguments: ``PREFIXVAULT_SALT_HEADER``
(the header's name) and ``PREFIXVAULT_SALT_KEY_FILE`` (a file holding the HMAC key, at least
16 bytes).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prefixvault.tenancy import read_secret

HEADER_ENV = "PREFIXVAULT_SALT_HEADER"
KEY_FILE_ENV = "PREFIXVAULT_SALT_KEY_FILE"
#: Largest request body read to bind a salt (bytes); a larger one is refused (413).
MAX_BODY = 64 << 20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def salt_for(key: bytes, identity: str) -> str:
    """The salt of ``identity``: HMAC-SHA256 under ``key``, base64url without padding."""
    mac = hmac.new(key, identity.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


class BindCacheSalt:
    """The middleware (see the module)."""

    def __init__(self, app: App, header: str | None = None, key_file: str | None = None) -> None:
        """``header`` and ``key_file`` default to ``PREFIXVAULT_SALT_HEADER`` and
        ``PREFIXVAULT_SALT_KEY_FILE``; either missing is an error at start, never a server
        that passes clients' salts through."""
        self.app = app
        name = header if header is not None else os.environ.get(HEADER_ENV, "")
        path = key_file if key_file is not None else os.environ.get(KEY_FILE_ENV, "")
        if not name.strip():
            raise ValueError(f"prefixvault: binding cache_salt needs the identity header's name "
                             f"({HEADER_ENV})")
        if not path:
            raise ValueError(f"prefixvault: binding cache_salt needs a key file ({KEY_FILE_ENV})")
        key = read_secret(file=path)
        assert key is not None
        self._key = key
        self.header = name.strip().lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        identity = [v for k, v in scope.get("headers", []) if k.lower() == self.header]
        if len(identity) != 1 or not identity[0].strip():
            await _refuse(send, 401, "an authenticated identity is required")
            return
        body, more = await _read_body(receive)
        if more:
            await _refuse(send, 413, f"request body over {MAX_BODY} bytes")
            return
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await _refuse(send, 400, "the request body must be a JSON object")
            return
        request["cache_salt"] = salt_for(self._key, identity[0].strip().decode("latin-1"))
        bound = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(bound)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bound, "more_body": False}
            return await receive()  # (a disconnect, as the server waits for one)

        await self.app({**scope, "headers": headers}, replay, send)


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole body; and whether it went past ``MAX_BODY`` (then not read further)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return b"".join(parts), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return b"", True
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": f"prefixvault: {message}", "type": "invalid_request_error",
                                 "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
