"""Every miss says why: each reason produced on purpose on a real store, and named right."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from test_vault import BS, fill, layout
from vllm_support.asking import ask as ask_side

from prefixvault.stores.base import StoreUnavailable
from prefixvault.stores.memory import MemoryStore
from prefixvault.vault import LookupResult, Miss, Vault
from prefixvault.vllm.config import ConnectorSettings
from prefixvault.vllm.scheduler import SchedulerSide

TOKENS = list(range(64))


def filled() -> Vault:
    vault = Vault(MemoryStore(), layout())
    assert fill(vault, TOKENS, [16, 40, 56]) == [16, 40, 56]  # KV of blocks 0..6, states at 16, 40, 56
    return vault


def ask(vault: Vault, prompt: Sequence[int], local: int = 0) -> LookupResult:
    return vault.lookup_explained(vault.hashes(prompt), len(prompt), local)


def test_a_full_hit_has_no_reason() -> None:
    vault = filled()
    assert ask(vault, TOKENS[:41]) == LookupResult(40, 40, None)
    assert not vault.counters.misses


def test_each_reason_on_purpose() -> None:
    vault = filled()
    # the prompt is shorter than a block and a token
    assert ask(vault, TOKENS[:BS]) == LookupResult(0, 0, Miss.SHORT_PROMPT)
    # the engine's own cache already holds the longest prefix
    assert ask(vault, TOKENS[:41], local=40) == LookupResult(0, 40, Miss.LOCAL_HIT)
    # KV stored past 40, no state captured at 48: the state is what is missing
    assert ask(vault, [*TOKENS[:48], 999]) == LookupResult(40, 48, Miss.NO_STATE)
    # past what was ever stored: nothing published
    assert ask(vault, [*TOKENS, *range(100, 120)]) == LookupResult(56, 80, Miss.NO_RECORD)
    assert ask(vault, list(range(500, 540))) == LookupResult(0, 32, Miss.NO_RECORD)
    # a prompt that shares only the first block: its KV is stored, no state at its end
    assert ask(vault, [*TOKENS[:BS], *range(300, 340)]) == LookupResult(0, 40, Miss.NO_STATE)
    # published at 40, but its state was evicted
    h = vault.hashes(TOKENS)
    state = next(r for r in vault.needed(h, 40) if r.kind.name == "STATE")
    vault.store.delete_many([state.key])
    assert ask(vault, TOKENS[:41]) == LookupResult(16, 40, Miss.EVICTED)
    assert dict(vault.counters.misses) == {"short_prompt": 1, "local_hit": 1, "no_state": 2,
                                           "no_record": 2, "evicted": 1}


def test_another_salt_or_namespace_is_no_record() -> None:
    from prefixvault.keys import ExtraKeys

    vault = filled()
    salted = vault.hashes(TOKENS[:41], ExtraKeys(cache_salt="other"))
    assert vault.lookup_explained(salted, 41).miss is Miss.NO_RECORD
    other = Vault(vault.store, layout(), "elsewhere")
    assert ask(other, TOKENS[:41]).miss is Miss.NO_RECORD


class DownStore(MemoryStore):
    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        raise StoreUnavailable("down")


def test_a_store_error_is_a_miss_with_its_reason_logged(caplog: pytest.LogCaptureFixture) -> None:
    vault = Vault(DownStore(), layout())
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    req = SimpleNamespace(request_id="r1", prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None)
    assert ask_side(side, req, 0) == (0, False)
    assert vault.counters.misses == {"store_error": 1}


class BuggyStore(MemoryStore):
    """A store that answers with a wrong number of results: the vault's own code then fails
    (an error of ours, not a store that is down)."""

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        return []


def test_an_error_of_ours_is_an_internal_error_miss_not_a_store_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32: an error of ours on the lookup thread was counted as ``store_error``."""
    vault = Vault(BuggyStore(), layout())
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    req = SimpleNamespace(request_id="r1", prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None)
    with caplog.at_level(logging.ERROR, logger="vllm.prefixvault"):
        assert ask_side(side, req, 0) == (0, False)
    assert vault.counters.misses == {"internal_error": 1}
    assert side.guard.errors["lookup"] == 1 and "Traceback" in caplog.text


def test_the_scheduler_logs_each_miss_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    vault = filled()
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    req = SimpleNamespace(request_id="r2", prompt_token_ids=[*TOKENS[:48], 999], num_tokens=49,
                          cache_salt=None, lora_request=None, mm_features=None)
    with caplog.at_level(logging.DEBUG, logger="vllm.prefixvault"):
        assert ask_side(side, req, 0) == (40, True)
    assert "request r2 restores 40 of 48 block-aligned prompt tokens: no_state" in caplog.text


