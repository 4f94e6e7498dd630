#!/usr/bin/env python3
"""Round trips through torch_p2p's own hooks against a plain TCP socket, in one run (issue 27, RFC 0007 section 7).

    .venv/bin/python scripts/bench_transport.py [--transport gloo] [--sizes 16,64,256] [--iters 2000]
        [--warmup 200] [--cores A,F] [--json OUT]

Two processes, an Attention side and an FFN side, each pinned to one core (``--cores``; default the first two
cores this process may run on).  For each size N in ``--sizes`` (KiB), ``--warmup`` untimed then ``--iters``
timed round trips of:

* socket: a plain TCP socket over loopback, ``sendall`` N bytes, the other side ``recv_into`` a preallocated
  buffer and sends N back;
* hooks: torch_p2p's phase hooks called in a loop on one pair of ``--transport`` (today gloo, joined through
  :meth:`RendezvousStore.join_pair` as the roles join it): a ``RoundTripAttentionSide`` (``on_recv``,
  ``on_compute``, ``on_send``, then the combine's ``wait``) and an ``FfnSide`` (``on_recv``, ``on_compute`` with
  an identity compute, ``on_send``), hidden size 254 and top-k 1, so that N / 1 KiB tokens make a dispatch
  payload of exactly N bytes (the combine back is N - 8 per token + the header).  No executor: its stream hops
  are not in the figures.

Prints per size the p50, mean and p99 (us) of both and the ratio hooks / socket at p50 and at mean; then the
medians (us) of the spans of a hooks round trip (RFC 0007 section 4), from ``time.perf_counter`` stamps (one
clock for both processes of a host) taken around the hook calls and in wrappers of the link's ``isend`` /
``irecv`` / ``wait`` (a few tenths of a us each; no product code changed).  The spans follow each other, so per
round trip they add up to it:

    take         Attention on_recv (the routed tensors from the source, checked)   [not in RFC section 4]
    pack         Attention on_compute (compute, checks, _pack)
    post         pack's end -> the dispatch's first isend (the combine's irecv is   [not in RFC section 4]
                 posted first)
    wire out     that isend -> the FFN's dispatch payload Pending done_at
    FFN wake-up  that done_at -> the FFN's compute is called
    FFN compute  the identity compute
    FFN pack     compute's return -> the combine's isend in on_send                [not in RFC section 4]
    wire back    that isend -> the Attention's combine Pending done_at
    A wake-up    that done_at -> link.wait returns in CombineInFlight.wait
    unpack       that return -> CombineInFlight.wait returns

On gloo a Pending's ``done_at`` is when its watcher thread's ``wait()`` returned, so a wire span includes gloo's
own thread and the watcher's wake-up, and a wake-up span is the hop from the watcher to the waiting thread.
Exit 0 after a run, 1 when a side failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import ServerError, UsageError, guarded, load_average, parse_cpu_list, write_json

from afd_mrv2.config import TRANSPORTS as PAIR_TRANSPORTS
from afd_mrv2.table import format_table

PROG = "bench_transport"
PEER_FLAG = "--peer"  # the two sides' own entry: bench_transport.py --peer SPEC_JSON
HIDDEN_SIZE = 254  # with top-k 1 a dispatch row is 254 * 4 + 8 = 1024 bytes
TOP_K = 1
NUM_EXPERTS = 2
#: the spans of a hooks round trip, in order (see the module docstring); they add up to the round trip
SPANS = (
    "take",
    "pack",
    "post",
    "wire out",
    "FFN wake-up",
    "FFN compute",
    "FFN pack",
    "wire back",
    "A wake-up",
    "unpack",
)
START_TIMEOUT_S = 120.0  # imports, pinning, the socket and the pair's handshake
PER_ROUND_TRIP_S = 0.05  # what a slow round trip may take before the run is called stuck


# --------------------------------------------------------------------------------------------- transports


@dataclass(frozen=True)
class Transport:
    """How the two sides open their link: ``open(role, store, topology) -> PeerLink`` (run in the sides)."""

    name: str
    open: Callable[[str, Any, Any], Any]


def _open_pair(role: str, store: Any, topology: Any) -> Any:
    """The link of a role on one pair of the store's transport, as the roles open it (``open_attention_link``; the FFN server's
    register, ``join_pair``, ``PeerLink`` on the pair)."""
    from afd_mrv2.hooks.p2p import PeerLink
    from afd_mrv2.items import ATTENTION, FFN
    from afd_mrv2.mrv2.transport.pairs import open_attention_link

    if role == ATTENTION:
        return open_attention_link(store, topology, 0, connect_timeout_s=START_TIMEOUT_S)[0]
    incarnation = store.register(FFN, 0)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.latest(ATTENTION, 0):
        if time.monotonic() > deadline:
            raise TimeoutError("the Attention side did not register")
        time.sleep(0.01)
    stamp = topology.placement.stamp
    pair = store.join_pair(FFN, (0, store.latest(ATTENTION, 0)), (0, incarnation), placement=stamp)
    return PeerLink(topology, topology.global_rank(FFN, 0), pairs={topology.global_rank(ATTENTION, 0): pair})


#: name -> transport (``afd.transport``: RFC 0007 decision 1)
TRANSPORTS = {name: Transport(name, _open_pair) for name in PAIR_TRANSPORTS}


# --------------------------------------------------------------------------------------------- input


def parse_sizes(text: str) -> list[int]:
    """``16,64,256`` -> KiB sizes, each a positive integer."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--sizes: expected positive whole KiB such as 16,64,256, got {text!r}")
    return sizes


