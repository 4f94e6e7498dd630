"""Serve reads every role's live figures from the rendezvous store (afd_mrv2.serve.figures.FiguresReader)."""

from __future__ import annotations

from afd_mrv2.live_stats import FfnFigures
from tests.serve.figures_support import new_store, publish, raw_set, read_back

FFN = FfnFigures(items=3, computed=3, tokens=5, busy_s=0.5, redispatched=0, up_s=2.0, memory=None)


def test_the_reader_keeps_each_ranks_latest_record_and_says_once_which_it_refused() -> None:
    store = new_store()
    publish(store, "ffn", 0, FFN)
    raw_set(store, "attention", 1, {"schema": 99, "at": 1.0, "pid": 7})  # another afd-mrv2's engine
    said: list[str] = []
    ranks = [("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1)]
    reader = read_back(store, ranks, said)
    assert list(reader.figures()) == [("ffn", 0)] and reader.figures()[("ffn", 0)].figures == FFN
    assert said == ["live figures left out: attention 1.schema: 99, accepted: 2 (another afd-mrv2?)"]
    again = read_back(store, ranks, said)  # a second reader, a second look: said once per reader
    assert len(said) == 2 and list(again.figures()) == [("ffn", 0)]


def test_a_rank_that_publishes_again_is_shown_with_its_new_record() -> None:
    store = new_store()
    publish(store, "ffn", 0, FFN)
    first = read_back(store, [("ffn", 0)]).figures()[("ffn", 0)]
    later = FfnFigures(items=9, computed=9, tokens=20, busy_s=1.0, redispatched=1, up_s=3.0, memory=None)
    publish(store, "ffn", 0, later)
    second = read_back(store, [("ffn", 0)]).figures()[("ffn", 0)]
    assert first.figures == FFN and second.figures == later and second.at >= first.at
