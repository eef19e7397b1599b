"""``bench/conversations.py``'s pure parts, without engines: sessions are the seed's alone and
within their stated lengths, the templates keep or drop the previous answers, and the tokens a
turn recomputes count only what the previous turn ran through the model."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conversations_bench", ROOT / "bench" / "conversations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


conv = _bench()


def test_sessions_are_the_seeds_alone_and_within_their_lengths() -> None:
    sessions = conv.plan(8, 6, seed=3)
    assert sessions == conv.plan(8, 6, seed=3)
    assert sessions != conv.plan(8, 6, seed=4)
    assert conv.plan(3, 6, seed=3) == sessions[:3]  # a session does not depend on how many there are
    for s in sessions:
        assert len(s.turns) == 6
        assert conv.SYSTEM[0] <= s.system <= conv.SYSTEM[1]
        for t in s.turns:
            assert conv.MESSAGE[0] <= t.message <= conv.MESSAGE[1]
            assert conv.ANSWER[0] <= t.answer <= conv.ANSWER[1]


def test_texts_reach_their_token_counts_and_differ_by_template() -> None:
    (session,) = conv.plan(1, 3, seed=0)
    cost = {w: 1 + len(w) // 4 for w in conv.WORDS}.__getitem__
    keep = conv.texts(session, "keep", 0, 0, cost)
    assert keep == conv.texts(session, "keep", 0, 0, cost)
    drop = conv.texts(session, "drop", 0, 0, cost)
    assert keep.messages != drop.messages
    for t in (keep, drop):
        for text, tokens in ((t.system, session.system), *zip(t.messages, (x.message for x in session.turns),
                                                                strict=True)):
            got = sum(cost(w) for w in text.split())
            assert tokens <= got < tokens + 3  # the last word may overshoot by its own cost
    assert conv.words(random.Random(0), 0, cost) == ""


def test_keep_holds_every_earlier_answer_and_drop_its_reasoning() -> None:
    t = conv.Texts("sys", ("task", "out1", "out2"))
    assert conv.conversation(t, [], "keep") == conv.conversation(t, [], "drop") == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    keep = conv.conversation(t, ["a1", "a2"], "keep")
    assert [(m["role"], m["content"]) for m in keep] == [
        ("system", "sys"), ("user", "task"), ("assistant", "a1"), ("tool", "out1"), ("assistant", "a2"),
        ("tool", "out2")]
    drop = conv.conversation(t, ["a1", "a2"], "drop")
    # the answer's reasoning (all of it) left out; the assistant turn itself stays
    assert [(m["role"], m["content"]) for m in drop] == [
        ("system", "sys"), ("user", "task"), ("assistant", ""), ("tool", "out1"), ("assistant", ""),
        ("tool", "out2")]
    # each turn's messages extend the previous turn's
    assert conv.conversation(t, ["a1"], "keep") == keep[:4]
    assert conv.conversation(t, ["a1"], "drop") == drop[:4]
    with pytest.raises(ValueError):
        conv.conversation(t, [], "other")


def test_recomputed_counts_what_the_previous_turn_ran_less_what_was_restored() -> None:
    prev, answer = [1, 2, 3, 4], [5, 6, 7]
    kept = [*prev, *answer, 8, 9]  # the answer kept as generated
    # ran: the prompt and the answer but its last token (sampled, never run)
    assert conv.recomputed(kept, prev, answer, cached=0) == 6
    assert conv.recomputed(kept, prev, answer, cached=4) == 2  # restored to the previous prompt's end
    assert conv.recomputed(kept, prev, answer, cached=8) == 0  # restored past it: never below 0
    dropped = [*prev, 8, 9]
    assert conv.recomputed(dropped, prev, answer, cached=4) == 0
    assert conv.recomputed(dropped, prev, answer, cached=2) == 2  # a block boundary short of the end
    retokenized = [*prev, 5, 60, 7, 8]  # the answer's text tokenized otherwise: shared up to 5
    assert conv.recomputed(retokenized, prev, answer, cached=4) == 1
    assert conv.recomputed([9, *prev], prev, answer, cached=0) == 0  # nothing shared


def test_max_model_len_holds_every_session_in_whole_blocks() -> None:
    sessions = conv.plan(8, 6, seed=0)
    n = conv.max_model_len(sessions, 256)
    assert n % 256 == 0 and n >= 4096
    assert all(s.system + sum(t.message + 2 * t.answer for t in s.turns) < n for s in sessions)
