"""A negative control: a consumer that restores a deliberately wrong recurrent state.

``prefixvault repro --control`` runs one more consumer with this connector to show, on the
user's own model, that the comparison with cold has teeth: every load is done as usual (the
right KV blocks, verified), and then each state group's block is overwritten with zeros —
the state of the empty prefix, i.e. the state of another boundary (0), which is what a restore
of the seed bug's null block hands the model. If the output does not change, a wrong state
would have gone unnoticed on this model too, and repro says the model cannot judge.

Never configure it on a server: it is wrong by design. It is a subclass of the real connector
so that everything else it does is what the real consumer does.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from prefixvault.vllm.connector import PrefixVaultConnector
from prefixvault.vllm.metadata import LoadSpec, PrefixVaultMetadata

log = logging.getLogger("vllm.prefixvault")


class PrefixVaultControlConnector(PrefixVaultConnector):
    """Loads as the real connector does, then zeroes the restored states (a wrong state)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loading: dict[str, LoadSpec] = {}
        self.zeroed = 0  # states overwritten
        if self.worker is not None:
            log.warning("prefixvault: NEGATIVE CONTROL: restored recurrent states are replaced by zeros; "
                        "this engine's output is wrong by design")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PrefixVaultMetadata):
            self._loading.update({spec.req_id: spec for spec in meta.loads if not spec.in_step})
        super().start_load_kv(forward_context, **kwargs)
        if isinstance(meta, PrefixVaultMetadata):
            for spec in meta.loads:
                if spec.in_step:  # written already, before this step's forward: zeroed before it runs
                    self._zero_states(spec)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        failed = results.failed_recving or set()
        for req_id in results.finished_recving or set():
            spec = self._loading.pop(req_id, None)
            if spec is not None and req_id not in failed:
                self._zero_states(spec)  # before vLLM learns the load is done: before it computes
        return results

    def _zero_states(self, spec: LoadSpec) -> None:
        import torch

        worker = self.worker
        if worker is None:
            return
        bs = worker.layout.block_size
        for g, group in enumerate(worker.layout.groups):
            table = spec.block_ids[g] if g < len(spec.block_ids) else []
            idx = (spec.tokens - 1) // bs
            if not group.is_state or idx >= len(table) or table[idx] == 0:
                continue
            zeros = torch.zeros((1, worker.caches.object_bytes(g)), dtype=torch.uint8)
            # a synchronous load's state is also in the running blocks the forward reads
            for block in [table[idx], *(b for gg, b in spec.state_copies if gg == g)]:
                worker.caches.scatter(g, [block], zeros)
            self.zeroed += 1
            log.warning("prefixvault: negative control: zeroed the restored state of group %d (block %d) "
                        "for request %s", g, table[idx], spec.req_id)
