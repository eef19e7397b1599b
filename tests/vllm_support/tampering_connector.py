"""prefixvault's connector with faults injected between a restore's lookup and its load, for the
fault tests. ``PREFIXVAULT_TAMPER`` says which:

- ``handed``: one bit of every object handed to the worker for a synchronous load is flipped
  after the scheduler handed it over (as a process of the same user could in the mailbox);
- ``removed``: every object a load reads is removed from the store once vLLM allocated it;
- ``state``: only the state at the boundary a request's first load restores is removed then
  (its KV stays);
- ``shm_full``: shared memory cannot take a hand-over (``ENOSPC``, as a full ``/dev/shm``
  raises: the machine's own cannot be filled safely in a test);
- ``mailbox_gone``: the worker's mailbox directory in shared memory is removed just before
  the first hand-over (after the lookup found it and read ahead).

Never use it elsewhere.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from typing import Any

from prefixvault.codec import ObjectKind
from prefixvault.vllm.connector import PrefixVaultConnector
from prefixvault.vllm.in_step import InStepHandover, ReadAhead
from prefixvault.vllm.mailbox import Mailboxes, SharedMailbox
from prefixvault.vllm.restores import Restores
from prefixvault.vllm.scheduler import SchedulerSide


class TamperedHandover(InStepHandover):
    def hand_over(self, req_id: str, read_ahead: ReadAhead | None, refs: Sequence[Any], step: int) -> int:
        token = super().hand_over(req_id, read_ahead, refs, step)
        if token and read_ahead is not None:
            for ref in refs:
                read_ahead.objects[ref][-1] ^= 0x01  # the bytes the worker takes: its last payload byte
        return token


class FullHandover(InStepHandover):
    def hand_over(self, req_id: str, read_ahead: ReadAhead | None, refs: Sequence[Any], step: int) -> int:
        def full(*args: Any, **kwargs: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        SharedMailbox.put = full  # type: ignore[method-assign]
        return super().hand_over(req_id, read_ahead, refs, step)


class VanishingHandover(InStepHandover):
    def hand_over(self, req_id: str, read_ahead: ReadAhead | None, refs: Sequence[Any], step: int) -> int:
        mailbox = Mailboxes.find(self.engine_id)
        if isinstance(mailbox, SharedMailbox):
            shutil.rmtree(mailbox.path, ignore_errors=True)
        return super().hand_over(req_id, read_ahead, refs, step)


class RemovingRestores(Restores):
    states_only = False  # (and the first load of each request only)

    def allocated(self, tr: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().allocated(tr, request, blocks, num_external_tokens)
        if self.states_only and tr.restore.loads > 1:
            return
        for load in self._pending:
            if load.req_id == tr.req_id and load.hashes:
                refs = self.vault.needed(load.hashes, load.tokens, since=load.local_tokens)
                self.vault.store.delete_many([r.key for r in refs
                                              if not self.states_only or r.kind is ObjectKind.STATE])


class StateRemovingRestores(RemovingRestores):
    states_only = True


class TamperingConnector(PrefixVaultConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        side: SchedulerSide | None = self.scheduler
        fault = os.environ.get("PREFIXVAULT_TAMPER", "")
        if side is None or side.restores is None:
            return
        if fault == "handed":
            side.handover.__class__ = TamperedHandover
        elif fault == "removed":
            side.restores.__class__ = RemovingRestores
        elif fault == "state":
            side.restores.__class__ = StateRemovingRestores
        elif fault == "shm_full":
            side.handover.__class__ = FullHandover
        elif fault == "mailbox_gone":
            side.handover.__class__ = VanishingHandover
        else:
            raise ValueError(f"PREFIXVAULT_TAMPER={fault!r}: handed, removed, state, shm_full or "
                             "mailbox_gone")
