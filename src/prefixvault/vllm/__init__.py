"""prefixvault for vLLM: ``kv_connector_module_path = "prefixvault.vllm"``."""

from prefixvault.vllm.connector import PrefixVaultConnector

__all__ = ["PrefixVaultConnector"]
