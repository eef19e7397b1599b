"""Verification samples: what a consumer restored and generated, for a cold recomputation.

Why: the boundary rule proves that a state was reported at its boundary, not that the engine
computed it right (vLLM's own bugs have broken that). A consumer with ``verify_sample=R``
writes, for a fraction R of greedy requests it restored, the prompt, the restored boundary,
the record that published it and the first tokens it generated. ``prefixvault watch``
recomputes them on a cold server and quarantines the record of any that disagree, so that an
operator learns of a wrong state before users do.

A sample is a small JSON object under ``{ns}/{layout}/v/{id}``; it is never a hit and
never loaded into an engine. In a namespace with a secret it holds the tenant's prompt, so it
is sealed: encrypted and authenticated with AES-256-GCM under the namespace's key. Only a
watcher given that namespace and its secret reads it; a forged or altered one is unreadable
(and can therefore never make a watcher quarantine a record). A sample of a request with a
``cache_salt`` is sealed under that tenant's key instead (``tenancy``), with a magic of its own:
a watcher with the namespace's key leaves it alone (it cannot read it), and only one given the
tenant's salt as well reads and judges it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from prefixvault.stores import Store
from prefixvault.tenancy import NamespaceKey

#: Output tokens a sample keeps: enough to see a wrong state, small next to the prompt.
SAMPLE_TOKENS = 8
#: First bytes of a sealed sample (a plain one is JSON and starts with ``{``).
SEALED_MAGIC = b"PVS1"
#: First bytes of a sample sealed under a tenant's key (``NamespaceKey.tenant``).
TENANT_MAGIC = b"PVT1"
_AAD = b"prefixvault sample"


@dataclass(frozen=True)
class VerifySample:
    prompt: list[int]  # token ids the engine computed the request from
    hit: int  # tokens restored from the store
    record: str  # key of the boundary record that published ``hit``
    output: list[int]  # first greedy tokens the restored request generated
    created: float  # unix time
    engine: str = ""  # who restored it (host:pid), for the quarantine log

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> VerifySample:
        data = json.loads(blob)
        return cls(prompt=[int(t) for t in data["prompt"]], hit=int(data["hit"]), record=str(data["record"]),
                   output=[int(t) for t in data["output"]], created=float(data["created"]),
                   engine=str(data.get("engine", "")))


def sample_key(record_key: str) -> str:
    """A fresh sample key beside the record's own namespace and layout."""
    prefix = record_key.rsplit("/r/", 1)[0]
    return f"{prefix}/v/{time.time_ns():x}-{os.getpid():x}-{os.urandom(4).hex()}"


def _magic(key: NamespaceKey) -> bytes:
    return TENANT_MAGIC if key.is_tenant else SEALED_MAGIC


def seal(blob: bytes, key: NamespaceKey) -> bytes:
    nonce = os.urandom(12)
    return _magic(key) + nonce + AESGCM(key.mac_key).encrypt(nonce, blob, _AAD)


def unseal(blob: bytes, key: NamespaceKey) -> bytes:
    magic = _magic(key)
    if not blob.startswith(magic):
        raise ValueError("sample is not sealed with a key of this kind")
    body = blob[len(magic) :]
    try:
        return AESGCM(key.mac_key).decrypt(body[:12], body[12:], _AAD)
    except InvalidTag:
        raise ValueError("sample does not verify with this namespace's key") from None


def write_sample(store: Store, sample: VerifySample, key: NamespaceKey | None = None) -> bool:
    blob = sample.encode()
    return store.put_many([(sample_key(sample.record), [seal(blob, key) if key else blob])])[0]


def pending_samples(
    store: Store, namespace: str | None = None, key: NamespaceKey | None = None
) -> Iterator[tuple[str, VerifySample | None]]:
    """Every sample in the store (of one namespace if given); None for one that does not
    decode. With ``key`` (the namespace's) samples must be sealed with it; without, sealed
    samples are left alone: they belong to a watcher that has the secret. A tenant's samples
    are left alone but by a watcher given that tenant's key, which reads only those that
    unseal with it (the others may be another tenant's: it cannot tell a forgery from them)."""
    if key is not None and key.namespace != namespace:
        raise ValueError("a namespace key needs its namespace")
    keys = [k for k, _ in store.scan(f"{namespace}/" if namespace else "") if k.split("/")[2:3] == ["v"]]
    for name, blob in zip(keys, store.get_many(keys), strict=True):
        if blob is None:
            continue  # taken by another watcher
        if blob.startswith(TENANT_MAGIC) != (key is not None and key.is_tenant) or \
                (key is None and blob.startswith(SEALED_MAGIC)):
            continue  # another tenant's, or the namespace's when a tenant's key was given
        try:
            opened = unseal(blob, key) if key else blob
        except ValueError:
            if key is not None and key.is_tenant:
                continue
            yield name, None
            continue
        try:
            yield name, VerifySample.decode(opened)
        except (ValueError, KeyError, TypeError):
            yield name, None
