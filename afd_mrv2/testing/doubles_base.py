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
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Hashable, Iterable
from types import SimpleNamespace
from typing import Any

from afd_mrv2.hooks.cam.evidence import Evidence, StreamBehaviour
from afd_mrv2.hooks.cam.ops import BoundOp, OpCapability, OpSet
from afd_mrv2.testing.cam_fabric import Fabric, ForeignWorker


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
        return OpSet(f"test double {type(self).__module__}.{type(self).__name__}", ops)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