def test_an_open_breaker_is_its_own_reason_and_logs_nothing_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prefixvault.stores.breaker import BreakerPolicy, BreakerStore

    down = DownStore()
    store = BreakerStore("memory://down", lambda uri: down, down, policy=BreakerPolicy(failures=1))
    vault = Vault(store, layout())
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    with caplog.at_level(logging.WARNING, logger="vllm.prefixvault"):
        for i in range(5):
            req = SimpleNamespace(request_id=f"b{i}", prompt_token_ids=TOKENS[:41], num_tokens=41,
                                  cache_salt=None, lora_request=None, mm_features=None)
            assert ask_side(side, req, 0) == (0, False)
    assert vault.counters.misses == {"store_error": 1, "breaker_open": 4}
    # one warning for the failed lookup, one for the breaker opening; none per refused request
    assert len(caplog.records) == 2, caplog.text


class SlowStore(MemoryStore):
    """A store whose every existence check takes ``delay`` seconds (a stalled network store);
    ``calls`` logs each check: when it returned, and how many keys it asked."""

    remote = True

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.calls: list[tuple[float, int]] = []

    def touch_many(self, keys: Sequence[str], touch: Sequence[bool] | None = None) -> list[bool]:
        import time

        time.sleep(self.delay)
        found = super().touch_many(keys, touch)
        self.calls.append((time.monotonic(), len(keys)))
        return found


def slow_and_filled(delay: float) -> Vault:
    """A vault over a ``SlowStore`` holding boundaries 16 and 40 of ``TOKENS``, written fast;
    from then on every round trip takes ``delay`` (``calls`` logs only those)."""
    slow = SlowStore(0.0)
    vault = Vault(slow, layout())
    fill(vault, TOKENS, [16, 40])
    slow.calls.clear()
    slow.delay = delay
    return vault


def test_a_slow_lookup_never_holds_the_scheduler_and_answers_later() -> None:
    import time

    slow_vault = slow_and_filled(0.2)  # from now on, every round trip takes 0.2 s
    side = SchedulerSide(ConnectorSettings(), slow_vault.layout, slow_vault, load=True, save=False)
    req = SimpleNamespace(request_id="s1", prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None)
    t0 = time.monotonic()
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # undetermined: asked next step
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert time.monotonic() - t0 < 0.1, "the scheduler waited for the store"
    assert ask_side(side, req) == (40, True)


def test_a_hit_over_a_slow_store_is_answered_after_one_round_trip() -> None:
    """The lookup thread hands the answer over after the first round trip, and touches what
    the hit uses after it (before its next batch)."""
    import time

    vault = slow_and_filled(0.3)
    slow = vault.store
    assert isinstance(slow, SlowStore)
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    req = SimpleNamespace(request_id="o1", prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None)
    t0 = time.monotonic()
    assert ask_side(side, req) == (40, True)
    assert time.monotonic() - t0 < 0.5, "the answer waited for a second round trip"
    deadline = time.monotonic() + 5
    while len(slow.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(slow.calls) == 2  # then the touch
    side.close()


def test_a_lookup_past_its_timeout_is_a_miss() -> None:
    import time

    slow_vault = Vault(SlowStore(0.5), layout())
    side = SchedulerSide(ConnectorSettings(lookup_timeout=0.1), slow_vault.layout, slow_vault, load=True,
                         save=False)
    req = SimpleNamespace(request_id="s2", prompt_token_ids=TOKENS[:41], num_tokens=41, cache_salt=None,
                          lora_request=None, mm_features=None)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.15)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert slow_vault.counters.misses["lookup_timeout"] == 1
    side.close()


def test_lookups_that_arrive_together_share_round_trips() -> None:
    """Over a slow store, requests that arrive while a lookup runs are looked up together:
    two round trips for all of them, not two each."""
    vault = slow_and_filled(0.1)
    slow = vault.store
    assert isinstance(slow, SlowStore)
    side = SchedulerSide(ConnectorSettings(), vault.layout, vault, load=True, save=False)
    reqs = [SimpleNamespace(request_id=f"b{i}", prompt_token_ids=[*TOKENS[: 41 + i], 900 + i],
                            num_tokens=42 + i, cache_salt=None, lora_request=None, mm_features=None)
            for i in range(5)]
    for r in reqs:  # one step: the first lookup starts, the other four queue behind it
        assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert [ask_side(side, r) for r in reqs] == [(40, True)] * 5
    assert len(slow.calls) <= 4, slow.calls  # the first alone (or not), then the queued ones together: not 10
    assert vault.counters.lookup_asks == 5
    side.close()
