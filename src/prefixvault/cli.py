"""The ``prefixvault`` command: demo, stats and audit of a store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.table import Table

from prefixvault.stores import Store, StoreError, default_local_dir, open_store
from prefixvault.units import format_size

app = typer.Typer(
    help="prefixvault: an external prefix cache that is exact for hybrid and recurrent models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True, soft_wrap=True)

StoreOpt = Annotated[str, typer.Option("--store", help="Store URI, e.g. local:///dev/shm/prefixvault")]


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {message}", highlight=False)
    return typer.Exit(2)


def _open_existing(uri: str) -> Store:
    """Open a store that must already exist (read commands never create one)."""
    parts = urlsplit(uri)
    if parts.scheme == "local" and not parts.netloc:
        path = Path(parts.path) if parts.path else default_local_dir()
        if not path.is_dir():
            raise _fail(f"no store at {path}: the directory does not exist")
    try:
        return open_store(uri)
    except (StoreError, ValueError, OSError) as e:
        raise _fail(str(e)) from None


@app.command()
def demo(
    store: Annotated[
        str, typer.Option(help="Store URI (default: a fresh local store in a temporary directory)")
    ] = "",
    chunk: Annotated[
        int, typer.Option(help="Producer tokens per step (like max_num_batched_tokens)")
    ] = 200,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end")] = False,
) -> None:
    """Run publish → look up → load → verify end to end, producer and consumer in separate processes."""
    import tempfile

    from prefixvault.demo import run

    if chunk <= 0:
        raise _fail("--chunk must be positive")
    with tempfile.TemporaryDirectory(prefix="prefixvault-demo-", dir=_tmp_root()) as tmp:
        uri = store or f"local://{tmp}/store?capacity=256MiB"
        try:
            ok = run(uri, chunk, json_out)
        except (StoreError, ValueError) as e:
            raise _fail(str(e)) from None
    raise typer.Exit(0 if ok else 1)


def _tmp_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


@app.command()
def stats(store: StoreOpt) -> None:
    """Objects, bytes and records in a store, by group kind."""
    from prefixvault.inventory import summarize

    s = _open_existing(store)
    try:
        summary = summarize(s)
        st = s.stats()
    except StoreError as e:
        raise _fail(str(e)) from None
    finally:
        s.close()
    table = Table(title=f"store {store}")
    table.add_column("kind")
    table.add_column("objects", justify="right")
    table.add_column("bytes", justify="right")
    for kind in sorted(summary.by_kind):
        table.add_row(kind, str(summary.by_kind[kind]), format_size(summary.bytes_by_kind[kind]))
    table.add_row("[bold]total[/]", str(summary.objects), format_size(summary.bytes))
    console.print(table)
    cap = "unbounded" if st.capacity is None else format_size(st.capacity)
    console.print(f"records: {summary.records}  layouts: {summary.layouts}  capacity: {cap}  "
                  f"evictions: {st.evictions}")


@app.command()
def audit(
    store: StoreOpt,
    repair: Annotated[bool, typer.Option("--repair", help="Remove broken records and bad objects")] = False,
) -> None:
    """Walk every record, verify every object it needs and report what is wrong."""
    from prefixvault.inventory import audit as run_audit

    s = _open_existing(store)
    try:
        report = run_audit(s, repair=repair)
    except StoreError as e:
        raise _fail(str(e)) from None
    finally:
        s.close()
    for f in report.findings:
        console.print(f"[red]broken[/] {f.record_key}: {f.problem} {f.object_key}".rstrip(), highlight=False)
    broken = len(report.broken_records)
    console.print(f"records: {report.records}  objects checked: {report.objects_checked}  "
                  f"broken records: {broken}" + (f"  removed: {report.repaired}" if repair else ""))
    raise typer.Exit(1 if broken and not repair else 0)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
if __name__ == "__main__":
    main()
