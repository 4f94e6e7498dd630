"""Foundation change: the recording backend's current stream is one stream per name."""

from __future__ import annotations

import pytest

from afd_mrv2.devices import RecordingBackend


def test_current_stream_is_shared_and_new_stream_names_stay_unique() -> None:
    backend = RecordingBackend()
    serial = backend.current_stream("serial")
    assert backend.current_stream("serial") is serial  # executor and ubatch wrapper ask for it alike
    assert backend.new_stream("comm") is not serial
    with pytest.raises(ValueError, match="'comm' is already used"):
        backend.new_stream("comm")
    with pytest.raises(ValueError, match="'serial' is already used"):
        backend.new_stream("serial")
