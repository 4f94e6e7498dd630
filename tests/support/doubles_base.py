"""What every CAM double shares: running an effect on or off the caller's stream, and its OpSet.

A double's operator computes its output shapes from its arguments, allocates
them (NaN / -1 filled) and runs its *effect* (moving data through the fabric,
filling the outputs).  An operator listed in ``foreign`` runs the effect on its
rank's :class:`ForeignWorker` instead of inline: the call returns before the
outputs are written, exactly the hazard of an operator that ignores the
caller's stream.

Each operator's argument list is declared once, in the real operator's order, by
:func:`operator`: the double accepts the arguments positionally (as a connector
calls it) or by the real names (as a test may), and a wrong argument list fails
as a ``TypeError`` naming the operator.

Stage identity (a side channel, not part of the operators' contract): the real
operators' wire format has no stage field, so the doubles do not take one as
an argument either.  Instead every double set carries a :class:`PayloadStageTags`
(``doubles.stage_tags``, also its ``OpSet.stage_tags``), the
:class:`~afd_mrv2.hooks.cam.stage_tags.StageTags` side channel the connectors
stamp before each send operator and take from after each receive operator.  A
send operator claims the identity its rank stamped (at call time, on the
caller's thread) and puts it in the payload metadata of every message it posts
(``payload["stage"]``); a receive operator, when it delivers a message, hands that
identity to the side channel for the receiving rank to take, in delivery order
per (receiver, sender).  A message posted without a stamp carries none (the
probes call the operators directly) and delivers nothing to take.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable
from types import SimpleNamespace
from typing import Any

from afd_mrv2.hooks.cam.evidence import Evidence, StreamBehaviour
from afd_mrv2.hooks.cam.ops import BoundOp, OpCapability, OpSet
from afd_mrv2.items import WorkItem
from tests.support.cam_fabric import Fabric, ForeignWorker, Message


class PayloadStageTags:
    """The doubles' stage-identity side channel: stamped identities ride in the payload metadata.

    Implements :class:`~afd_mrv2.hooks.cam.stage_tags.StageTags` for the
    connectors (``stamp``, ``take``) and gives the doubles' operators the two
    ends of the payload metadata (``claim`` when a send operator is called,
    ``delivered`` when a receive operator delivers a message).
    """

    def __init__(self) -> None:
        self._stamped: dict[int, WorkItem] = {}
        self._delivered: dict[tuple[int, int], deque[WorkItem]] = defaultdict(deque)
        self._lock = threading.Lock()
        self.taken = 0  # identities the connectors took (checked)

    def stamp(self, sender: int, stage: WorkItem) -> None:
        with self._lock:
            self._stamped[sender] = stage

    def claim(self, sender: int) -> WorkItem | None:
        """What ``sender`` stamped for the send operator it is calling now (None: nothing); used once."""
        with self._lock:
            return self._stamped.pop(sender, None)

    def delivered(self, receiver: int, message: Message) -> None:
        """A receive operator of ``receiver`` delivered ``message``: its identity, if any, can be taken."""
        stage = message.payload.get("stage")
        if stage is not None:
            with self._lock:
                self._delivered[(receiver, message.src)].append(stage)

    def take(self, receiver: int, sender: int) -> WorkItem | None:
        with self._lock:
            queue = self._delivered.get((receiver, sender))
            if not queue:
                return None
            self.taken += 1
            return queue.popleft()

    def pending(self) -> int:
        """Identities delivered and not taken (0 after a run whose receivers checked every transfer)."""
        with self._lock:
            return sum(len(q) for q in self._delivered.values())


def operator(*names: str) -> Callable[[Callable[[Any, SimpleNamespace], Any]], Callable[..., Any]]:
    """Declare a double's arguments (``names``, the real operator's order); the body receives them as one namespace."""
    signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])

    def declare(body: Callable[[Any, SimpleNamespace], Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{body.__name__} double: {exc} (arguments: {', '.join(names)})") from None
            return body(self, SimpleNamespace(**bound.arguments))

        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        call.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])  # type: ignore[attr-defined]
        return call

    return declare


class CamDoubles:
    """Base of the operator doubles; subclasses define ``NAMESPACE``, ``OPS`` and the operators."""

    NAMESPACE = ""
    OPS: tuple[str, ...] = ()

    def __init__(self, fabric: Fabric, *, foreign: Iterable[str] = (), lag_s: float = 0.02) -> None:
        self.fabric = fabric
        self.foreign = frozenset(foreign)
        unknown = self.foreign - set(self.OPS)
        if unknown:
            raise ValueError(f"unknown operators for {self.NAMESPACE}: {sorted(unknown)}")
        self.lag_s = lag_s
        #: the stage-identity side channel (see the module docstring)
        self.stage_tags = PayloadStageTags()
        self._workers: dict[Hashable, ForeignWorker] = {}
        self._worker_lock = threading.Lock()

    def worker(self, rank: Hashable) -> ForeignWorker:
        """World rank ``rank``'s own stream (one per rank, like a device's default stream)."""
        with self._worker_lock:
            if rank not in self._workers:
                self._workers[rank] = ForeignWorker(f"{self.NAMESPACE}-rank{rank}", self.lag_s)
            return self._workers[rank]

    def _run(self, op: str, rank: Hashable, effect: Callable[[], None]) -> None:
        if op in self.foreign:
            self.worker(rank).submit(effect)
        else:
            effect()

    def _post(self, *, channel: tuple, src: int, dst: int, tag: tuple, payload: dict[str, Any]) -> None:
        """Post on the fabric, FIFO per (channel, source, destination, tag): what the real transport orders."""
        self.fabric.post(channel=channel, src=src, dst=dst, tag=tag, payload=payload, fifo=(*channel, src, dst, *tag))

    def opset(self, rank: int, evidence: Evidence | None) -> OpSet:
        """The OpSet a connector on world rank ``rank`` uses; stream behaviour comes only from ``evidence``."""
        ops = {}
        for name in self.OPS:
            qualname = f"{self.NAMESPACE}.{name}"
            entry = evidence.get(qualname) if evidence is not None else None
            stream = entry.stream if entry is not None else StreamBehaviour.UNVERIFIED
            basis = f"probe of the test double: {entry.detail}" if entry is not None else "not probed"
            fn: Callable[..., Any] = getattr(self, name)
            home = self.worker(rank) if stream is StreamBehaviour.FOREIGN else None
            ops[name] = BoundOp(OpCapability(qualname, True, stream, basis), fn, home)
        return OpSet(f"test double {type(self).__module__}.{type(self).__name__}", ops, self.stage_tags)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
