"""prefixvault for vLLM: ``kv_connector_module_path = "prefixvault.vllm"``.

The connector class is imported on first use, so that the connector's settings can be
checked (``prefixvault serve``) without importing vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrefixVaultConnector"]


def __getattr__(name: str) -> Any:
    if name == "PrefixVaultConnector":
        from prefixvault.vllm.connector import PrefixVaultConnector

        return PrefixVaultConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
