"""Stand-in for vllm.utils.torch_utils.current_stream: a per-thread placeholder, as inside a vLLM CPU worker."""

from __future__ import annotations

import threading

_LOCAL = threading.local()


class _StreamPlaceholder:
    """What vLLM's CPU worker hands out for a stream (one per thread)."""


def current_stream():
    stream = getattr(_LOCAL, "stream", None)
    if stream is None:
        stream = _LOCAL.stream = _StreamPlaceholder()
    return stream
