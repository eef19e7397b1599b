"""Whether another tenant can tell, by timing, that a prompt was cached: the ROC AUC of lookup
and load times for guessed prompts one tenant cached against prompts nobody sent.

    python bench/tenant_timing.py [--trials 2000] [--tokens 1024] [--block 64] [--dir /dev/shm]

A keyed namespace on a local store (real files). The victim, a request salt of its own
(``cache_salt``), publishes every other guessed prompt (every block boundary, a state at each).
The attacker holds what every request of the engine shares, the namespace's secret, and a salt
of its own, not the victim's: for each guessed prompt, in a random order, it looks the prompt up
under its salt (and loads whatever that finds) and times it. The AUC is the chance that a cached
prompt's time ranks above one of a prompt nobody sent: 0.5 is no better than chance (goal: within
0.45-0.55; with 1000 prompts of each kind its standard error is about 0.013). The same lookups
under the victim's own salt are the control: cached prompts hit there, and their times tell.

Last line: one JSON object (``auc``: the attacker's lookup, its load and whether anything was
found; ``control_auc``: the victim's).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from prefixvault.boundary import StateCapture, plan_saves
from prefixvault.keys import ExtraKeys
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec
from prefixvault.stores.local import LocalStore
from prefixvault.tenancy import NamespaceKey
from prefixvault.vault import ObjectRef, Vault

VICTIM, ATTACKER = "victim's salt", "attacker's salt"
GOAL = (0.45, 0.55)


def layout(block_size: int) -> CacheLayout:
    return CacheLayout(model="bench-tenants", block_size=block_size,
                       groups=(CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((4096,), "uint8")]),
                               CacheGroup.uniform(GroupKind.STATE, [TensorSpec((16384,), "uint8")])))


def publish(vault: Vault, tokens: list[int], salt: str) -> None:
    """Every block boundary of ``tokens`` published by a request with ``salt``."""
    bs = vault.layout.block_size
    hashes = vault.hashes(tokens, ExtraKeys(cache_salt=salt))
    n = len(tokens) // bs
    captures = [StateCapture(1, b, 1000 + b // bs, 1) for b in range(bs, n * bs + 1, bs)]
    decision = plan_saves(vault.layout, n * bs, {0: list(range(1, n + 1))}, captures, step=1)

    def read(ref: ObjectRef, block_id: int) -> bytes:
        return bytes([block_id % 251]) * vault.layout.groups[ref.group].nbytes(0)

    acks = vault.save(0, hashes, decision.publishable, read, salt=salt)
    vault.publish(hashes, acks, salt=salt)


def probe(vault: Vault, tokens: list[int], salt: str) -> tuple[float, float, int]:
    """Seconds a request with ``salt`` takes to look ``tokens`` up, to load what it found, and
    the tokens found."""
    hashes = vault.hashes(tokens, ExtraKeys(cache_salt=salt))
    t0 = time.perf_counter()
    hit = vault.lookup(hashes, len(tokens), salt=salt)
    t1 = time.perf_counter()
    if hit:
        vault.load(vault.needed(hashes, hit, salt=salt))
    return t1 - t0, time.perf_counter() - t1, hit


def auc(cached: list[float], never: list[float]) -> float:
    """P(a cached prompt's figure > a never-sent one's), ties counting half (Mann-Whitney)."""
    both = np.asarray(cached + never)
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    for value in np.unique(both):  # ties share their mean rank
        tied = both == value
        ranks[tied] = ranks[tied].mean()
    n1, n2 = len(cached), len(never)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n2))


def run(args: argparse.Namespace, root: Path) -> dict[str, object]:
    store = LocalStore(root / "store", capacity=4 << 30)
    vault = Vault(store, layout(args.block), "tenants", NamespaceKey.derive(b"s" * 32, "tenants"))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(50000) for _ in range(args.tokens)] for _ in range(args.trials)]
    cached = set(range(0, args.trials, 2))
    for i in sorted(cached):
        publish(vault, prompts[i] + [1], VICTIM)  # (a longer request: the guessed prompt restores)
    for i in range(min(50, args.trials)):  # warm the interpreter and the page cache
        probe(vault, prompts[i], ATTACKER)
    figures: dict[str, dict[str, list[float]]] = {who: {"lookup": [], "load": [], "found": []}
                                                  for who in ("attacker", "victim")}
    kinds: dict[str, list[bool]] = {"attacker": [], "victim": []}
    order = list(range(args.trials))
    rng.shuffle(order)
    for i in order:
        for who, salt in (("attacker", ATTACKER), ("victim", VICTIM)):
            looked, loaded, hit = probe(vault, prompts[i], salt)
            figures[who]["lookup"].append(looked)
            figures[who]["load"].append(loaded)
            figures[who]["found"].append(float(hit))
            kinds[who].append(i in cached)

    def aucs(who: str) -> dict[str, float]:
        is_cached = kinds[who]
        return {name: round(auc([v for v, c in zip(values, is_cached, strict=True) if c],
                                [v for v, c in zip(values, is_cached, strict=True) if not c]), 4)
                for name, values in figures[who].items()}

    store.close()
    out: dict[str, object] = {"trials": args.trials, "tokens": args.tokens, "block": args.block,
                              "auc": aucs("attacker"), "control_auc": aucs("victim"), "goal": list(GOAL)}
    attacker = aucs("attacker")
    out["goal_met"] = all(GOAL[0] <= v <= GOAL[1] for v in attacker.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=2000, help="guessed prompts, half of them cached")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = p.parse_args()
    if args.trials < 2 or args.tokens < args.block:
        raise SystemExit("--trials must be at least 2 and --tokens at least one --block")
    with tempfile.TemporaryDirectory(prefix="prefixvault-tenant-timing-", dir=args.dir) as tmp:
        out = run(args, Path(tmp))
    a, c = out["auc"], out["control_auc"]
    print(f"attacker (another salt): AUC lookup {a['lookup']}, load {a['load']}, found {a['found']}"  # type: ignore[index]
          f" (goal {GOAL[0]}-{GOAL[1]})")
    print(f"control (the victim's own salt): AUC lookup {c['lookup']}, load {c['load']}, "  # type: ignore[index]
          f"found {c['found']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
