"""The AFD rendezvous store serve hosts itself (``afd.rendezvous: external``), so that it outlives every role.

Every role connects to it as a client (:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`); serve writes two things there:
a lost role's latest incarnation (an engine that starts meanwhile does not wait for it) and, when it
stops, the stop key (the FFN ranks then end their sessions once their engines are gone).  torch is
imported only when serve hosts a store (with the real roles), never for a plan with another
rendezvous.  Writes are best effort: a store that stops answering changes nothing serve does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from afd_mrv2.errors import AfdError

if TYPE_CHECKING:
    from afd_mrv2.mrv2.transport.store import RendezvousStore


class RendezvousHost:
    """The store on ``afd.host:afd.port`` when the ``afd`` section says ``rendezvous: external``; else nothing."""

    def __init__(self, afd: Mapping[str, Any], default_host: str) -> None:
        self.store: RendezvousStore | None = None
        self._where = (
            (str(afd.get("host", default_host)), int(afd["port"])) if afd.get("rendezvous") == "external" else None
        )

    def start(self) -> None:
        """Host the store; :class:`AfdError` in one line when its port cannot be bound."""
        if self._where is None:
            return
        from afd_mrv2.mrv2.transport.store import RendezvousStore  # imports torch: only when serving for real

        host, port = self._where
        try:
            self.store = RendezvousStore.connect(host, port, master=True, timeout_s=30.0)
        except (RuntimeError, OSError) as exc:
            raise AfdError(
                f"cannot host the AFD rendezvous store on {host}:{port}: {str(exc).splitlines()[0]}"
            ) from None

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
