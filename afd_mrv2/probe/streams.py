"""Classifying an operator's stream behaviour by running it.

The question: when the caller's stream has passed an operator call, is the
operator's effect (outputs written, data handed to the peer) complete?  If the
operator enqueues on the caller's current stream, yes: stream order covers it.
If not, it ran (or still runs) elsewhere and needs the fence of
:mod:`afd_mrv2.hooks.cam.ops`.

:func:`classify_late` is the check for backends whose streams run host code (the
host backend, the CPU doubles): call the operator on a probe stream, record an
event after it, wait for the event, then look at the effect at once.
``afd-mrv2 probe npu`` adds the device-side escape check (``_escape`` in
:mod:`afd_mrv2.probe.npu`, both ranks, both directions): hold the caller's stream
behind a long kernel and see whether the effect appears anyway; that one cannot
be fooled by an operator that is merely fast.
"""

from __future__ import annotations

from collections.abc import Callable

from afd_mrv2.devices.base import DeviceBackend
from afd_mrv2.hooks.cam.evidence import StreamBehaviour

ProbeCheck = Callable[[], bool]


def classify_late(
    backend: DeviceBackend, run: Callable[[], ProbeCheck], *, timeout_s: float = 30.0
) -> tuple[StreamBehaviour, str]:
    """Run ``run()`` (which calls the operator and returns an effect check) on a probe stream."""
    stream = backend.new_stream("probe")
    event = backend.new_event()
    box: dict[str, ProbeCheck] = {}
    stream.submit(lambda: box.__setitem__("check", run()))
    stream.record(event)
    if not event.synchronize(timeout=timeout_s):
        raise TimeoutError(f"probe: the operator call did not return within {timeout_s:g} s")
    if "check" not in box:
        raise RuntimeError("probe: the operator call failed on the probe stream")
    if box["check"]():
        return StreamBehaviour.CURRENT, "effect complete when the caller's stream passed the call"
    return StreamBehaviour.FOREIGN, "effect still pending after the caller's stream passed the call"
