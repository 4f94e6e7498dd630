"""The ports serve (and the harness) bind: which are free now, which the kernel may hand out meanwhile, and
the local address a host reaches another from."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

from afd_mrv2.errors import AfdError

HOST = "127.0.0.1"


def ephemeral_ports() -> range:
    """The ports the kernel hands out to sockets bound to port 0 (Linux's
    ``ip_local_port_range``; 32768-60999, Linux's default, elsewhere).  A port in this range
    that is free now can be taken by any process's outgoing or port-0 socket before serve
    binds it: the FFN engines open such sockets while the Attention engines are still to start."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def ports_in_ephemeral_range(ports: Sequence[int]) -> list[int]:
    """Those of ``ports`` the kernel may hand to another socket meanwhile (see :func:`ephemeral_ports`)."""
    eph = ephemeral_ports()
    return [p for p in ports if p in eph]


def free_port_block(n: int, *, tries: int = 200) -> int:
    """A port ``p`` with ``p .. p+n-1`` free on the loopback address now and outside the
    kernel's ephemeral range, so that no port-0 socket of another process takes one before it
    is bound (serve needs ``--port`` and the ports above it; see :func:`build_plan`)."""
    eph = ephemeral_ports()
    low, high = 10000, 65535 - n
    candidates = [b for b in (range(low, eph.start - n + 1), range(eph.stop, high + 1)) if len(b)]
    if not candidates:  # the whole space is ephemeral: the best one can do is free now
        candidates = [range(1024, high + 1)]
    for _ in range(tries):
        base = random.choice(random.choice(candidates))
        try:
            check_ports_free(range(base, base + n))
        except AfdError:
            continue
        return base
    raise AfdError(f"no block of {n} free ports on {HOST} after {tries} tries")


def check_ports_free(ports: Sequence[int], host: str = HOST) -> None:
    """Refuse a port some other process holds on ``host`` (the loopback address by default), or an address
    this host does not have (before anything starts)."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise AfdError(f"port {port} on {host} is not free ({exc.strerror})") from None


def route_address(host: str, port: int) -> str:
    """The local address this host reaches ``host:port`` from (a UDP socket's ``getsockname`` after a
    ``connect``, which sends nothing): ``127.0.0.1`` for a store on loopback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
