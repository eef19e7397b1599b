"""``prefixvault explain``: why a prompt restores what it restores, boundary by boundary.

It walks the prompt's hash chain against a store without an engine: for every layout stored in
the namespace it finds the boundary a lookup would restore (the same rule as ``Vault.lookup``,
answered by the same ``Coverage``),
the longest boundary with a record, and for every shorter boundary why it does not restore:
published but objects gone, every object stored but no record, KV stored but no exact state
kept there, or nothing stored. It then looks for the same prompt in other namespaces and
without the cache salt, the two ways a prompt is cached "somewhere else". It only reads: no
touch, no repair, so asking does not change what the store will evict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixvault.boundary import choose_hit, max_resume_tokens
from prefixvault.costs import Estimates, judge, restore_bytes
from prefixvault.coverage import Coverage
from prefixvault.inventory import load_layouts
from prefixvault.keys import ExtraKeys
from prefixvault.layout import CacheLayout, GroupKind
from prefixvault.stores.base import Store
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import Vault

RESTORABLE = "restorable"
GONE = "published, but objects it needs are gone"
UNPUBLISHED = "every object is stored but no record (a rank's save failed, or the record was evicted)"
NO_STATE = "KV blocks are stored but no exact state was kept at this boundary"
NOT_STORED = "not stored"


@dataclass
class Boundary:
    tokens: int
    status: str
    missing: list[str] = field(default_factory=list)  # keys of the objects that are gone (first few)


@dataclass
class LayoutReport:
    namespace: str
    fingerprint: str
    model: str
    block_size: int
    world_size: int
    longest: int  # the longest block-aligned prefix that leaves a prompt token to compute
    restorable: int  # what a lookup restores
    longest_record: int  # the longest boundary with a record, restorable or not
    boundaries: list[Boundary]  # every block boundary up to ``longest``, longest first
    differs: list[str] = field(default_factory=list)  # layout fields unlike the best layout's
    weights_match: bool | None = None  # against --model's files, where they could be read
    # With an engine's cost estimates (``--engine``): what ``restore_when: faster`` would do
    # with the restorable boundary (``costs.Judgment``), and the seconds loading and computing
    # it take by those estimates (rank 0's bytes).
    judgment: str | None = None
    load_s: float | None = None
    compute_s: float | None = None


@dataclass
class Explanation:
    prompt_tokens: int
    namespace: str
    layouts: list[LayoutReport]  # of the namespace, most restorable first
    elsewhere: list[str] = field(default_factory=list)  # where else the prompt has records
    sealed: list[str] = field(default_factory=list)  # namespaces that could not be read (no secret)

    @property
    def restorable(self) -> int:
        return self.layouts[0].restorable if self.layouts else 0


def explain_layout(store: Store, layout: CacheLayout, namespace: str, tokens: Sequence[int],
                   extra: ExtraKeys | None = None, key: NamespaceKey | None = None,
                   tenant_namespaces: bool = False) -> LayoutReport:
    """One layout against the prompt: one existence check of every record, KV block and state
    of the prefix, then each boundary answered from sorted lists of what is missing."""
    vault = Vault(store, layout, namespace, key, tenant_namespaces=tenant_namespaces and key is not None)
    salt = extra.cache_salt if extra is not None else None
    bs = layout.block_size
    hashes = vault.hashes(tokens, extra)
    longest = min(max_resume_tokens(len(tokens), bs), len(hashes) * bs)
    n = longest // bs
    bounds = list(range(longest, 0, -bs))
    keys = [vault.record_key(hashes[b // bs - 1], salt) for b in bounds]
    slots: list[tuple[int, int, bool, int]] = []  # (group, rank, is_state, first key index)
    for rank in range(layout.world_size):
        for gi, group in enumerate(layout.groups):
            slots.append((gi, rank, group.is_state, len(keys)))
            make = vault.state_ref if group.is_state else vault.block_ref
            keys.extend(make(gi, rank, hashes[i], i, salt=salt).key for i in range(n))
    flags = store.exists_many(keys) if keys else []
    records = dict(zip(bounds, flags, strict=False))
    coverage = Coverage.from_flags(layout, [(gi, rank, range(n), flags[at : at + n])
                                            for gi, rank, _, at in slots])
    first_key = {(gi, rank): at for gi, rank, _, at in slots}

    def gone(b: int, limit: int = 4) -> list[str]:
        return [keys[first_key[(gi, rank)] + i] for gi, rank, i in coverage.missing_at(b, limit)]

    full = any(g.kind is GroupKind.FULL_ATTENTION for g in layout.groups)

    def kv_stored(b: int) -> bool:  # full attention: a sliding window's blocks are kept per boundary
        return full and not coverage.missing_at(b, 1, frozenset({GroupKind.FULL_ATTENTION}))

    report: list[Boundary] = []
    for b in bounds:
        missing = gone(b)
        if records[b]:
            report.append(Boundary(b, GONE if missing else RESTORABLE, missing))
        elif not missing:
            report.append(Boundary(b, UNPUBLISHED))
        elif layout.has_state and kv_stored(b):
            report.append(Boundary(b, NO_STATE))
        else:
            report.append(Boundary(b, NOT_STORED))
    published = [b for b in bounds if records[b]]
    restorable = choose_hit(published, len(tokens), bs, coverage.resumable)
    return LayoutReport(namespace, vault.fingerprint.hex(), layout.model, bs, layout.world_size, longest,
                        restorable, max(published, default=0), report)


def _fields(layout: CacheLayout) -> dict[str, object]:
    data = layout.to_json()
    data.update(dict(layout.extra))
    data.pop("extra")
    data["groups"] = [[g["kind"], g["shards"]] for g in data["groups"]]
    return data


def explain(store: Store, tokens: Sequence[int], namespace: str = "default",
            key: NamespaceKey | None = None, cache_salt: str | None = None,
            weights: str | None = None, costs: Estimates | None = None, local: int = 0,
            tenant_namespaces: bool = False) -> Explanation:
    """Every layout of ``namespace`` against the prompt; then other namespaces and no salt.

    ``weights`` is the content digest of the model the engine would load (``identity``),
    to say whether a layout was written for other weights under the same name. ``costs``: an
    engine's estimates, to say whether that engine, holding ``local`` tokens of the prompt in
    its own cache, would restore the hit (``restore_when: faster``) or compute it.
    ``tenant_namespaces``: the engines keep a salted prompt's keys under its tenant's namespace."""
    sealed: set[tuple[str, str]] = set()
    layouts = load_layouts(store, {namespace: key} if key else None, sealed)
    extra = ExtraKeys(cache_salt=cache_salt)
    here = {fp: lay for (ns, fp), lay in sorted(layouts.items()) if ns == namespace and lay is not None}
    mine = [explain_layout(store, lay, namespace, tokens, extra, key, tenant_namespaces)
            for lay in here.values()]
    mine.sort(key=lambda r: (r.restorable, r.longest_record), reverse=True)
    if mine:
        best = _fields(here[mine[0].fingerprint])
        for report in mine:
            lay = here[report.fingerprint]
            fields = _fields(lay)
            report.differs = sorted(k for k in fields.keys() | best.keys() if fields.get(k) != best.get(k))
            if weights is not None:
                report.weights_match = dict(lay.extra).get("weights") == weights
            if costs is not None and report.restorable > local:
                judged, report.load_s, report.compute_s = judge(
                    costs, report.restorable - local, restore_bytes(lay, report.restorable, local))
                report.judgment = judged.value
    elsewhere: list[str] = []
    for (ns, _), other in sorted(layouts.items()):
        if other is None or ns == namespace:
            continue
        r = explain_layout(store, other, ns, tokens, extra)
        if r.longest_record:
            elsewhere.append(f"namespace {ns!r}: records up to {r.longest_record} tokens, "
                             f"{r.restorable} restorable")
    if cache_salt is not None:
        for unsalted in here.values():
            r = explain_layout(store, unsalted, namespace, tokens, None, key)
            if r.longest_record:
                elsewhere.append(f"without the cache salt: records up to {r.longest_record} tokens")
    return Explanation(len(tokens), namespace, mine, elsewhere, sorted({ns for ns, _ in sealed}))


def runs(boundaries: Sequence[Boundary]) -> list[tuple[int, int, str]]:
    """Consecutive boundaries with one status as (longest, shortest, status), longest first."""
    out: list[tuple[int, int, str]] = []
    for b in boundaries:
        if out and out[-1][2] == b.status and not b.missing:
            out[-1] = (out[-1][0], b.tokens, b.status)
        else:
            out.append((b.tokens, b.tokens, b.status))
    return out


def render(ex: Explanation) -> list[str]:
    """The report as lines of text."""
    lines = [f"prompt: {ex.prompt_tokens} tokens, namespace {ex.namespace!r}"]
    if not ex.layouts:
        lines.append("no layout of this namespace is stored: nothing was ever saved here"
                     + (" (or its secret was not given)" if ex.namespace in ex.sealed else ""))
    for r in ex.layouts:
        lines.append(f"layout {r.fingerprint[:12]} ({r.model}, block size {r.block_size}, "
                     f"{r.world_size} rank{'s' if r.world_size > 1 else ''}): restorable {r.restorable} "
                     f"of {r.longest} tokens; longest record {r.longest_record}")
        if r.differs:
            lines.append(f"  differs from the layout above in: {', '.join(r.differs)}")
        if r.weights_match is False:
            lines.append("  written for other weights than --model's files")
        if r.judgment is not None:
            verdict = {"pays": "restores it", "not_worth_it": "computes it instead (not_worth_it)",
                       "unknown": "restores it (its prefill is not measured yet)"}[r.judgment]
            lines.append(f"  restore_when: faster {verdict}: loading ~{1000 * (r.load_s or 0):.1f} ms, "
                         f"computing ~{1000 * (r.compute_s or 0):.1f} ms by the engine's estimates")
        for hi, lo, status in runs(r.boundaries):
            span = f"{hi}" if hi == lo else f"{hi}..{lo}"
            lines.append(f"  {span:>15}  {status}")
            if status == GONE:
                gone = next(b for b in r.boundaries if b.tokens == hi)
                lines.extend(f"{'':19}gone: {k}" for k in gone.missing)
    lines.extend(f"elsewhere: {e}" for e in ex.elsewhere)
    if ex.sealed:
        lines.append(f"namespaces with a secret not given here (not searched): {', '.join(ex.sealed)}")
    return lines


def as_json(ex: Explanation) -> dict[str, object]:
    from dataclasses import asdict

    return {**asdict(ex), "restorable": ex.restorable}

