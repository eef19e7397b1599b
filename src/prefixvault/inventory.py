"""Read-only walks over a store: what it holds, and whether every record can really resume."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prefixvault.codec import IntegrityError, decode
from prefixvault.keys import KeySpace
from prefixvault.layout import CacheLayout
from prefixvault.records import BoundaryRecord
from prefixvault.stores.base import Store
from prefixvault.vault import Vault


@dataclass
class StoreSummary:
    objects: int = 0
    bytes: int = 0
    records: int = 0
    layouts: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)  # group kind -> objects
    bytes_by_kind: Counter[str] = field(default_factory=Counter)


@dataclass
class AuditFinding:
    record_key: str
    problem: str  # e.g. "missing object", "payload checksum", "unreadable record"
    object_key: str = ""


@dataclass
class AuditReport:
    records: int = 0
    objects_checked: int = 0
    findings: list[AuditFinding] = field(default_factory=list)
    repaired: int = 0

    @property
    def broken_records(self) -> set[str]:
        return {f.record_key for f in self.findings}


def _split(key: str) -> tuple[str, str, list[str]] | None:
    parts = key.split("/")
    if len(parts) < 3:
        return None
    return parts[0], parts[1], parts[2:]


def load_layouts(store: Store) -> dict[tuple[str, str], CacheLayout | None]:
    """Every (namespace, fingerprint) in the store, with its layout if one was saved."""
    found: dict[tuple[str, str], CacheLayout | None] = {}
    layout_keys: list[tuple[tuple[str, str], str]] = []
    for key, _ in store.scan():
        sp = _split(key)
        if sp is None:
            continue
        ns, fp, rest = sp
        found.setdefault((ns, fp), None)
        if rest == ["layout"]:
            layout_keys.append(((ns, fp), key))
    blobs = store.get_many([k for _, k in layout_keys])
    for (scope, _), blob in zip(layout_keys, blobs, strict=True):
        if blob is None:
            continue
        try:
            _, payload = decode(blob)
            found[scope] = CacheLayout.from_json(json.loads(bytes(payload)))
        except (IntegrityError, ValueError, KeyError, TypeError):
            continue
    return found


def summarize(store: Store) -> StoreSummary:
    layouts = load_layouts(store)
    s = StoreSummary(layouts=sum(1 for v in layouts.values() if v is not None))
    for key, size in store.scan():
        s.objects += 1
        s.bytes += size
        sp = _split(key)
        if sp is None:
            s.by_kind["unknown"] += 1
            continue
        ns, fp, rest = sp
        if rest[0] == "r":
            s.records += 1
            kind = "record"
        elif rest[0] in ("b", "s") and len(rest) == 4:
            layout = layouts.get((ns, fp))
            g = int(rest[1]) if rest[1].isdigit() else -1
            if layout is not None and 0 <= g < len(layout.groups):
                kind = layout.groups[g].kind.value
            else:
                kind = "state" if rest[0] == "s" else "attention"
        elif rest == ["layout"]:
            kind = "layout"
        elif rest[0] == "v" and len(rest) == 2:
            kind = "sample"
        else:
            kind = "unknown"
        s.by_kind[kind] += 1
        s.bytes_by_kind[kind] += size
    return s


def _records(store: Store) -> Iterator[tuple[str, str, str]]:
    for key, _ in store.scan():
        sp = _split(key)
        if sp is not None and sp[2][0] == "r" and len(sp[2]) == 2:
            yield key, sp[0], sp[1]


def audit(store: Store, repair: bool = False, batch: int = 64) -> AuditReport:
    """Verify every record's objects (presence, header, checksum); optionally remove the broken."""
    report = AuditReport()
    layouts = load_layouts(store)
    bad_objects: set[str] = set()
    for rkey, ns, fp in list(_records(store)):
        report.records += 1
        layout = layouts.get((ns, fp))
        if layout is None:
            report.findings.append(AuditFinding(rkey, "layout unknown"))
            continue
        blob = store.get_many([rkey])[0]
        if blob is None:
            continue  # removed since the scan
        try:
            record = BoundaryRecord.decode(blob, layout.fingerprint())
        except IntegrityError as e:
            report.findings.append(AuditFinding(rkey, f"unreadable record ({e})"))
            continue
        vault = Vault(store, layout, ns)
        if KeySpace(ns, layout.fingerprint()).record(record.boundary_hash) != rkey:
            report.findings.append(AuditFinding(rkey, "record stored under another key"))
            continue
        refs = vault.needed(record.hashes, record.tokens)
        for i in range(0, len(refs), batch):
            chunk = refs[i : i + batch]
            for ref, blob_ in zip(chunk, store.get_many([r.key for r in chunk]), strict=True):
                report.objects_checked += 1
                if blob_ is None:
                    report.findings.append(AuditFinding(rkey, "missing object", ref.key))
                    continue
                try:
                    decode(blob_, vault.expected_header(ref))
                except IntegrityError as e:
                    report.findings.append(AuditFinding(rkey, e.reason, ref.key))
                    bad_objects.add(ref.key)
    if repair:
        broken = sorted(report.broken_records)
        report.repaired = store.delete_many(broken) if broken else 0
        if bad_objects:
            store.delete_many(sorted(bad_objects))
    return report
