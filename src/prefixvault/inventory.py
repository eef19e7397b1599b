"""Read-only walks over a store: what it holds, and whether every record can really resume.

A namespace with a secret seals its objects: its layout, records and objects verify only with
its key. Given the key, an audit checks it like any other; without, its records are reported
unverifiable (never removed) and its layout is not trusted for anything. The records and
objects of a request with a ``cache_salt`` (a tenant, ``tenancy``) verify only with that
tenant's key, which no audit holds: given the namespace's key, an audit reports them
unverifiable and keeps them (their tenant's own loads still verify every object).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prefixvault.boundary import needed_blocks
from prefixvault.codec import IntegrityError, ObjectKind, decode, proved_wrong
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.read_twice import read_opened
from prefixvault.records import BoundaryRecord
from prefixvault.stores.base import Store, namespace_of
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import ObjectRef, Vault


@dataclass
class StoreSummary:
    objects: int = 0
    bytes: int = 0
    records: int = 0
    layouts: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)  # group kind -> objects
    bytes_by_kind: Counter[str] = field(default_factory=Counter)
    by_namespace: Counter[str] = field(default_factory=Counter)  # namespace (``namespace_of``) -> objects
    bytes_by_namespace: Counter[str] = field(default_factory=Counter)


@dataclass
class AuditFinding:
    record_key: str
    problem: str  # e.g. "missing object", "payload checksum", "unreadable record"
    object_key: str = ""


@dataclass
class AuditReport:
    """``findings`` prove records broken; ``unverifiable`` records could not be checked (no
    layout, or a parent record that is gone) and are never removed."""

    records: int = 0
    objects_checked: int = 0
    findings: list[AuditFinding] = field(default_factory=list)
    unverifiable: list[AuditFinding] = field(default_factory=list)
    repaired: int = 0
    #: KV blocks and states no record reaches, checked on their own (``audit``'s last pass):
    #: how many, and the keys of those that are bad (removed by a repair).
    unreached: int = 0
    unreached_bad: list[str] = field(default_factory=list)

    @property
    def broken_records(self) -> set[str]:
        return {f.record_key for f in self.findings}


def _split(key: str) -> tuple[str, str, list[str]] | None:
    parts = key.split("/")
    if len(parts) < 3:
        return None
    return parts[0], parts[1], parts[2:]


#: Why a scope's layout is None though a layout object is stored: it is sealed, no key given.
SEALED = "sealed"


def load_layouts(
    store: Store, keys: Mapping[str, NamespaceKey] | None = None, sealed: set[tuple[str, str]] | None = None,
    scanned: Iterable[str] | None = None,
) -> dict[tuple[str, str], CacheLayout | None]:
    """Every (namespace, fingerprint) in the store, with its layout if one was saved and
    verifies (with the namespace's key where ``keys`` has one). Scopes whose layout is sealed
    while no key was given are added to ``sealed``."""
    keys = keys or {}
    found: dict[tuple[str, str], CacheLayout | None] = {}
    layout_keys: list[tuple[tuple[str, str], str]] = []
    for key in _keys(store, scanned):
        sp = _split(key)
        if sp is None:
            continue
        ns, fp, rest = sp
        found.setdefault((ns, fp), None)
        if _is_named(rest, "layout"):
            layout_keys.append(((ns, fp), key))
    blobs = store.get_many([k for _, k in layout_keys])
    for (scope, _), blob in zip(layout_keys, blobs, strict=True):
        if blob is None or found[scope] is not None:
            continue
        try:
            _, payload = decode(blob, key=keys.get(scope[0]))
            found[scope] = CacheLayout.from_json(json.loads(bytes(payload)))
        except IntegrityError as e:
            if e.reason == "sealed" and sealed is not None:
                sealed.add(scope)
        except (ValueError, KeyError, TypeError):
            continue
    return found


def summarize(store: Store) -> StoreSummary:
    layouts = load_layouts(store)
    s = StoreSummary(layouts=sum(1 for v in layouts.values() if v is not None))
    for key, size in store.scan():
        s.objects += 1
        s.bytes += size
        s.by_namespace[namespace_of(key)] += 1
        s.bytes_by_namespace[namespace_of(key)] += size
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
        elif _is_named(rest, "layout"):
            kind = "layout"
        elif _is_named(rest, "deny"):
            kind = "deny-list"
        elif rest[0] == "v" and len(rest) == 2:
            kind = "sample"
        else:
            kind = "unknown"
        s.by_kind[kind] += 1
        s.bytes_by_kind[kind] += size
    return s


def _is_named(rest: list[str], name: str) -> bool:
    """``rest`` is the key of a namespace's ``name`` object: plain, or keyed (``name.{tag}``)."""
    return len(rest) == 1 and (rest[0] == name or rest[0].startswith(name + "."))


def _keys(store: Store, scanned: Iterable[str] | None) -> Iterable[str]:
    """The store's keys: ``scanned`` where a caller already listed them (one scan per walk)."""
    return scanned if scanned is not None else (k for k, _ in store.scan())


def _records(keys: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    for key in keys:
        sp = _split(key)
        if sp is not None and sp[2][0] == "r" and len(sp[2]) == 2:
            yield key, sp[0], sp[1]


class _ScopeAudit:
    """Audit of the records of one (namespace, layout): each record is checked for the
    objects of its own segment, and inherits what its parent's check proved about the KV
    blocks before it, so a chain of records is walked once, not once per record."""

    def __init__(self, store: Store, layout: CacheLayout, namespace: str, fingerprint: str,
                 report: AuditReport, batch: int, key: NamespaceKey | None = None) -> None:
        self.store = store
        self.vault = Vault(store, layout, namespace, key)
        self.own = self.vault.fingerprint.hex() == fingerprint  # (its records' keys name its format)
        self.report = report
        self.batch = batch
        self.checked: dict[str, str | None] = {}  # object key -> problem, None when it verifies
        self.bad_objects: set[str] = set()

    def run(self, keys: list[str]) -> None:
        records: dict[bytes, tuple[str, BoundaryRecord]] = {}
        for i in range(0, len(keys), self.batch):
            part = keys[i : i + self.batch]
            for rkey, blob in zip(part, self.store.get_many(part), strict=True):
                if blob is None:
                    continue  # removed since the scan
                self.report.records += 1
                try:
                    record = BoundaryRecord.decode(blob, self.vault.fingerprint, self.vault.key)
                except IntegrityError as e:
                    # (a tenant's record, ``tenant``: its salt's, not the namespace's key's to judge)
                    if proved_wrong(e.reason, own_fingerprint=self.own and e.reason != "tenant"):
                        self.report.findings.append(AuditFinding(rkey, f"unreadable record ({e})"))
                    else:  # another format, or sealed with a secret not given: not ours to judge
                        self.report.unverifiable.append(AuditFinding(rkey, f"cannot be read here ({e})"))
                    continue
                if self.vault.keys.record(record.boundary_hash) != rkey:
                    self.report.findings.append(AuditFinding(rkey, "record stored under another key"))
                elif record.block_size != self.vault.layout.block_size:
                    self.report.findings.append(AuditFinding(rkey, "record of another block size"))
                else:
                    records[record.boundary_hash] = (rkey, record)
        # blocks_ok[h]: None = every KV block the record's boundary needs verifies, else the
        # finding that proves one does not, or "?" when it cannot be known.
        blocks_ok: dict[bytes, AuditFinding | str | None] = {}
        for h, (rkey, record) in sorted(records.items(), key=lambda kv: kv[1][1].tokens):
            blocks_ok[h] = self._check(rkey, record, records, blocks_ok)

    def _chain(self, record: BoundaryRecord, records: dict[bytes, tuple[str, BoundaryRecord]],
               first_needed: int) -> dict[int, bytes] | None:
        """Block hashes by index from ``first_needed`` to the record's boundary, following
        parents as far back as needed; None if a parent on the way is gone."""
        out: dict[int, bytes] = {}
        cur: BoundaryRecord | None = record
        while cur is not None:
            out.update(enumerate(cur.hashes, cur.first_block))
            if cur.first_block <= first_needed or not cur.parent:
                return out
            found = records.get(cur.parent_hash)
            cur = found[1] if found else None
        return None

    def _check(self, rkey: str, record: BoundaryRecord, records: dict[bytes, tuple[str, BoundaryRecord]],
               blocks_ok: dict[bytes, AuditFinding | str | None]) -> AuditFinding | str | None:
        """Check one record; return what it proves about its full-attention blocks (for the
        records that extend it): None when they verify, a finding, or "?" when unknown."""
        layout = self.vault.layout
        bs = layout.block_size
        n = -(-record.tokens // bs)
        tail = record.tokens if record.tail else None  # its last block is partly filled, its own
        full: list[ObjectRef] = []  # full-attention blocks of the record's own segment
        other: list[ObjectRef] = []  # sliding-window blocks and states
        unknown = False
        ranks = range(layout.world_size)
        for gi, group in enumerate(layout.groups):
            if group.is_state:
                other.extend(self.vault.state_ref(gi, r, record.boundary_hash, n - 1, record.tokens)
                             for r in ranks)
                continue
            need = needed_blocks(group, record.tokens, bs)
            if group.kind is GroupKind.FULL_ATTENTION:
                seg = enumerate(record.hashes, record.first_block)
                full.extend(self.vault.block_ref(gi, r, h, i, tail if i == n - 1 else None)
                            for i, h in seg for r in ranks)
                continue
            chain = self._chain(record, records, need.start)
            if chain is None:
                unknown = True
                continue
            other.extend(self.vault.block_ref(gi, r, chain[i], i, tail if i == n - 1 else None)
                         for i in need for r in ranks)
        has_full = bool(full)
        inherited = blocks_ok.get(record.parent_hash, "?") if record.parent and has_full else None
        own_full = self._verify(rkey, full)
        if own_full is not None:
            self.report.findings.append(own_full)
            return own_full
        problem = self._verify(rkey, other)
        if problem is None and isinstance(inherited, AuditFinding):
            problem = AuditFinding(rkey, f"extends a broken record ({inherited.problem})",
                                   inherited.object_key)
        if problem is not None:
            self.report.findings.append(problem)
        elif unknown or inherited == "?":
            gone = AuditFinding(rkey, "a parent record is gone: earlier blocks unknown")
            self.report.unverifiable.append(gone)
        return inherited

    def _verify(self, rkey: str, refs: list[ObjectRef]) -> AuditFinding | None:
        todo = [r for r in refs if r.key not in self.checked]
        for i in range(0, len(todo), self.batch):
            part = todo[i : i + self.batch]
            self.report.objects_checked += len(part)
            for ref, got in zip(part, self._opened(part), strict=True):
                why = None if got is not None else "missing object"
                if isinstance(got, IntegrityError):
                    why = got.reason
                self.checked[ref.key] = why
                if why is not None and proved_wrong(why, own_fingerprint=True):  # (named by this vault)
                    self.bad_objects.add(ref.key)
        for ref in refs:
            problem = self.checked.get(ref.key)
            if problem is not None:
                return AuditFinding(rkey, problem, ref.key)
        return None

    def _opened(self, refs: list[ObjectRef]) -> list[object]:
        """Each object of ``refs`` decoded, None where there is none, or why it does not verify
        when read twice (``read_twice``: a read that raced an overwrite may be torn)."""
        headers = {r.key: self.vault.expected_header(r) for r in refs}
        return read_opened(self.store, [r.key for r in refs],
                           lambda k, blob: decode(blob, headers[k], self.vault.key))


#: An object no record reaches: its key, namespace, layout fingerprint and the rest of its key.
_Unreached = tuple[str, str, str, list[str]]


def _check_unreached(store: Store, layouts: Mapping[tuple[str, str], CacheLayout | None],
                     sealed: set[tuple[str, str]], keys: Mapping[str, NamespaceKey],
                     checked: set[str], report: AuditReport, batch: int, scanned: Iterable[str]) -> None:
    """Check every KV block and state no record's check read: a corrupt one would otherwise
    stay, and a later producer that finds it present would publish a record over it. Each is
    checked against all its key tells (kind, layout, hash, group, rank; with the layout its
    dtype, shape and length; a boundary that is a whole number of blocks) and its checksum or
    MAC. Objects of a sealed namespace whose key was not given are left alone."""
    todo: list[_Unreached] = []
    for key in scanned:
        sp = _split(key)
        if sp is None or key in checked:
            continue
        ns, fp, rest = sp
        if rest[0] in ("b", "s") and len(rest) == 4 and (ns, fp) not in sealed:
            todo.append((key, ns, fp, rest))
    vaults: dict[tuple[str, str], Vault] = {}

    def unsound(items: list[_Unreached], count: bool) -> list[_Unreached]:
        """Those of ``items`` that do not verify alone (``count``: counted as checked)."""
        out = []
        for (key, ns, fp, rest), blob in zip(items, store.get_many([t[0] for t in items]), strict=True):
            if blob is None:
                continue  # gone since the scan
            report.unreached += int(count)
            layout = layouts.get((ns, fp))
            vault = None
            if layout is not None:
                vault = vaults.get((ns, fp))
                if vault is None:
                    vault = vaults[(ns, fp)] = Vault(store, layout, ns, keys.get(ns))
            if _sound_alone(blob, fp, rest, key, vault, keys.get(ns)) is False:
                out.append((key, ns, fp, rest))
        return out

    for i in range(0, len(todo), batch):
        bad = unsound(todo[i : i + batch], True)
        if bad:  # wrong only if wrong when read once more (a read racing an overwrite may be torn)
            report.unreached_bad.extend(key for key, _, _, _ in unsound(bad, False))


def _sound_alone(blob: bytes, fp: str, rest: list[str], key: str, vault: Vault | None,
                 ns_key: NamespaceKey | None) -> bool | None:
    """Whether an object no record names verifies by what its key and layout say of it; None
    when it cannot be known (sealed with a secret that was not given: never removed)."""
    kind = ObjectKind.BLOCK if rest[0] == "b" else ObjectKind.STATE
    try:
        header, _ = decode(blob, key=ns_key)
    except IntegrityError as e:
        own = vault is not None and vault.fingerprint.hex() == fp and e.reason != "tenant"
        return False if proved_wrong(e.reason, own_fingerprint=own) else None
    if (header.kind is not kind or header.fingerprint.hex() != fp or header.key_hash.hex() != rest[3]
            or str(header.group) != rest[1] or str(header.rank) != rest[2]):
        return False
    if vault is None:
        return True  # no layout to check more against: its checksum and key agree
    layout = vault.layout
    if not (0 <= header.group < len(layout.groups) and 0 <= header.rank < layout.world_size
            and layout.groups[header.group].is_state == (kind is ObjectKind.STATE)
            and header.tokens > 0 and header.tokens % layout.block_size == 0):
        return False
    i = header.tokens // layout.block_size - 1
    ref = ObjectRef(key, kind, header.group, header.rank, header.key_hash, header.tokens, i)
    return header.identity() == vault.expected_header(ref).identity()


def audit(store: Store, repair: bool = False, batch: int = 64,
          keys: Mapping[str, NamespaceKey] | None = None) -> AuditReport:
    """Verify every record's objects (presence, header, checksum or MAC); optionally remove
    what is proven broken. A record that cannot be checked (its layout or a parent record is
    gone, or its namespace is sealed and ``keys`` has no key for it) is reported as
    unverifiable and always kept: lookups still check its objects before a hit."""
    keys = keys or {}
    report = AuditReport()
    sealed: set[tuple[str, str]] = set()
    scanned = [k for k, _ in store.scan()]  # one listing of the store for every pass below
    layouts = load_layouts(store, keys, sealed, scanned)
    scopes: dict[tuple[str, str], list[str]] = {}
    for rkey, ns, fp in _records(scanned):
        scopes.setdefault((ns, fp), []).append(rkey)
    bad_objects: set[str] = set()
    checked: set[str] = set()
    for (ns, fp), rkeys in sorted(scopes.items()):
        layout = layouts.get((ns, fp))
        if layout is None:
            why = ("namespace has a secret: give it to check these records" if (ns, fp) in sealed
                   else "layout unknown")
            report.records += len(rkeys)
            report.unverifiable.extend(AuditFinding(k, why) for k in rkeys)
            continue
        scope = _ScopeAudit(store, layout, ns, fp, report, batch, keys.get(ns))
        scope.run(sorted(rkeys))
        bad_objects |= scope.bad_objects
        checked.update(scope.checked)
    _check_unreached(store, layouts, sealed, keys, checked, report, batch, scanned)
    bad_objects.update(report.unreached_bad)
    if repair:
        broken = sorted(report.broken_records)
        report.repaired = store.delete_many(broken) if broken else 0
        if bad_objects:
            store.delete_many(sorted(bad_objects))
    return report
