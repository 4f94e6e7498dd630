"""The UBatchRunner subclass whose comm and capture streams come from ``create_streams``.

Upstream's ``UBatchRunner.__init__`` hard-codes ``self.comm_stream = torch.cuda.Stream(...)``
and ``self.capture_stream = torch.cuda.Stream(...)``, and ``begin_capturable_run``
reads the two attributes.  Upstream offers no factory for either, so the subclass
declares them as properties: upstream's ``__init__`` runs unchanged (its
assignments land in the property setters and are kept, unused, in
``upstream_streams``), and upstream's ``begin_capturable_run`` runs unchanged,
reading the streams afd-mrv2 created through the ``create_streams`` hook (roles
``("comm", "capture")``) on the executor's device backend.  On CUDA and NPU the
attribute is the backend stream's ``torch.Stream`` (NPU through torch_npu's
``torch.Stream`` subclass); on the CPU backends it is the backend's own stream.

Nothing is assigned into upstream's class or module: the subclass is ours, built
per upstream base class by :func:`afd_ubatch_runner_class`.

Cost, documented: upstream's constructor still creates its two streams (dropped
unused), and the runner vLLM built first is replaced, not reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afd_mrv2.devices.base import Stream

UBATCH_ROLES = ("comm", "capture")

_CLASSES: dict[type, type] = {}


def _native(stream: Stream) -> Any:
    native = stream.native
    return stream if native is None else native


def _stream_attribute(role: str) -> property:
    """Upstream's ``<role>_stream`` attribute: reads return afd-mrv2's stream, upstream's assignment is kept aside."""

    def get(self: AfdStreamsMixin) -> Any:
        return _native(self._afd_streams[role])

    def keep_aside(self: AfdStreamsMixin, value: Any) -> None:
        self._afd_upstream_streams[role] = value

    return property(get, keep_aside, doc=f"the {role!r} stream from create_streams (upstream's own is kept aside)")


class AfdStreamsMixin:
    """Mixed in before upstream's UBatchRunner; see the module docstring."""

    def __init__(self, *args: Any, afd_streams: Mapping[str, Stream], **kwargs: Any) -> None:
        if set(afd_streams) != set(UBATCH_ROLES):
            raise ValueError(
                f"afd_streams needs exactly the roles {', '.join(UBATCH_ROLES)}, got {sorted(afd_streams)}"
            )
        self._afd_streams = dict(afd_streams)
        self._afd_upstream_streams: dict[str, Any] = {}
        super().__init__(*args, **kwargs)

    @property
    def afd_streams(self) -> dict[str, Stream]:
        """The backend streams from ``create_streams``, by role."""
        return dict(self._afd_streams)

    @property
    def upstream_streams(self) -> dict[str, Any]:
        """What upstream's ``__init__`` assigned to comm_stream/capture_stream (unused)."""
        return dict(self._afd_upstream_streams)

    comm_stream = _stream_attribute("comm")
    capture_stream = _stream_attribute("capture")


def afd_ubatch_runner_class(base: type) -> type:
    """``AfdUBatchRunner``: :class:`AfdStreamsMixin` over upstream's ``base`` (cached per base)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(
            f"Afd{base.__name__}",
            (AfdStreamsMixin, base),
            {"__module__": __name__, "__doc__": f"{base.__qualname__} with streams from create_streams."},
        )
    return _CLASSES[base]
