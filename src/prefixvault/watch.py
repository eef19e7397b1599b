"""``prefixvault watch``: recompute verification samples cold and quarantine what disagrees.

Each sample (see samples.py) is sent to a cold server — one without the cache — as a greedy
completion of the same prompt token ids. Tokens are compared position by position up to the
first difference. A difference where the cold server ranks the restored token within
``tolerance`` of its own top choice is a near tie (engines that are not batch-invariant move
logprobs in the last digits) and passes; any other difference quarantines the boundary that
published the restored hit (``Vault.quarantine``): its record and the states at its boundary
are listed in the namespace's deny-list and removed (KV blocks, shared by every prefix through
them, stay), counted and logged with the sample's
provenance. The sample is removed either way.

What a sample may make a watcher touch (invariant 7: nobody can aim a tool of ours at a
namespace they have no secret for):

- a sample names a record of its *own* namespace and layout (the ``{ns}/{layout}/`` of its
  own key) and nothing else; a sample that names any other key is removed and counted
  (``refused``), and nothing it names is touched;
- in a namespace with a secret, only a sample sealed with it is acted on, and only by a
  watcher given that secret: a plain sample there (its layout or the record it names is
  sealed) is a forgery, removed and counted (``refused``); sealed samples are left alone by
  a watcher without the key (they belong to one that has it);
- a quarantine touches the record and objects of that one boundary, in that namespace and
  layout, and its deny-list.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixvault.codec import IntegrityError, decode, is_sealed
from prefixvault.layout import CacheLayout
from prefixvault.samples import VerifySample, pending_samples
from prefixvault.stores import Store
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault
from prefixvault.verify import complete, served_models

log = logging.getLogger("prefixvault.watch")


@dataclass(frozen=True)
class Verdict:
    sample: VerifySample
    ok: bool
    position: int | None = None  # first generated token that differs
    cold_token: int | None = None
    restored_token: int | None = None
    margin: float | None = None  # cold top logprob minus cold logprob of the restored token


@dataclass
class WatchReport:
    checked: int = 0
    agreed: int = 0
    quarantined: list[Verdict] = field(default_factory=list)
    unreadable: int = 0
    refused: int = 0  # samples that named what they may not (removed, nothing acted on)
    removed: list[str] = field(default_factory=list)  # record and object keys quarantines removed


def judge(cold: str, model: str, sample: VerifySample, tolerance: float, timeout: float) -> Verdict:
    reply = complete(cold, {"model": model, "prompt": sample.prompt, "max_tokens": len(sample.output),
                            "logprobs": 5}, timeout)
    for i, (c, r) in enumerate(zip(reply.token_ids, sample.output, strict=False)):
        if c == r:
            continue
        top = reply.top[i] if i < len(reply.top) else {}
        restored_lp = top.get(f"token_id:{r}")
        margin = None if restored_lp is None else reply.logprobs[i] - restored_lp
        near_tie = margin is not None and margin <= tolerance
        return Verdict(sample, near_tie, i, c, r, margin)
    return Verdict(sample, True)


#: The one key a sample of scope ``{ns}/{layout}`` may name: a record of that scope.
_RECORD = re.compile(r"r/[0-9a-f]{32}")


def _scope(name: str) -> str:
    """``{ns}/{layout}/`` of a sample's own key."""
    ns, fp, *_ = name.split("/")
    return f"{ns}/{fp}/"


class _Scopes:
    """Vaults of the (namespace, layout) scopes samples name, built from each scope's stored
    layout (verified with the namespace's key where the watcher has it), once per pass."""

    def __init__(self, store: Store, key: NamespaceKey | None) -> None:
        self.store = store
        self.key = key
        self.vaults: dict[str, Vault | None] = {}

    def key_for(self, scope: str) -> NamespaceKey | None:
        return self.key if self.key is not None and scope.split("/")[0] == self.key.namespace else None

    def keyed(self, scope: str, record: str) -> bool:
        """Whether the scope belongs to a namespace with a secret: its plain-named layout or the
        record (what a plain sample could make a watcher remove) is sealed. (A keyed namespace
        names its layout ``layout.{tag}``; its records are sealed all the same.)"""
        return any(b is not None and is_sealed(b) for b in self.store.get_many([scope + "layout", record]))

    def vault(self, scope: str) -> Vault | None:
        if scope not in self.vaults:
            ns, fp = scope.split("/")[:2]
            key = self.key_for(scope)
            blob = self.store.get_many([scope + "layout" + (f".{key.tag}" if key is not None else "")])[0]
            vault: Vault | None = None
            if blob is not None:
                try:
                    _, payload = decode(blob, key=self.key_for(scope))
                    vault = Vault(self.store, CacheLayout.from_json(json.loads(bytes(payload))), ns,
                                  self.key_for(scope))
                except (IntegrityError, ValueError, KeyError, TypeError, RecursionError):
                    vault = None
                if vault is not None and vault.fingerprint.hex() != fp:
                    vault = None
            self.vaults[scope] = vault
        return self.vaults[scope]


def _refusal(name: str, sample: VerifySample, scopes: _Scopes) -> str | None:
    """Why a watcher may not act on ``sample`` (stored at ``name``); None if it may."""
    scope = _scope(name)
    if not sample.record.startswith(scope) or not _RECORD.fullmatch(sample.record[len(scope):]):
        return f"names {sample.record[:200]!r}, not a record of its own namespace and layout"
    if scopes.key_for(scope) is None and scopes.keyed(scope, sample.record):
        return "a plain sample in a namespace with a secret (a forgery)"
    return None


def watch_once(store: Store, cold: str, namespace: str | None = None, tolerance: float = 0.05,
               timeout: float = 300, model: str | None = None,
               on_verdict: Callable[[Verdict], None] | None = None,
               key: NamespaceKey | None = None, salt: str | None = None) -> WatchReport:
    """Check every pending sample once (with ``key``: of its namespace, sealed with it; with
    ``salt`` too: of that tenant, sealed with its key, ``tenancy``)."""
    if salt is not None and key is None:
        raise ValueError("a cache salt selects a tenant of a namespace with a secret: give its key")
    model = model or served_models(cold)[0]
    report = WatchReport()
    scopes = _Scopes(store, key)
    sealer = key.tenant(salt) if key is not None and salt is not None else key
    for name, sample in pending_samples(store, namespace, sealer):
        if sample is None:
            report.unreadable += 1
            store.delete_many([name])
            continue
        why = _refusal(name, sample, scopes)
        if why is not None:
            report.refused += 1
            store.delete_many([name])
            log.warning("removed sample %s without acting on it: %s", name, why)
            continue
        verdict = judge(cold, model, sample, tolerance, timeout)
        report.checked += 1
        if verdict.ok:
            report.agreed += 1
        else:
            vault = scopes.vault(_scope(name))
            if vault is not None:
                removed = vault.quarantine(sample.record, salt)
            else:  # no layout that verifies: its objects cannot be named, the record still goes
                store.delete_many([sample.record])
                removed = [sample.record]
            report.removed.extend(removed)
            report.quarantined.append(verdict)
            log.warning("quarantined %s (%d keys removed, their bytes refused from now on): restored %d "
                        "of %d prompt tokens on %s at %.0f; generated token %s is %s, cold gives %s "
                        "(margin %s)", sample.record, len(removed), sample.hit, len(sample.prompt),
                        sample.engine or "?", sample.created, verdict.position, verdict.restored_token,
                        verdict.cold_token, "n/a" if verdict.margin is None else f"{verdict.margin:.3g}")
        store.delete_many([name])
        if on_verdict is not None:
            on_verdict(verdict)
    return report