def pick_cores(text: str | None) -> list[int]:
    """The two cores (Attention side, FFN side): ``--cores``, else the first two this process may run on."""
    if text is None:
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            raise UsageError(f"needs two cores to pin its two processes to, this process may run on {available}")
        return available[:2]
    cores = [int(part) for part in text.split(",") if part.strip().isdigit()]
    if len(cores) != 2 or cores[0] == cores[1]:
        raise UsageError(f"--cores: expected two different cores such as 0,1, got {text!r}")
    parse_cpu_list(text)  # each one this process may run on
    return cores


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--transport", choices=sorted(TRANSPORTS), default="gloo", help="the hooks' link (default %(default)s)"
    )
    parser.add_argument("--sizes", default="16,64,256", help="dispatch sizes in KiB (default %(default)s)")
    parser.add_argument("--iters", type=int, default=2000, help="timed round trips per size and path (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips before them (default 200)")
    parser.add_argument("--cores", metavar="A,F", help="the two sides' cores (default: the first two allowed)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    args.sizes = parse_sizes(args.sizes)
    args.cores = pick_cores(args.cores)
    return args


# --------------------------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start both sides on their cores, collect what they measured, summarize it."""
    listener = socket.create_server(("127.0.0.1", 0))
    round_trips = 2 * len(args.sizes) * (args.iters + args.warmup)
    deadline = time.monotonic() + START_TIMEOUT_S + PER_ROUND_TRIP_S * round_trips
    print(
        f"{PROG}: transport {args.transport}, sizes {','.join(map(str, args.sizes))} KiB, {args.warmup} warm-up + "
        f"{args.iters} timed round trips per size and path, Attention side on core {args.cores[0]}, FFN side on "
        f"core {args.cores[1]}",
        flush=True,
    )
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        common = {
            "transport": args.transport,
            "socket_port": listener.getsockname()[1],
            "sizes": args.sizes,
            "iters": args.iters,
            "warmup": args.warmup,
        }
        sides = {}
        try:
            for role, core in zip(("attention", "ffn"), args.cores, strict=True):
                spec = {**common, "role": role, "core": core, "out": f"{tmp}/{role}.json"}
                sides[role] = _start(spec, listener.fileno(), Path(tmp) / f"{role}.err")
            listener.close()
            for role, proc in sides.items():
                _finish(role, proc, deadline, Path(tmp) / f"{role}.err")
        finally:
            listener.close()
            for proc in sides.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        measured = {role: json.loads(Path(f"{tmp}/{role}.json").read_text()) for role in sides}
    result = summarize(args, measured)
    return result | {
        "torch": measured["attention"]["torch"],
        "load_average": {"start": load_start, "end": load_average()},
    }


def _start(spec: dict[str, Any], listen_fd: int, err: Path) -> subprocess.Popen[bytes]:
    """One side, its stderr into ``err``; the FFN side inherits the listening socket."""
    fds = (listen_fd,) if spec["role"] == "ffn" else ()
    with err.open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, __file__, PEER_FLAG, json.dumps({**spec, "listen_fd": listen_fd})],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            pass_fds=fds,
        )


