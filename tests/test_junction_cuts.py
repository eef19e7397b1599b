"""A hit cut at the request's junction (``vllm/lookups.py``): one cut at a time there. Real
vault over a memory store; the rule that weighs a cut (``RestoreCosts.stop_at_junction``,
tested in ``test_costs.py``) is replaced by one that always cuts; no engine."""

from __future__ import annotations

from test_vault import fill, layout

from prefixvault.costs import LAST_STEP_SHARE, Estimates, RestoreCosts
from prefixvault.guard import Guard
from prefixvault.keys import ExtraKeys
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import Vault
from prefixvault.vllm.lookups import Lookups

TOKENS = list(range(64))
RESTORE_S, STEP_S = 1.0, 0.1
#: A cut's restore (its fixed second and half a step) and a step.
LANDING_S = RESTORE_S + LAST_STEP_SHARE * STEP_S + STEP_S


class AlwaysCuts(RestoreCosts):
    def __init__(self) -> None:
        super().__init__()
        self.weighed = 0

    def stop_at_junction(self, tokens: int, nbytes: int, in_step: bool) -> bool:
        self.weighed += 1
        return True

    def estimates(self) -> Estimates:  # a restore takes a second, whatever its bytes
        return Estimates(1e-3, STEP_S, 0.01, 0.0, RESTORE_S, RESTORE_S)


def test_a_junction_is_cut_once_while_that_cut_lands() -> None:
    """Boundaries stored at 8, 16 and 40 tokens; the requests' junction at 16 (the engine holds
    the prefix's KV there, no state). The first request is cut to 16. A second one, while that
    cut's restore is still on its way into the engine's cache (a restore and a step), restores
    40: it finds no state at 16 yet, and a cut of its own would leave a state there that
    serves no request the first one's does not (requests arriving together each paid a cut
    before). Once that time is past, a request reaching the junction again (its state
    evicted, say) is cut. Another junction is cut apart."""
    vault = Vault(MemoryStore(), layout())
    fill(vault, TOKENS, [8, 16, 40])
    costs = AlwaysCuts()
    now = [100.0]
    lookups = Lookups(vault, Guard(), costs=costs, clock=lambda: now[0])

    def ask(junction: int = 16) -> tuple[int, bool]:
        _, found, _ = lookups.submit(prompt=TOKENS[:41], extra=ExtraKeys(), known=[], num_tokens=41,
                                     min_tokens=0, saving=None, junction=junction).result(5)
        assert found is not None
        return found.hit, found.at_junction

    assert ask() == (16, True)
    now[0] += LANDING_S - 0.01
    assert ask() == (40, False)  # the first cut not yet in the engine's cache
    assert ask(junction=8) == (8, True)  # another junction
    now[0] += 0.02
    assert ask() == (16, True)
    assert costs.weighed == 3  # (not weighed while a cut was landing)
    lookups.close(1)
