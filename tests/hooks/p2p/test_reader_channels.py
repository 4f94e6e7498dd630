"""What the zmq and tcp channels share (ReaderChannel, afd_mrv2/hooks/p2p/reading.py): receives matched per
tag in posting order, a message read past kept and copied in when its receive is posted, tags interleaved in
both directions.  Each test runs on a real loopback pair of each kind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from afd_mrv2.hooks.p2p.channel import Channel
from tests.hooks.p2p.channel_links import LOOPBACK, recv, send, value, wait


@pytest.fixture(params=sorted(LOOPBACK))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Channel, Channel]]:
    a, f = LOOPBACK[request.param](name="a0.1-f0.1")
    yield a, f
    a.close()
    f.close()


def test_receives_of_a_tag_match_sends_in_posting_order(pair: tuple[Channel, Channel]) -> None:
    a, f = pair
    early = [recv(f, 7) for _ in range(2)]  # posted before the messages: read straight into them
    for v in (1.0, 2.0, 3.0, 4.0):
        send(a, 7, v)
    late = [recv(f, 7) for _ in range(2)]
    assert [value(wait(f, p)) for p in early + late] == [1.0, 2.0, 3.0, 4.0]


def test_a_message_read_past_is_kept_and_copied_in_when_its_receive_is_posted(pair: tuple[Channel, Channel]) -> None:
    a, f = pair
    send(a, 1, 10.0)
    send(a, 2, 20.0)
    assert value(wait(f, recv(f, 2))) == 20.0  # its waiter read the tag-1 message past
    kept = recv(f, 1)
    assert kept.done.is_set()  # done at posting, nobody read
    assert value(kept) == 10.0 and kept.done_at > 0


def test_several_tags_interleaved(pair: tuple[Channel, Channel]) -> None:
    a, f = pair
    for i in range(5):
        for tag in (3, 1, 2):
            send(a, tag, tag * 100 + i)
    posted = {tag: [recv(f, tag) for _ in range(5)] for tag in (2, 3, 1)}
    for tag in (1, 3, 2):
        assert [value(wait(f, p)) for p in posted[tag]] == [tag * 100 + i for i in range(5)]
    back = recv(a, 5)  # and back the other way, interleaved with the first direction
    send(f, 5, 1.5)
    assert value(wait(a, back)) == 1.5