def _finish(role: str, proc: subprocess.Popen[bytes], deadline: float, err: Path) -> None:
    """Wait for one side; a side that failed or hangs is one line (its last line of stderr)."""
    try:
        code = proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise ServerError(f"the {role} side did not finish in time (stuck?)") from None
    if code != 0:
        lines = [line for line in err.read_text(errors="replace").splitlines() if line.strip()]
        raise ServerError(f"the {role} side exited {code}: {lines[-1] if lines else 'no output'}")


# --------------------------------------------------------------------------------------------- the sides


def peer_main(spec: dict[str, Any]) -> int:
    """One side: pin, connect the socket and open the link, run every size's two ping-pongs, write the stamps."""
    os.sched_setaffinity(0, {spec["core"]})
    import torch

    from afd_mrv2.topology import Topology

    torch.set_num_threads(1)
    role = spec["role"]
    if role == "ffn":
        listener = socket.socket(fileno=spec["listen_fd"])
        listener.settimeout(START_TIMEOUT_S)
        conn, _ = listener.accept()
        listener.close()
    else:
        conn = socket.create_connection(("127.0.0.1", spec["socket_port"]), timeout=START_TIMEOUT_S)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    store = _rendezvous_store(conn, role, spec["transport"])
    topology = Topology(1, 1, NUM_EXPERTS)
    link = TRANSPORTS[spec["transport"]].open(role, store, topology)
    rounds = spec["warmup"] + spec["iters"]
    results = []
    for kib in spec["sizes"]:
        sock = _socket_pingpong(conn, role, kib * 1024, rounds)
        hooks = _attention_hooks(link, kib, rounds) if role == "attention" else _ffn_hooks(link, kib, rounds)
        results.append({"size_kib": kib, "socket": sock[spec["warmup"] :], "hooks": _timed(hooks, spec["warmup"])})
    link.close(timeout_s=30)
    conn.close()
    Path(spec["out"]).write_text(json.dumps({"torch": torch.__version__, "sizes": results}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the pair's gloo threads need no orderly teardown


def _rendezvous_store(conn: socket.socket, role: str, transport: str) -> Any:
    """The pair's rendezvous store: the FFN side hosts it on a free port and tells the other side which;
    pairs joined through it run on ``transport``, bound to loopback."""
    import datetime

    import torch.distributed as dist

    from afd_mrv2.mrv2.transport.store import PairTransport, RendezvousStore

    on = PairTransport(transport, None if transport == "gloo" else "127.0.0.1")
    if role == "ffn":
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
        conn.sendall(store.port.to_bytes(4, "little"))
        return RendezvousStore(store, transport=on)
    port = bytearray(4)
    _recv_exact(conn, memoryview(port))
    port_number = int.from_bytes(port, "little")
    return RendezvousStore.connect("127.0.0.1", port_number, master=False, timeout_s=START_TIMEOUT_S, transport=on)


def _timed(stamps: dict[str, list[float]], warmup: int) -> dict[str, list[float]]:
    return {key: values[warmup:] for key, values in stamps.items()}


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the other side closed the socket")
        got += n


def _socket_pingpong(conn: socket.socket, role: str, nbytes: int, rounds: int) -> list[float]:
    """The Attention side's round trip times (s); the FFN side answers and returns nothing."""
    out, back = bytearray(os.urandom(nbytes)), memoryview(bytearray(nbytes))
    times = []
    for _ in range(rounds):
        if role == "attention":
            start = time.perf_counter()
            conn.sendall(out)
            _recv_exact(conn, back)
            times.append(time.perf_counter() - start)
        else:
            _recv_exact(conn, back)
            conn.sendall(back)
    return times


def _shape(kib: int) -> tuple[Any, Any]:
    from afd_mrv2.hooks.p2p import P2pShape, parse_options

    shape = P2pShape(HIDDEN_SIZE, TOP_K, NUM_EXPERTS, num_layers=1, max_tokens=kib)
    return shape, parse_options({"recv_timeout_s": 60.0})


def _slots() -> tuple[Any, Any, Any]:
    """An input and an output slot (their state is the side's, kept across items) and a cancel event."""
    import threading

    from afd_mrv2.work import INPUT, OUTPUT, BufferSlot

    # the executor's events are not read by the sides: no executor here
    return BufferSlot(INPUT, 0, None, None), BufferSlot(OUTPUT, 0, None, None), threading.Event()  # type: ignore[arg-type]


def _attention_hooks(link: Any, kib: int, rounds: int) -> dict[str, list[float]]:
    """``rounds`` round trips through a RoundTripAttentionSide; its stamps per round trip (s)."""
    import torch

    from afd_mrv2.api import InFlightSink
    from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
    from afd_mrv2.items import WorkItem
    from afd_mrv2.work import Work

    shape, options = _shape(kib)
    routed = (torch.randn(kib, HIDDEN_SIZE), torch.zeros(kib, TOP_K, dtype=torch.int64), torch.ones(kib, TOP_K))
    in_flight: list[Any] = []

    class Sink(InFlightSink):
        def __call__(self, item: WorkItem, result: Any) -> None:
            in_flight.append(result)

    side = RoundTripAttentionSide(link, shape, options, source=lambda item: routed, sink=Sink())
    marks: dict[str, float] = {}
    _stamp_link(link, marks, first_send=True, waited=True)
    keys = ("start", "pack0", "pack1", "send0", "combine_done", "waited", "end")
    stamps: dict[str, list[float]] = {key: [] for key in keys}
    inputs, outputs, cancel = _slots()

    def compute(item: WorkItem, value: Any) -> Any:
        return value

    for seq in range(rounds):
        marks.clear()
        work = Work(WorkItem(0, 0, seq), inputs, outputs, cancel)
        start = time.perf_counter()
        side.on_recv(work)
        pack0 = time.perf_counter()
        side.on_compute(work, compute)
        pack1 = time.perf_counter()
        side.on_send(work)
        combined = in_flight.pop().wait()
        end = time.perf_counter()
        side.on_cleanup(work)
        if seq in (0, rounds - 1) and not torch.equal(combined, routed[0]):
            raise RuntimeError(f"round trip {seq}: the combine is not the identity of the dispatch")
        # the last wait is the combine's (CombineInFlight.wait), after on_send's wait for the dispatch
        values = (start, pack0, pack1, marks["send0"], marks["combine_done"], marks["waited"], end)
        for key, value in zip(keys, values, strict=True):
            stamps[key].append(value)
    return stamps


def _ffn_hooks(link: Any, kib: int, rounds: int) -> dict[str, list[float]]:
    """``rounds`` round trips served by an FfnSide with an identity compute; its stamps per round trip (s)."""
    from afd_mrv2.hooks.p2p.ffn import FfnSide
    from afd_mrv2.items import WorkItem
    from afd_mrv2.work import Work

    shape, options = _shape(kib)
    side = FfnSide(link, shape, options, follow_stages=True)  # as the FFN server runs it
    marks: dict[str, float] = {}
    _stamp_link(link, marks, payload=True, combine_send=True)
    keys = ("payload_done", "compute0", "compute1", "combine_send")
    stamps: dict[str, list[float]] = {key: [] for key in keys}
    inputs, outputs, cancel = _slots()

    def compute(item: WorkItem, hidden: Any, ids: Any, weights: Any) -> Any:
        marks["compute0"] = time.perf_counter()
        marks["compute1"] = time.perf_counter()
        return hidden

    for seq in range(rounds):
        marks.clear()
        work = Work(WorkItem(0, 0, seq), inputs, outputs, cancel)
        side.on_recv(work)
        side.on_compute(work, compute)
        side.on_send(work)
        side.on_cleanup(work)
        marks["payload_done"] = marks.pop("payload").done_at  # type: ignore[attr-defined]
        for key in keys:
            stamps[key].append(marks[key])
    return stamps


def _stamp_link(link: Any, marks: dict[str, Any], **wanted: bool) -> None:
    """Wrap this link's isend / irecv / wait (instance attributes, the class untouched) to stamp ``marks``:
    ``first_send`` (before the first isend), ``waited`` (after each wait returns, with ``combine_done``: the
    done_at of the last Pending waited for), ``payload`` (the dispatch payload's Pending), ``combine_send``
    (before the combine's isend)."""
    from afd_mrv2.hooks.p2p import wire

    isend, irecv, wait = link.isend, link.irecv, link.wait

    def stamped_isend(tensor: Any, peer: int, tag: int, what: str) -> Any:
        if wanted.get("first_send") and "send0" not in marks:
            marks["send0"] = time.perf_counter()
        if wanted.get("combine_send") and tag == wire.TAG_COMBINE:
            marks["combine_send"] = time.perf_counter()
        return isend(tensor, peer, tag, what)

    def stamped_irecv(tensor: Any, peer: int, tag: int, what: str) -> Any:
        pending = irecv(tensor, peer, tag, what)
        if wanted.get("payload") and tag == wire.TAG_DISPATCH_PAYLOAD:
            marks["payload"] = pending
        return pending

    def stamped_wait(pendings: Any, **kwargs: Any) -> None:
        wait(pendings, **kwargs)
        if wanted.get("waited"):
            marks["waited"] = time.perf_counter()
            marks["combine_done"] = max(p.done_at for p in pendings)

    link.isend, link.irecv, link.wait = stamped_isend, stamped_irecv, stamped_wait


# --------------------------------------------------------------------------------------------- results


def stats_us(seconds: list[float]) -> dict[str, float]:
    """p50, mean and p99 (nearest rank) of ``seconds``, in us."""
    ordered = sorted(seconds)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return {"p50": statistics.median(ordered) * 1e6, "mean": statistics.fmean(ordered) * 1e6, "p99": p99 * 1e6}


def spans(a: dict[str, list[float]], f: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per round trip, each span of :data:`SPANS` (s), from the two sides' stamps (one clock)."""
    chain = [
        a["start"],
        a["pack0"],
        a["pack1"],
        a["send0"],
        f["payload_done"],
        f["compute0"],
        f["compute1"],
        f["combine_send"],
        a["combine_done"],
        a["waited"],
        a["end"],
    ]
    return {name: [b - e for e, b in zip(chain[i], chain[i + 1], strict=True)] for i, name in enumerate(SPANS)}


def summarize(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for a, f in zip(measured["attention"]["sizes"], measured["ffn"]["sizes"], strict=True):
        hooks = [end - start for start, end in zip(a["hooks"]["start"], a["hooks"]["end"], strict=True)]
        row = {
            "size_kib": a["size_kib"],
            "dispatch_bytes": a["size_kib"] * 1024,
            "combine_bytes": 64 + a["size_kib"] * HIDDEN_SIZE * 4,
            "socket_us": stats_us(a["socket"]),
            "hooks_us": stats_us(hooks),
            "breakdown_median_us": {
                name: statistics.median(values) * 1e6 for name, values in spans(a["hooks"], f["hooks"]).items()
            },
        }
        rows.append(row | {"ratios": ratios(row)})
    return {
        "transport": args.transport,
        "cores": args.cores,
        "iters": args.iters,
        "warmup": args.warmup,
        "sizes_kib": args.sizes,
        "rows": rows,
    }


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """hooks / socket at p50 and at mean."""
    return {stat: row["hooks_us"][stat] / row["socket_us"][stat] for stat in ("p50", "mean")}


def report(result: dict[str, Any]) -> None:
    rows = []
    for row in result["rows"]:
        s, h, r = row["socket_us"], row["hooks_us"], ratios(row)
        rows.append(
            [row["size_kib"], s["p50"], s["mean"], s["p99"], h["p50"], h["mean"], h["p99"], r["p50"], r["mean"]]
        )
    headers = ["KiB", "socket p50", "mean", "p99", "hooks p50", "mean", "p99", "hooks/socket p50", "at mean"]
    print(
        f"round trip (us), transport {result['transport']}, {result['iters']} timed per size and path, "
        f"torch {result.get('torch', '?')}:"
    )
    print(format_table(headers, [[_cell(v) for v in r] for r in rows]))
    breakdown = [
        [row["size_kib"], _cell(row["hooks_us"]["p50"])] + [_cell(row["breakdown_median_us"][name]) for name in SPANS]
        for row in result["rows"]
    ]
    print("a hooks round trip, span medians (us; take, post and FFN pack are outside RFC 0007's seven):")
    print(format_table(["KiB", "round trip", *SPANS], breakdown))
    load = result.get("load_average")
    if load:
        print(f"load average start {load['start']}, end {load['end']}")


def _cell(value: object) -> object:
    return f"{value:.1f}" if isinstance(value, float) else value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [PEER_FLAG]:
        return peer_main(json.loads(argv[1]))

    def body() -> int:
        args = parse_args(argv)
        result = run(args)
        report(result)
        if args.json:
            write_json(args.json, result)
        print(json.dumps({f"{row['size_kib']} KiB": ratios(row) for row in result["rows"]}))
        return 0

    return guarded(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
