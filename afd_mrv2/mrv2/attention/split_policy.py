"""At data parallelism 1, afd-mrv2's policy decides whether an engine step is split into micro-batches.

:class:`SplitPolicy` and :func:`afd_graph_manager_class`.

See docs/internals/micro-batching.md, "afd_mrv2.mrv2.attention.split_policy".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from afd_mrv2.config import UBatchConfig

if TYPE_CHECKING:
    from afd_mrv2.mrv2.upstream import GraphManagerSurface

    class _AfdGraphManager(GraphManagerSurface, Protocol):
        afd_policy: SplitPolicy


class SplitPolicy:
    """How many micro-batches a step runs in; see docs/internals/micro-batching.md."""

    def __init__(self, config: UBatchConfig, *, decode_query_len: int) -> None:
        self.config = config
        self.decode_query_len = decode_query_len
        self.active = False  # see activate / deactivate
        self._paused = 0
        self._lock = threading.Lock()

    def activate(self) -> None:
        """Steps may split from now on (the runner's micro-batch runner exists)."""
        self.active = True

    def deactivate(self) -> None:
        """Every step runs unsplit from now on (the AFD session ended)."""
        self.active = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every step dispatched inside runs unsplit (dummy runs)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def num_ubatches(self, num_tokens: int, uniform_token_count: int | None) -> int:
        if not self.active or self._paused:
            return 1
        return self.config.split(num_tokens, uniform_decode=uniform_token_count == self.decode_query_len)


_CLASSES: dict[type[GraphManagerSurface], type[GraphManagerSurface]] = {}


def afd_graph_manager_class(base: type[GraphManagerSurface]) -> type[GraphManagerSurface]:
    """``Afd<ModelCudaGraphManager>``: ``base`` whose ``dispatch`` asks a :class:`SplitPolicy` (cached per base).

    Constructed with upstream's arguments plus ``policy=``.
    """
    if base not in _CLASSES:

        def __init__(self: _AfdGraphManager, *args: object, policy: SplitPolicy, **kwargs: object) -> None:
            self.afd_policy = policy
            base.__init__(self, *args, **kwargs)

        def dispatch(
            self: _AfdGraphManager,
            num_reqs: int,
            num_tokens: int,
            uniform_token_count: int | None,
            num_active_loras: int,
            max_query_len: int | None = None,
            num_ubatches: int = 1,
        ) -> object:
            if num_ubatches == 1:
                num_ubatches = self.afd_policy.num_ubatches(num_tokens, uniform_token_count)
            return base.dispatch(
                self,
                num_reqs,
                num_tokens,
                uniform_token_count,
                num_active_loras,
                max_query_len=max_query_len,
                num_ubatches=num_ubatches,
            )

        _CLASSES[base] = type(
            f"Afd{base.__name__}",
            (base,),
            {
                "__module__": __name__,
                "__doc__": f"{base.__qualname__} whose dispatch splits steps by afd-mrv2's SplitPolicy.",
                "__init__": __init__,
                "dispatch": dispatch,
            },
        )
    return _CLASSES[base]
