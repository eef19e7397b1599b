"""Keep vLLM's prefill chunks ending on the hybrid cache's block boundaries.

In ``mamba_cache_mode="align"`` vLLM's scheduler ends every prefill chunk that does not
finish the prompt on a multiple of ``cache_config.block_size``, so that the state a chunk
leaves behind is the state at a block boundary. vLLM 0.32 on CPU breaks that in every
multiprocess engine (every OpenAI server) started without ``--block-size``: the engine core
resolves the hybrid block size (e.g. 256) while building the KV cache, then re-runs
``VllmConfig.__post_init__`` after its start-up handshake, and the CPU platform resets
``block_size`` to its default of 128. From then on chunks end mid-block; a chunk that starts
mid-block leaves the state at its start in a block that vLLM later caches, and offers to
connectors, as the state at the block's end. vLLM's own prefix cache then reuses those
states (wrong output), and a connector that trusted the offers would publish them.

prefixvault refuses such offers in any case (``boundary.py``: a state is exact only at its
step's chunk end). This module also puts back the block size vLLM itself resolved, before
the scheduler splits a chunk with the wrong one, so that vLLM's own prefix cache stays right
and chunk ends fall where states can be published. vLLM 0.33 fixed the reset
(``compat.resets_cpu_block_size``); there, and on GPUs, a block size that differs is only
said once, never rewritten: the scheduler's value may then differ for a reason of vLLM's own.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.prefixvault")


class ChunkAlignment:
    """Watches the scheduler's ``cache_config.block_size`` for a hybrid model in align mode."""

    def __init__(self, cache_config: Any, block_size: int, enabled: bool, rewrite: bool = True) -> None:
        self.cache_config = cache_config
        self.block_size = block_size
        self.enabled = enabled and getattr(cache_config, "mamba_cache_mode", None) == "align"
        self.rewrite = rewrite  # only where vLLM is known to reset it (0.32 on CPU)
        self.restored_from: int | None = None  # what vLLM had reset it to, once seen
        self._said = False

    def check(self) -> None:
        """Put the hybrid block size back if vLLM reset it (cheap; called every step)."""
        if not self.enabled or self.cache_config.block_size == self.block_size:
            return
        was = int(self.cache_config.block_size)
        if not self.rewrite:
            if not self._said:
                self._said = True
                log.warning("prefixvault: vLLM's scheduler aligns prefill chunks to %d tokens while the "
                            "hybrid cache blocks hold %d; states are published only at chunk ends that "
                            "fall on a block boundary", was, self.block_size)
            return
        self.cache_config.block_size = self.block_size
        if self.restored_from is None:
            self.restored_from = was
            log.warning(
                "prefixvault: vLLM's scheduler was aligning prefill chunks to %d tokens while the "
                "hybrid cache blocks hold %d; chunks ending mid-block make vLLM cache states under "
                "the wrong boundary. Restored %d. Start vLLM with --block-size %d to avoid this.",
                was, self.block_size, self.block_size, self.block_size,
            )
