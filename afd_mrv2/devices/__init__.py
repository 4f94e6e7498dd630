"""Stream/event backends: ``accelerator`` (torch.Stream/torch.Event), ``host``
(a worker thread per stream), ``inline`` (every stream on the submitting thread)
and ``recording`` (deterministic op log).

All four implement :class:`~afd_mrv2.devices.base.DeviceBackend`; see
:mod:`afd_mrv2.devices.base` for the semantics they share.
"""

from __future__ import annotations

from afd_mrv2.devices.base import BackendCloseReport, DeviceBackend, Event, Span, Stream
from afd_mrv2.devices.host import HostBackend
from afd_mrv2.devices.inline import InlineBackend
from afd_mrv2.devices.recording import RecordingBackend

__all__ = [
    "BackendCloseReport",
    "DeviceBackend",
    "Event",
    "HostBackend",
    "InlineBackend",
    "RecordingBackend",
    "Span",
    "Stream",
    "make_backend",
]


def make_backend(name: str, *, timing: bool = True) -> DeviceBackend:
    """Build a backend by its config name (``auto`` picks accelerator, else host)."""
    if name == "auto":
        from afd_mrv2.devices.accelerator import accelerator_available

        name = "accelerator" if accelerator_available() else "host"
    if name == "host":
        return HostBackend()
    if name == "inline":
        return InlineBackend()
    if name == "recording":
        return RecordingBackend()
    if name == "accelerator":
        from afd_mrv2.devices.accelerator import AcceleratorBackend

        return AcceleratorBackend(timing=timing)
    raise ValueError(f"unknown stream backend {name!r}; accepted: auto, accelerator, host, inline, recording")
