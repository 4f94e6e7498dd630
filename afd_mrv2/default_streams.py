"""The default ``create_streams`` implementation, registered by afd-mrv2 itself."""

from __future__ import annotations

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices.base import DeviceBackend, Stream
from afd_mrv2.hookspecs import hookimpl
from afd_mrv2.items import PHASES


class DefaultStreams:
    """Registered by afd-mrv2 itself; runs after every other ``create_streams``."""

    @hookimpl(trylast=True)
    def create_streams(
        self, backend: DeviceBackend, roles: tuple[str, ...], config: MultistreamConfig
    ) -> dict[str, Stream]:
        if not config.enabled:
            serial = backend.current_stream("serial")
            return {role: serial for role in roles}
        streams: dict[str, Stream] = {}
        compute: Stream | None = None
        for role in roles:
            if role in PHASES and role not in config.phases:  # compute, and recv/send without a stream
                compute = compute or backend.current_stream("compute")
                streams[role] = compute
            else:
                streams[role] = backend.new_stream(role)
        return streams
