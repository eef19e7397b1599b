"""Namespace secrets: what turns a namespace from a label into a boundary between tenants.

Without a secret a namespace only prefixes keys: anyone who can reach the store can compute
the keys of a guessed prompt, read its objects and write objects that verify. With a secret,
two keys are derived from it (and from the namespace's name, so that one secret shared by two
namespaces still keeps them apart):

- ``hash_key`` keys the seed of the hash chain, so every block hash, and with it every store
  key, is a keyed hash: without the secret nobody can name the key of a prompt, so nobody
  can ask the store whether it is cached.
- ``mac_key`` is the AES-256 key that encrypts and authenticates (GCM) every object, record
  and sample (see ``codec``, ``samples``): without the secret nobody can read a payload, nor
  write bytes that a reader accepts.

A request with a ``cache_salt`` is a *tenant* of its namespace: its own two keys are derived
from the namespace's root and the salt (``NamespaceKey.tenant``), and everything it stores
(objects, records, tail indexes, samples) is keyed and encrypted under them. One engine serving
N salts so keeps N tenants as far apart as N engines with N secrets: whoever holds the
namespace's secret but not a tenant's salt (another tenant of the engine, an audit) can neither
name, read nor forge that tenant's bytes. A request without a salt uses the namespace's keys.
The namespace's layout object and deny-list stay the namespace's (``NamespaceKey.tag``).

The secret itself is read from a file or an environment variable named in the config, never
given inline, and no repr, log line or error message ever contains it or a key derived from it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from prefixvault.inputs import InputError, read_bounded

#: Shortest secret accepted (bytes, after trailing whitespace is stripped).
MIN_SECRET_BYTES = 16
#: Largest secret file read (a secret is small; anything bigger is the wrong file).
MAX_SECRET_FILE = 64 * 1024
#: Tenant keys a vault keeps derived, the most recently used (``TenantKeys``); a salt past them
#: costs one derivation again (two BLAKE2b calls: microseconds).
TENANT_KEYS = 4096


class SecretError(ValueError):
    """A namespace secret that cannot be used; the message names its source, never its bytes."""


@dataclass(frozen=True)
class NamespaceKey:
    """Keys derived from one namespace's secret. ``repr`` never shows them."""

    namespace: str
    hash_key: bytes = field(repr=False)
    mac_key: bytes = field(repr=False)
    # What tenant keys are derived from (the namespace's only; b"" for a tenant's own key).
    root: bytes = field(default=b"", repr=False)
    # A tenant's keys (``tenant``): what it encrypts says so (``codec.FLAG_TENANT``), so a reader
    # with the namespace's keys leaves it alone instead of taking it for a forgery.
    is_tenant: bool = False

    @classmethod
    def derive(cls, secret: bytes, namespace: str) -> NamespaceKey:
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"a namespace secret needs at least {MIN_SECRET_BYTES} bytes")
        root = hashlib.blake2b(secret, digest_size=64, person=b"pv-ns-root").digest()
        name = namespace.encode()

        def sub(person: bytes) -> bytes:
            return hashlib.blake2b(name, key=root, digest_size=32, person=person).digest()

        return cls(namespace, sub(b"pv-ns-hash"), sub(b"pv-ns-mac"), root)

    def tenant(self, salt: str) -> NamespaceKey:
        """The keys of this namespace's requests that carry ``salt`` (vLLM's ``cache_salt``):
        keyed BLAKE2b under the namespace's root over the namespace and the salt, each
        length-prefixed (no two (namespace, salt) pairs share an input), with personalisations
        of their own (no tenant key equals a namespace's)."""
        if self.is_tenant or not self.root:
            raise ValueError("tenant keys derive from a namespace's key, not from another tenant's")
        name, raw = self.namespace.encode(), salt.encode("utf-8", "surrogatepass")
        msg = len(name).to_bytes(2, "big") + name + len(raw).to_bytes(8, "big") + raw

        def sub(person: bytes) -> bytes:
            return hashlib.blake2b(msg, key=self.root, digest_size=32, person=person).digest()

        return NamespaceKey(self.namespace, sub(b"pv-tn-hash"), sub(b"pv-tn-mac"), is_tenant=True)

    @functools.cached_property
    def tag(self) -> str:
        """16 hex digits naming this key (not the secret): in the names of the few objects a
        namespace keeps under fixed names (its layout, its deny-list), so an engine without the
        secret, or with another one, never writes over the keyed namespace's copies."""
        return hashlib.blake2b(b"pv-ns-tag", key=self.hash_key, digest_size=8).hexdigest()

    def __repr__(self) -> str:
        return f"NamespaceKey({self.namespace!r}, <secret>{', tenant' if self.is_tenant else ''})"


class TenantKeys:
    """The key each request of one namespace uses, by its salt: the namespace's own for a
    request without one (or for every request, in a namespace without a secret: None), else
    its tenant's, derived on first use and kept (the ``TENANT_KEYS`` most recent). Shared by
    a vault's lookup, load and save threads."""

    def __init__(self, key: NamespaceKey | None, capacity: int = TENANT_KEYS) -> None:
        self.namespace_key = key
        self.capacity = capacity
        self._derived: OrderedDict[str, NamespaceKey] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, salt: str | None) -> NamespaceKey | None:
        key = self.namespace_key
        if key is None or salt is None:
            return key
        with self._lock:
            found = self._derived.get(salt)
            if found is not None:
                self._derived.move_to_end(salt)
                return found
        found = key.tenant(salt)
        with self._lock:
            self._derived[salt] = found
            if len(self._derived) > self.capacity:
                self._derived.popitem(last=False)
        return found

    def __repr__(self) -> str:  # (never the salts: a tenant's salt is its secret too)
        return f"TenantKeys({self.namespace_key!r}, {len(self._derived)} derived)"


def read_secret(file: str = "", env: str = "") -> bytes | None:
    """The secret named by a file path or an environment variable name (at most one); None if
    neither is given. Trailing whitespace (a newline left by an editor) is not part of it."""
    if file and env:
        raise SecretError("give the namespace secret as a file or an environment variable, not both")
    if env:
        value = os.environ.get(env)
        if not value:
            raise SecretError(f"namespace secret: environment variable {env[:100]!r} is not set or empty")
        secret = value.encode("utf-8", "surrogateescape").rstrip()
        source = f"environment variable {env[:100]!r}"
    elif file:
        try:  # a regular file only: an engine starting must never wait on a named pipe
            raw = read_bounded(file, "namespace secret file", MAX_SECRET_FILE)
        except InputError as e:
            raise SecretError(str(e)) from None
        secret = raw.rstrip()
        source = f"file {file[:200]!r}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"namespace secret from {source} is shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def namespace_key(namespace: str, file: str = "", env: str = "") -> NamespaceKey | None:
    """The keys of ``namespace`` from the secret its config names; None without a secret."""
    secret = read_secret(file, env)
    return None if secret is None else NamespaceKey.derive(secret, namespace)
