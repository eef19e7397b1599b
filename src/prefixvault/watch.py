"""``prefixvault watch``: recompute verification samples cold and quarantine what disagrees.

Each sample (see samples.py) is sent to a cold server — one without the cache — as a greedy
completion of the same prompt token ids. Tokens are compared position by position up to the
first difference. A difference where the cold server ranks the restored token within
``tolerance`` of its own top choice is a near tie (engines that are not batch-invariant move
logprobs in the last digits) and passes; any other difference quarantines the record that
published the restored boundary: it is removed, so no consumer restores it again, counted and
logged with the sample's provenance. The sample is removed either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixvault.samples import VerifySample, pending_samples
from prefixvault.stores import Store
from prefixvault.tenancy import NamespaceKey
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


def watch_once(store: Store, cold: str, namespace: str | None = None, tolerance: float = 0.05,
               timeout: float = 300, model: str | None = None,
               on_verdict: Callable[[Verdict], None] | None = None,
               key: NamespaceKey | None = None) -> WatchReport:
    """Check every pending sample once (with ``key``: of its namespace, sealed with it)."""
    model = model or served_models(cold)[0]
    report = WatchReport()
    for name, sample in pending_samples(store, namespace, key):
        if sample is None:
            report.unreadable += 1
            store.delete_many([name])
            continue
        verdict = judge(cold, model, sample, tolerance, timeout)
        report.checked += 1
        if verdict.ok:
            report.agreed += 1
        else:
            store.delete_many([sample.record])
            report.quarantined.append(verdict)
            log.warning("quarantined %s: restored %d of %d prompt tokens on %s at %.0f; generated token %s "
                        "is %s, cold gives %s (margin %s)", sample.record, sample.hit, len(sample.prompt),
                        sample.engine or "?", sample.created, verdict.position, verdict.restored_token,
                        verdict.cold_token, "n/a" if verdict.margin is None else f"{verdict.margin:.3g}")
        store.delete_many([name])
        if on_verdict is not None:
            on_verdict(verdict)
    return report
