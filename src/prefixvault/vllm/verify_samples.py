"""Verification samples written on a lane of their own (``verify_sample``).

A consumer samples some restored greedy requests: prompt, restored boundary and first output
tokens, written to the store for ``prefixvault watch`` to recompute cold and compare. Best
effort: a sample that cannot be written is counted (``verify_sample_errors``), never an error
in the engine, and a put never delays a lookup (they run on different lanes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefixvault.guard import Guard
from prefixvault.lane import Failure, Lane
from prefixvault.samples import VerifySample, write_sample
from prefixvault.stores.base import StoreError
from prefixvault.vault import Vault

log = logging.getLogger("vllm.prefixvault")

#: Verification samples queued or being written at most; past it a sample is dropped.
MAX_PENDING_SAMPLES = 64


class SampleWriter:
    def __init__(self, vault: Vault, guard: Guard, count_error: Callable[[int], None],
                 capacity: int | None = None) -> None:
        """``count_error(n)``: n samples not written (the owner's counter); ``capacity``:
        ``MAX_PENDING_SAMPLES`` unless given."""
        self.vault = vault
        self.guard = guard
        self._count_error = count_error
        self.lane: Lane[tuple[VerifySample, str, str | None]] = Lane(
            "sample", self._write, self._drop, capacity=capacity or MAX_PENDING_SAMPLES, guard=guard)

    def put(self, sample: VerifySample, req_id: str, salt: str | None = None) -> None:
        """Queue ``sample`` of request ``req_id``; ``salt``: its cache salt, whose tenant's key
        seals it."""
        refused = self.lane.put((sample, req_id, salt))
        if refused is not None:  # the store not keeping up, or the connector closing
            self._count_error(1)
            log.debug("prefixvault: verification sample for request %s dropped (%s)", req_id, refused.value)

    def close(self, timeout: float) -> bool:
        """Let the samples queued land, up to ``timeout`` (those left are dropped). Whether idle."""
        done = self.lane.close(timeout, drop_queued=False)
        if not done:
            log.warning("prefixvault: verification samples not written at shutdown (the store did not "
                        "answer within %g s); the store is left open for the one being written", timeout)
        return done

    def _write(self, batch: list[tuple[VerifySample, str, str | None]]) -> None:
        """Each sample written on its own (a failed one is counted: the store's failure as a
        warning, ours with its traceback once per type)."""
        for sample, req_id, salt in batch:
            try:
                if write_sample(self.vault.store, sample, self.vault.key_for(salt)):
                    continue
                log.warning("prefixvault: verification sample for request %s not written", req_id)
            except StoreError as e:
                log.warning("prefixvault: verification sample for request %s not written: %s", req_id, e)
            except Exception as e:
                self.guard.failed("sample", e)
            self._count_error(1)

    def _drop(self, batch: list[tuple[VerifySample, str, str | None]], reason: Failure,
              error: BaseException | None) -> None:
        self._count_error(len(batch))
