"""What a lookup's hit uses is touched on a lane of its own: over a network store a touch is a
round trip, and the next lookups must not wait behind it. Real vault and memory store (marked
remote, so that hits are answered from the first round trip and their touches come after);
no engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from test_vault import fill, layout

from prefixvault.guard import Guard
from prefixvault.keys import ExtraKeys
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.lookups import Lookups

TOKENS = list(range(64))


class SlowTouches(MemoryStore):
    """A network store whose touches made on the touch lane wait until ``release`` is set."""

    remote = True

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = threading.Event()
        self.touched_late: list[str] = []

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        if threading.current_thread().name == "prefixvault-touch":
            self.waiting.set()
            assert self.release.wait(10)
            self.touched_late.extend(keys)
        return super().touch_many(keys, touch)


def test_a_slow_touch_never_holds_the_next_lookup() -> None:
    store = SlowTouches()
    vault = Vault(store, layout())
    fill(vault, TOKENS, [16, 40])
    lookups = Lookups(vault, Guard())
    ask = dict(prompt=TOKENS[:41], extra=ExtraKeys(), known=[], num_tokens=41, min_tokens=0, saving=None)
    try:
        _, first, _ = lookups.submit(**ask).result(5)  # type: ignore[arg-type]
        assert first is not None and first.hit == 40
        assert store.waiting.wait(5)  # its touch is under way, and stuck
        _, second, _ = lookups.submit(**ask).result(5)  # type: ignore[arg-type]
        assert second is not None and second.hit == 40  # answered meanwhile
        assert store.touched_late == []
        store.release.set()
        deadline = time.monotonic() + 5
        while lookups.touches.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        hit = vault.needed(vault.hashes(TOKENS[:41])[:5], 40)
        assert {r.key for r in hit} <= set(store.touched_late)  # both hits' objects touched, late
        assert lookups.touches.counters.snapshot()["jobs"] == 2
    finally:
        store.release.set()
        lookups.close(5)
