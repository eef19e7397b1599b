"""A deliberately wrong connector for the negative control: it publishes like the seed bug.

It takes a state for every block boundary from the position in the state block table,
null block included, instead of from the engine's reports. Tests use it to show that the
seed scenario really fails when the boundary rule is bypassed. Never use it elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixvault.boundary import SavePlan
from prefixvault.vllm.compat import step_starts
from prefixvault.vllm.connector import PrefixVaultConnector
from prefixvault.vllm.metadata import SaveSpec
from prefixvault.vllm.request import TrackedRequest
from prefixvault.vllm.save_plans import SavePlans


class UnsafeSavePlans(SavePlans):
    def plan(self, out: Any, step: int, requests: Mapping[str, TrackedRequest]) -> list[SaveSpec]:
        state = out.kv_connector_block_state
        if state is None:
            return []
        bs = self.block_size
        starts = step_starts(out)
        saves = []
        for req_id, n_new in out.num_scheduled_tokens.items():
            st = requests.get(req_id)
            tables = state.get_block_ids(req_id)
            if st is None or tables is None or req_id not in starts:
                continue
            end = min(starts[req_id] + n_new, len(st.prompt))
            plans = []
            for b in range(max(st.saved, starts[req_id]) // bs * bs + bs, end // bs * bs + 1, bs):
                n = b // bs
                blocks = tuple((g, i, tables[g][i]) for g in self.attn_groups for i in range(n))
                states = tuple((g, tables[g][n - 1] if n - 1 < len(tables[g]) else 0)
                               for g in self.state_groups)
                plans.append(SavePlan(b, blocks, states))
            if plans:
                st.saved = max(p.tokens for p in plans)
                saves.append(SaveSpec(req_id, self.ctx.chain(st, st.saved), plans))
        return saves


class UnsafeConnector(PrefixVaultConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scheduler is not None and self.scheduler.saves is not None:
            self.scheduler.saves.__class__ = UnsafeSavePlans
