"""The FFN role's engine ends with its role process: :data:`LEADER_KEY`, :func:`watch_role_leader`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.ffn.leader".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from afd_mrv2.admission import LEADER_KEY, own_keys
from afd_mrv2.procs import alive


def leader_alive(pid: int) -> bool:
    """False once ``pid`` exited (a zombie, not yet reaped, counts as exited)."""
    return alive(pid)


class LeaderWatch:
    """A daemon thread that calls ``on_gone()`` once ``pid`` has exited, unless stopped first."""

    def __init__(
        self,
        pid: int,
        on_gone: Callable[[], None],
        *,
        interval_s: float = 0.5,
        alive: Callable[[int], bool] = leader_alive,
    ) -> None:
        self._stopped = threading.Event()

        def watch() -> None:
            while alive(pid):
                if self._stopped.wait(interval_s):
                    return
            if not self._stopped.is_set():
                on_gone()

        self.thread = threading.Thread(target=watch, name=f"afd-ffn-leader-{pid}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """The session ended on its own: the leader's normal exit must not end anything."""
        self._stopped.set()


def watch_leader(
    pid: int, on_gone: Callable[[], None], *, interval_s: float = 0.5, alive: Callable[[int], bool] = leader_alive
) -> LeaderWatch:
    return LeaderWatch(pid, on_gone, interval_s=interval_s, alive=alive)


def end_with_leader(pid: int) -> None:
    """What the serving worker does when the leader ``pid`` is gone: say so, end the role's processes."""
    sys.stderr.flush()
    os.write(2, f"afd-mrv2 ffn: the FFN role process (pid {pid}) is gone: ending its engine\n".encode())
    if os.getpgid(0) == pid:  # the leader's own group: its EngineCore and workers, this process included
        os.killpg(pid, signal.SIGKILL)
    os._exit(1)


def leader_pid(additional_config: Mapping[str, Any] | None) -> int | None:
    """The FFN role process's pid among the engine's own keys (its ``additional_config``, or
    ``$AFD_MRV2_ADDITIONAL_CONFIG``: :func:`afd_mrv2.admission.own_keys`), or None (not started by ffn_role)."""
    value = own_keys(additional_config).get(LEADER_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def watch_role_leader(pid: int | None) -> LeaderWatch | None:
    """In the serving worker: end with the FFN role process ``pid`` (None: nothing to watch)."""
    if pid is None:
        return None
    return watch_leader(pid, lambda: end_with_leader(pid))
