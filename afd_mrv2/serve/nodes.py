"""Which node runs which role rank, and the addresses a node binds, for a serve over several machines.

``afd-mrv2 serve --nnodes N --node-rank K --master-addr ADDR [--master-port P] [--node-addr ADDR]
[--layout a0=0,f1=1,...]`` is the same command on every node.  Node 0 hosts the rendezvous store (on
``ADDR:P``) and the endpoint; every node starts its own share of the roles (:class:`Layout`), binds them to
its address, and joins through the store (:mod:`afd_mrv2.serve.agent`, :mod:`afd_mrv2.serve.remote`).
One node (the default) is today's single-host serve on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.ports import HOST, route_address

_LETTER = {"a": ATTENTION, "f": FFN}


@dataclass(frozen=True)
class Layout:
    """The node of every role rank: ``nodes[role][rank]``."""

    nodes: Mapping[str, tuple[int, ...]]

    @classmethod
    def spread(cls, attention: int, ffn: int, nnodes: int, override: str | None = None) -> Layout:
        """Each role's ranks in contiguous blocks over the nodes (rank r of C on node ``r * N // C``), then
        ``override`` (``a0=0,f1=1``: role letter, rank, ``=``, node) over that; every node must run a role."""
        nodes = {
            ATTENTION: [r * nnodes // attention for r in range(attention)],
            FFN: [r * nnodes // ffn for r in range(ffn)],
        }
        counts = {ATTENTION: attention, FFN: ffn}
        for item in (override or "").replace(" ", "").split(","):
            if not item:
                continue
            name, _, node = item.partition("=")
            role = _LETTER.get(name[:1])
            if role is None or not name[1:].isdigit() or not node.isdigit():
                raise AfdError(f"--layout: {item!r} is not ROLE-RANK=NODE (a0=0, f1=1: a for Attention, f for FFN)")
            rank = int(name[1:])
            if rank >= counts[role] or int(node) >= nnodes:
                raise AfdError(f"--layout: {item!r} names no {role} rank below {counts[role]} or node below {nnodes}")
            nodes[role][rank] = int(node)
        idle = sorted(set(range(nnodes)) - set(nodes[ATTENTION]) - set(nodes[FFN]))
        if idle:
            raise AfdError(
                f"node(s) {', '.join(map(str, idle))} would run no role ({attention} Attention and {ffn} FFN ranks "
                f"over {nnodes} nodes): give those nodes a rank with --layout, or use fewer nodes"
            )
        return cls({role: tuple(ranks) for role, ranks in nodes.items()})

    def node_of(self, role: str, rank: int) -> int:
        return self.nodes[role][rank]

    def describe(self) -> list[str]:
        """One line per node: ``node 1: attention 1, ffn 1``."""
        count = max(max(ranks) for ranks in self.nodes.values()) + 1
        lines = []
        for node in range(count):
            names = [f"{role} {r}" for role in (ATTENTION, FFN) for r, n in enumerate(self.nodes[role]) if n == node]
            lines.append(f"node {node}: {', '.join(names)}")
        return lines


@dataclass(frozen=True)
class NodeOptions:
    """Where this node stands in the deployment (``--nnodes`` and its companions)."""

    nnodes: int = 1
    node_rank: int = 0
    #: node 0's address: where the rendezvous store listens (None on one node: 127.0.0.1)
    master_addr: str | None = None
    #: the store's port (None: serve's own default, the port after the Attention engines')
    master_port: int | None = None
    #: this node's address, which its roles bind and advertise (None: the route to ``master_addr``)
    node_addr: str | None = None
    #: ``--layout``: role ranks moved to other nodes than the default spread
    layout: str | None = None

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    def check(self) -> None:
        """One line for a bad combination, before anything starts."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise AfdError(
                f"--node-rank must lie in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}"
            )
        if self.multi and not self.master_addr:
            raise AfdError("--nnodes > 1 needs --master-addr: node 0's address, where the rendezvous store listens")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise AfdError(f"--master-port must lie in 1..65535, got {self.master_port}")
        if self.multi and self.master_addr in ("127.0.0.1", "localhost", "::1"):
            raise AfdError(f"--master-addr {self.master_addr} is a loopback address: give node 0's network address")

    def store_host(self) -> str:
        return self.master_addr or HOST

    def address(self, store_port: int) -> str:
        """The address this node's roles bind: ``--node-addr``, else the route to the store, else loopback."""
        if self.node_addr:
            return self.node_addr
        if not self.master_addr:
            return HOST
        return route_address(self.master_addr, store_port)
