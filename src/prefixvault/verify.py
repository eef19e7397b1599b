"""``prefixvault verify``: prove cold == restored against any OpenAI-compatible servers.

It sends the same greedy requests with logprobs to a cold server and a restored server
(optionally first to a producer that fills the cache), and compares text, token ids and
per-token logprobs exactly. It relies only on the OpenAI completions API, vLLM's
``return_tokens_as_token_ids`` and vLLM's generic ``vllm:external_prefix_cache_hits``
metric, so it works with any KV connector.

A server URL may carry credentials (``http://user:password@host:port``, a proxy in front of the
server): they are sent as an HTTP basic ``Authorization`` header, never in the request line,
and every message shows the URL with its password as ``***``.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from prefixvault.scenarios.models import consumer_prompt, producer_prompt
from prefixvault.stores.base import redact


class VerifyError(Exception):
    """Bad input or an unusable server; one clear line."""


#: Most filler repeats a report prompt may have (~15 tokens each: far beyond any context length).
MAX_REPEATS = 100_000


def check_base_url(url: str, what: str = "server") -> str:
    """A server's base URL, ``http(s)://host[:port][/path]``, without a trailing slash."""
    shown = redact(url)
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError as e:
        raise VerifyError(f"bad {what} URL {shown!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise VerifyError(f"bad {what} URL {shown!r}: use http://host:port or https://host:port")
    return url.rstrip("/")


def _without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its user and password, and the header that carries them instead."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, {}
    host = parts.netloc.rpartition("@")[2]
    user_pass = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    token = base64.b64encode(user_pass.encode("utf-8")).decode("ascii")
    return urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    bare, auth = _without_credentials(url)
    req = urllib.request.Request(bare, data=data, headers={"Content-Type": "application/json", **auth})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise VerifyError(f"{redact(url)} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise VerifyError(f"cannot reach {redact(url)}: {reason}") from None


def served_models(base: str, timeout: float = 30) -> list[str]:
    try:
        data = json.loads(_http(f"{base}/v1/models", timeout=timeout))
        names = [str(m["id"]) for m in data["data"]]
    except (KeyError, TypeError, ValueError):
        names = []
    if not names:
        raise VerifyError(f"{redact(base)}/v1/models did not list a model")
    return names


_HITS = re.compile(r"^vllm:external_prefix_cache_hits(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def external_hits(base: str, timeout: float = 30) -> float | None:
    """Tokens the server reports restored from an external cache so far (None: no metric)."""
    try:
        text = _http(f"{base}/metrics", timeout=timeout).decode()
    except VerifyError:
        return None
    values = [float(m.group(1)) for m in _HITS.finditer(text)]
    return sum(values) if values else None


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[str, float]]


def complete(base: str, request: dict[str, Any], timeout: float) -> Reply:
    body = dict(request, temperature=0, return_tokens_as_token_ids=True)
    body.setdefault("logprobs", 5)
    raw = _http(f"{base}/v1/completions", body, timeout)
    try:
        return _reply(base, json.loads(raw))
    except VerifyError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        shown = redact(base)
        raise VerifyError(f"{shown} returned a malformed completion ({type(e).__name__}: {e})") from None


def _reply(base: str, data: Any) -> Reply:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError):
        raise VerifyError(f"{redact(base)} returned no completion") from None
    lp = choice.get("logprobs")
    if not lp or lp.get("token_logprobs") is None:
        raise VerifyError(f"{redact(base)} returned no logprobs: verify needs a server that supports them")
    ids = []
    for tok in lp["tokens"]:
        if not tok.startswith("token_id:"):
            raise VerifyError(f"{redact(base)} does not return token ids (return_tokens_as_token_ids)")
        ids.append(int(tok.split(":", 1)[1]))
    return Reply(
        choice.get("text", ""),
        ids,
        [float(x) for x in lp["token_logprobs"]],
        [{k: float(v) for k, v in (d or {}).items()} for d in lp.get("top_logprobs") or []],
    )


@dataclass
class Comparison:
    name: str
    cold: Reply
    restored: Reply
    restored_hit_tokens: float | None
    tokens_equal: bool = field(init=False)
    logprobs_equal: bool = field(init=False)
    max_abs_logprob_diff: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens_equal = self.cold.token_ids == self.restored.token_ids
        self.logprobs_equal = (
            self.cold.logprobs == self.restored.logprobs and self.cold.top == self.restored.top
        )
        worst = 0.0
        for a, b in zip(self.cold.logprobs, self.restored.logprobs, strict=False):
            worst = max(worst, abs(a - b))
        for x, y in zip(self.cold.top, self.restored.top, strict=False):
            for k in x.keys() & y.keys():
                worst = max(worst, abs(x[k] - y[k]))
        self.max_abs_logprob_diff = worst

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.logprobs_equal and self.cold.text == self.restored.text


def report_pair(
    code: str, producer_repeats: int, consumer_repeats: int, max_tokens: int, logprobs: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bug report's producer and consumer requests (without a model name)."""
    common = {"max_tokens": max_tokens, "temperature": 0, "seed": 0, "logprobs": logprobs}
    return (
        {**common, "prompt": producer_prompt(code, producer_repeats)},
        {**common, "prompt": consumer_prompt(code, consumer_repeats)},
    )


def load_requests(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``{"producer": [...], "consumer": [...]}`` or a list of consumer requests."""
    from prefixvault.inputs import InputError, load_json

    try:
        data = load_json(path, "--requests")
    except InputError as e:
        raise VerifyError(str(e)) from None
    if isinstance(data, dict) and "consumer" in data:
        prod, cons = data.get("producer", []), data["consumer"]
    elif isinstance(data, dict):
        prod, cons = [], [data]
    else:
        prod, cons = [], data
    prod = [prod] if isinstance(prod, dict) else prod
    cons = [cons] if isinstance(cons, dict) else cons
    if not isinstance(prod, list) or not isinstance(cons, list) or not cons:
        raise VerifyError(f"{path}: expected a request, a list of requests, or "
                          '{"producer": [...], "consumer": [...]} with at least one consumer request')
    for r in [*prod, *cons]:
        if not isinstance(r, dict) or not _is_prompt(r.get("prompt")):
            raise VerifyError(f"{path}: every request needs a 'prompt': a string, token ids, "
                              "or a list of either")
    return prod, cons


def _is_prompt(p: Any) -> bool:
    """What an OpenAI completions request accepts as ``prompt``."""
    if isinstance(p, str):
        return True
    if isinstance(p, list) and p:
        return all(isinstance(x, str) for x in p) or all(isinstance(x, int) and not isinstance(x, bool)
                                                          for x in p) or all(_is_prompt(x) for x in p)
    return False


def verify(
    cold: str,
    restored: str,
    producer: str | None,
    producer_requests: list[dict[str, Any]],
    consumer_requests: list[dict[str, Any]],
    timeout: float = 300,
) -> list[Comparison]:
    cold, restored = cold.rstrip("/"), restored.rstrip("/")
    models = {"cold": served_models(cold, timeout), "restored": served_models(restored, timeout)}
    if producer:
        producer = producer.rstrip("/")
        models["producer"] = served_models(producer, timeout)
    shared = [m for m in models["cold"] if all(m in names for names in models.values())]
    if not shared:
        raise VerifyError(
            "model mismatch: " + ", ".join(f"{k} serves {', '.join(v)}" for k, v in models.items())
        )
    model = shared[0]
    if producer:
        for req in producer_requests:
            complete(producer, {**req, "model": model}, timeout)
    out = []
    for i, req in enumerate(consumer_requests):
        before = external_hits(restored, timeout)
        r = complete(restored, {**req, "model": model}, timeout)
        after = external_hits(restored, timeout)
        c = complete(cold, {**req, "model": model}, timeout)
        hits = after - before if before is not None and after is not None else None
        out.append(Comparison(f"request {i + 1}", c, r, hits))
    return out
