"""prefixvault's connector with vLLM's chunk alignment left as vLLM CPU resets it.

Tests use it to make a server-like engine end prefill chunks mid-block, so that vLLM offers
states at boundaries strictly inside a chunk, and to show that the boundary rule refuses
them. Never use it elsewhere.
"""

from __future__ import annotations

from typing import Any

from prefixvault.vllm.connector import PrefixVaultConnector


class UnalignedConnector(PrefixVaultConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scheduler is not None:
            self.alignment.enabled = False
