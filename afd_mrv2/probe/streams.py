"""Classifying an operator's stream behaviour by running it: :func:`classify_late`.

See docs/internals/cam-connectors.md, "afd_mrv2.probe.streams".
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
