"""The AFD rendezvous store as serve uses it: hosted by node 0 (``afd.rendezvous: external``), joined by the others.

Every role connects to it as a client (:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`); serve writes
there a lost role's latest incarnation (an engine that starts meanwhile does not wait for it), the stop key
(the FFN ranks then end their sessions once their engines are gone) and, over several nodes, each node's
heartbeat, roles and figures (:mod:`afd_mrv2.serve.agent`, :mod:`afd_mrv2.serve.remote`).  torch is imported
only when serve hosts or joins a store (with the real roles), never for a plan with another rendezvous.
Writes are best effort: a store that stops answering changes nothing serve does, but :meth:`call` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from afd_mrv2.errors import AfdError

if TYPE_CHECKING:
    from afd_mrv2.mrv2.transport.store import RendezvousStore

T = TypeVar("T")
#: The longest one store call may take before the store counts as silent for it.
CALL_TIMEOUT_S = 2.0


class RendezvousHost:
    """The store on ``afd.host:afd.port`` when the ``afd`` section says ``rendezvous: external``; else nothing.
    ``master``: host it (node 0); else connect to it, waiting up to ``connect_timeout_s`` for node 0.  ``secret``:
    the deployment's (the store's MACs); None: ``$AFD_MRV2_SECRET`` where set.  A store call blocked by a cut
    link runs on a daemon thread of its own, left to end: nothing to close."""

    def __init__(
        self,
        afd: Mapping[str, Any],
        default_host: str,
        *,
        master: bool = True,
        connect_timeout_s: float = 30.0,
        secret: bytes | None = None,
    ) -> None:
        self.store: RendezvousStore | None = None
        self.master = master
        self.secret = secret
        self.connect_timeout_s = connect_timeout_s
        self._where = (
            (str(afd.get("host", default_host)), int(afd["port"])) if afd.get("rendezvous") == "external" else None
        )
        #: why the last store call failed, when it raised (a closed connection: the store's host is gone)
        self.error: str | None = None

    @property
    def where(self) -> str:
        return f"{self._where[0]}:{self._where[1]}" if self._where is not None else "nowhere"

    def start(self) -> None:
        """Host (or join) the store; :class:`AfdError` in one line when its port cannot be bound (reached)."""
        if self._where is None:
            return
        from afd_mrv2.mrv2.transport.store import RendezvousStore  # imports torch: only when serving for real

        host, port = self._where
        try:
            self.store = RendezvousStore.connect(
                host, port, master=self.master, timeout_s=self.connect_timeout_s, secret=self.secret
            )
        except (RuntimeError, OSError) as exc:
            verb = "host" if self.master else "reach"
            raise AfdError(
                f"cannot {verb} the AFD rendezvous store on {host}:{port}: {str(exc).splitlines()[0]}"
            ) from None

    async def call(self, fn: Callable[[RendezvousStore], T], timeout_s: float = CALL_TIMEOUT_S) -> T | None:
        """``fn(store)`` on a thread of its own; None when there is no store, or it raised or took longer
        than ``timeout_s`` (a store that does not answer: node 0 gone, or the link to it cut)."""
        store = self.store
        if store is None:
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(store)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        # a daemon thread per call: one blocked by a cut link neither holds the others nor keeps serve from exiting
        threading.Thread(target=run, name="afd-serve-store", daemon=True).start()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except (asyncio.TimeoutError, ValueError):  # no answer in time; a value that is no JSON
            return None
        except (RuntimeError, OSError) as exc:  # torch's store raises these for a closed connection
            self.error = (str(exc).splitlines() or [type(exc).__name__])[0]
            return None

    def take_error(self) -> str | None:
        """Why a store call raised since the last look (None: none did), and forget it."""
        error, self.error = self.error, None
        return error

    def mark_lost(self, role: str, rank: int) -> None:
        """An engine that starts while ``role`` rank ``rank`` is lost (a restarted engine) must not wait for it."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError, OSError):
                self.store.mark_lost(role, rank)

    def stop(self) -> None:
        """Set the store's stop key (the FFN ranks end their sessions once their engines are gone)."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError, OSError):
                self.store.request_stop()


def _settle(future: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    """Hand a store call's outcome to its awaiting side, unless that gave up (timed out) meanwhile."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]
