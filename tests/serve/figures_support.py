"""The live figures' way from a role to serve, as in a deployment: each role's FiguresPublisher into the
rendezvous store (torch's HashStore here), serve's FiguresReader out of it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch.distributed as dist

from afd_mrv2.live_stats import Figures, FiguresPublisher, Written, encode
from afd_mrv2.mrv2.transport.store import RendezvousStore
from afd_mrv2.serve.figures import FiguresReader
from afd_mrv2.serve.rendezvous import RendezvousHost


def host_on(store: RendezvousStore) -> RendezvousHost:
    """A RendezvousHost whose store is ``store`` (serve's, without hosting one on a port)."""
    host = RendezvousHost({}, "127.0.0.1")
    host.store = store
    return host


def publish(store: RendezvousStore, role: str, rank: int, figures: Figures) -> FiguresPublisher:
    """``figures`` published once by a role's publisher, as its thread does every second."""

    def to_store(written: Written) -> None:
        store.publish_live(role, rank, encode(written))

    publisher = FiguresPublisher(role, to_store, lambda: figures)
    publisher.publish_now()
    return publisher


def read_back(store: RendezvousStore, ranks: list[tuple[str, int]], said: list[str] | None = None) -> FiguresReader:
    """A FiguresReader over ``ranks`` after one look at ``store`` (what it says goes to ``said``)."""
    reader = FiguresReader(host_on(store), ranks, (said if said is not None else []).append)

    async def one_look() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(reader.run(), 0.3)

    asyncio.run(one_look())
    return reader


def new_store() -> RendezvousStore:
    return RendezvousStore(dist.HashStore())


def raw_set(store: RendezvousStore, role: str, rank: int, doc: Any) -> None:
    """A document written as a role would, whatever it holds (a role of another afd-mrv2, say)."""
    store.publish_live(role, rank, doc)
