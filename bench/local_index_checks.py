"""What the local store's row check costs a lookup, in one run.

    python bench/local_index_checks.py [--rows 200000] [--ask 8192] [--repeat 7]

A key's row names a slot, and since issue 31 every existence check also proves the slot row
agrees (live, of the key's generation and class: ``_index.CONSISTENT``), so damage to the index
reads as a miss, never a hit that then fails. This fills a store's index with ``--rows`` slab
objects (real puts; tiny slab files, the bytes do not matter here), then times
``exists_many`` on ``--ask`` keys (what a lookup asks) against the same query without the
check, run on the same connection in the same rounds. Seconds are the best of ``--repeat``; the
ratio is the median over rounds of checked / plain. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from prefixvault.stores._index import CONSISTENT, SLOT_JOIN, chunks, marks
from prefixvault.stores.base import check_key
from prefixvault.stores.local import LocalStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--ask", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    payload = bytes(70 << 10)  # just above the inline limit: one 72 KiB slot per object
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "s", capacity=(args.rows + 64) * (72 << 10) * 2)
        t0 = time.perf_counter()
        for i in range(0, args.rows, 2000):
            store.put_many([(f"ns/fp/b/0/0/{j:032x}", [payload]) for j in range(i, min(i + 2000, args.rows))])
        print(f"filled {args.rows} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        step = max(args.rows // args.ask, 1)
        keys = [f"ns/fp/b/0/0/{j:032x}" for j in range(0, args.rows, step)][: args.ask]
        conn = store._db()
        # The two queries differ only in the check: both run exactly as ``exists_many`` does.
        plain_sql = "SELECT k.key FROM keys k WHERE k.key IN ({marks})"
        checked_sql = f"SELECT k.key FROM keys k {SLOT_JOIN} WHERE k.key IN ({{marks}}) AND {CONSISTENT}"

        def exists(sql: str) -> list[bool]:
            for key in keys:
                check_key(key)
            present: set[str] = set()
            for chunk in chunks(list(dict.fromkeys(keys))):
                present.update(r[0] for r in conn.execute(sql.format(marks=marks(len(chunk))), chunk))
            return [key in present for key in keys]

        assert exists(checked_sql) == store.exists_many(keys)
        checked_s, plain_s, ratios = [], [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            found = exists(checked_sql)
            a = time.perf_counter() - t
            t = time.perf_counter()
            found_plain = exists(plain_sql)
            b = time.perf_counter() - t
            assert all(found) and all(found_plain)
            checked_s.append(a)
            plain_s.append(b)
            ratios.append(a / b)
        store.close()
    out = {"rows": args.rows, "ask": len(keys), "exists_checked_ms": round(min(checked_s) * 1e3, 3),
           "exists_plain_ms": round(min(plain_s) * 1e3, 3),
           "ratio_median": round(statistics.median(ratios), 3)}
    print(f"exists_many of {len(keys)} keys among {args.rows} rows: checked {out['exists_checked_ms']} ms, "
          f"plain {out['exists_plain_ms']} ms, ratio {out['ratio_median']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
